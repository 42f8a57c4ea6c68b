"""``NoComputeEngine``: the reference server's engine interface with no model behind it.

Why it exists: client-overhead benchmarks (issue 7) need the *real* reference server code path
(``_server.py``: SGLang's native routes, request validation, response shapes) answering as fast as
it can, so that what is measured is the client and the HTTP server, not a forward pass. It needs
no torch and no model directory. ``rollout-backends serve-reference --no-compute N`` serves it.

Every generation answers at once with a fixed, deterministic sequence: output token ``i`` is
``(1000 + 7 * i) % vocab_size`` with logprob ``-(i + 1) / 100``, ``min(N, max_new_tokens)`` of
them, cut after the first token in ``stop_token_ids`` (unless ``ignore_eos``), like a model that
always says the same thing. Sampling parameters are accepted and validated by the server, then
ignored (there is nothing to sample from).

Control: pause gates new generations until ``resume`` (SGLang's pause gate); abort finds nothing
in flight (answers are immediate); ``flush_cache``, ``set_weight_version`` and the
``begin``/``end_weight_update`` session work; anything that needs weights or device memory
(weight loads, weight groups, memory release) is refused with ``EngineError``, so no caller can
believe weights were installed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from rollout_backends import FinishReason, GenerateRequest, Generation, InvalidRequest, MemoryTag, PauseMode

from ._engine import EngineError

__all__ = ["NoComputeEngine"]

_NO_WEIGHTS = "the no-compute engine has no weights or device memory (serve-reference --no-compute)"


class NoComputeEngine:
    """A ``ReferenceEngine`` stand-in that answers ``output_tokens`` fixed tokens at once."""

    def __init__(
        self,
        output_tokens: int = 8,
        *,
        worker_id: str = "no-compute",
        weight_version: str = "default",
        vocab_size: int = 151936,
        max_context: int = 32768,
    ) -> None:
        if isinstance(output_tokens, bool) or not isinstance(output_tokens, int) or output_tokens < 1:
            raise InvalidRequest("output_tokens", f"must be an int >= 1, got {output_tokens!r}")
        if vocab_size < 1:
            raise InvalidRequest("vocab_size", f"must be >= 1, got {vocab_size!r}")
        if max_context < 2:
            raise InvalidRequest("max_context", f"must be >= 2, got {max_context!r}")
        self.output_tokens = output_tokens
        self.worker_id = worker_id
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.has_tokenizer = False  # stop strings are refused by the server
        self._version = weight_version
        # The answer is built once; each request slices it (no per-request Python loop).
        self._ids = tuple((1000 + 7 * i) % vocab_size for i in range(output_tokens))
        self._lps = tuple(-(i + 1) / 100 for i in range(output_tokens))
        self._paused: PauseMode | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._session: str | None = None
        self.requests_finished = 0

    @property
    def weight_version(self) -> str:
        return self._version

    @property
    def paused(self) -> PauseMode | None:
        return self._paused

    async def generate(self, request: GenerateRequest) -> Generation:
        if self._paused is not None:
            await self._resumed.wait()
        s = request.sampling
        n = min(self.output_tokens, s.max_new_tokens)
        ids = self._ids[:n]
        reason, matched = FinishReason.LENGTH, None
        if s.stop_token_ids and not s.ignore_eos:
            stops = set(s.stop_token_ids)
            for i, t in enumerate(ids):
                if t in stops:
                    ids, reason, matched = ids[: i + 1], FinishReason.STOP, t
                    break
        self.requests_finished += 1
        return Generation(
            request_id=request.request_id,
            output_ids=ids,
            logprobs=self._lps[: len(ids)] if request.return_logprobs else None,
            finish_reason=reason,
            weight_version=self._version,
            prompt_tokens=len(request.input_ids),
            latency_s=0.0,
            matched_stop=matched,
        )

    # -- control ----------------------------------------------------------------------------

    async def abort(self, request_id: str) -> bool:
        return False  # every answer is immediate: nothing is ever in flight to abort

    async def abort_all(self) -> int:
        return 0

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        self._paused = PauseMode(mode)
        self._resumed.clear()

    async def resume(self) -> None:
        self._paused = None
        self._resumed.set()

    async def flush_cache(self, wait_s: float = 0.0) -> None:
        return None  # nothing is cached

    async def set_weight_version(self, version: str) -> None:
        self._version = version

    async def begin_weight_update(self, selector: str = "all") -> None:
        if self._session is not None:
            raise EngineError(f"a weight update ({self._session!r}) is already open")
        self._session = selector

    async def end_weight_update(self) -> None:
        if self._session is None:
            raise EngineError("no weight update is open")
        self._session = None

    async def update_weights_from_disk(self, path: str, **kw: Any) -> None:
        raise EngineError(_NO_WEIGHTS)

    async def update_weights_from_tensors(self, named_tensors: Any, **kw: Any) -> None:
        raise EngineError(_NO_WEIGHTS)

    async def init_weight_group(self, *args: Any, **kw: Any) -> None:
        raise EngineError(_NO_WEIGHTS)

    async def update_weights_from_distributed(self, *args: Any, **kw: Any) -> None:
        raise EngineError(_NO_WEIGHTS)

    async def destroy_weight_group(self, group_name: str = "weight_update_group") -> None:
        raise EngineError(_NO_WEIGHTS)

    async def release_memory(self, tags: Sequence[MemoryTag | str] | None = None) -> None:
        raise EngineError(_NO_WEIGHTS)

    async def resume_memory(self, tags: Sequence[MemoryTag | str] | None = None) -> None:
        raise EngineError(_NO_WEIGHTS)

    async def aclose(self) -> None:
        await self.resume()  # a paused generate must not hang the server's shutdown

    def __repr__(self) -> str:
        return f"NoComputeEngine(output_tokens={self.output_tokens}, worker_id={self.worker_id!r})"
