"""A tiny stand-in for ``ReferenceEngine`` with the same interface (no torch), for server tests.

Output token ``i`` is ``(sum(prompt) + i + 1) % vocab`` with logprob ``-0.1 * (i + 1)``; each
step sleeps ``step_s`` so that abort and pause can land mid-generation.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rollout_backends._errors import InvalidRequest
from rollout_backends._types import FinishReason, GenerateRequest, Generation, PauseMode


class EngineError(Exception):
    pass


class FakeEngine:
    def __init__(self, *, vocab_size: int = 64, max_context: int = 32, worker_id: str = "fake-0",
                 weight_version: str = "v0", step_s: float = 0.0) -> None:  # fmt: skip
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.has_tokenizer = False  # no stop strings
        self.worker_id = worker_id
        self._version = weight_version
        self.step_s = step_s
        self._running = asyncio.Event()
        self._running.set()
        self._aborted: set[str] = set()
        self._inflight: set[str] = set()
        self.calls: list[tuple[Any, ...]] = []
        self.fail_next: str | None = None

    # properties of the real engine
    @property
    def weight_version(self) -> str:
        return self._version

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def _maybe_fail(self, what: str) -> None:
        self.calls.append((what,))
        if self.fail_next == what:
            self.fail_next = None
            raise EngineError(f"{what} exploded")

    async def generate(self, req: GenerateRequest) -> Generation:
        if any(t >= self.vocab_size for t in req.input_ids):
            raise InvalidRequest("input_ids", "out of vocabulary")
        t0 = time.monotonic()
        self._inflight.add(req.request_id)
        out: list[int] = []
        lps: list[float] = []
        reason = FinishReason.LENGTH
        matched = None
        try:
            base = sum(req.input_ids)
            for i in range(req.sampling.max_new_tokens):
                await self._running.wait()
                if req.request_id in self._aborted:
                    reason = FinishReason.ABORT
                    break
                if self.step_s:
                    await asyncio.sleep(self.step_s)
                if req.request_id in self._aborted:
                    reason = FinishReason.ABORT
                    break
                tok = (base + i + 1) % self.vocab_size
                out.append(tok)
                lps.append(-0.1 * (i + 1))
                if not req.sampling.ignore_eos and tok in req.sampling.stop_token_ids:
                    reason, matched = FinishReason.STOP, tok
                    break
        finally:
            self._inflight.discard(req.request_id)
            self._aborted.discard(req.request_id)
        return Generation(
            request_id=req.request_id, output_ids=tuple(out), logprobs=tuple(lps) if req.return_logprobs else None,
            finish_reason=reason, weight_version=self._version, prompt_tokens=len(req.input_ids),
            latency_s=time.monotonic() - t0, matched_stop=matched,
        )  # fmt: skip

    async def abort(self, rid: str) -> bool:
        if rid in self._inflight:
            self._aborted.add(rid)
            return True
        return False

    async def abort_all(self) -> int:
        n = len(self._inflight)
        self._aborted |= self._inflight
        return n

    async def pause(self, mode: PauseMode) -> None:
        self.calls.append(("pause", mode))
        if mode is PauseMode.ABORT:
            await self.abort_all()
        self._running.clear()

    async def resume(self) -> None:
        self.calls.append(("resume",))
        self._running.set()

    async def flush_cache(self, wait_s: float = 0.0) -> None:
        self.calls.append(("flush_cache", wait_s))
        self._maybe_fail("flush_cache")
        if self._inflight and not self.paused:
            raise EngineError("Cache not flushed because there are pending requests.")

    async def update_weights_from_disk(self, path: str, *, load_format: str | None = None,
                                       version: str | None = None, flush_cache: bool = True) -> None:  # fmt: skip
        self.calls.append(("disk", path, load_format, version, flush_cache))
        if path == "/nonexistent":
            raise EngineError(f"no checkpoint at {path}")
        if version is not None:
            self._version = version

    async def update_weights_from_tensors(
        self, named_tensors: Any, *, version: str | None = None, flush_cache: bool = True,
        load_format: str | None = None,
    ) -> None:  # fmt: skip
        if load_format not in (None, "direct"):
            raise EngineError(f"unknown load_format {load_format!r}")
        self.calls.append(("tensors", [(n, t.clone()) for n, t in named_tensors], version, flush_cache))
        if version is not None:
            self._version = version

    async def init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                group_name: str, backend: str) -> None:  # fmt: skip
        self.calls.append(("init_group", master_address, master_port, rank_offset, world_size, group_name, backend))
        if backend == "nccl":
            raise EngineError("nccl needs CUDA; use gloo")

    async def update_weights_from_distributed(
        self, names: Any, dtypes: Any, shapes: Any, *, group_name: str, version: str | None = None,
        flush_cache: bool = True, load_format: str | None = None,
    ) -> None:  # fmt: skip
        if load_format is not None:
            raise EngineError(f"unknown load_format {load_format!r}")
        self.calls.append(("dist", names, dtypes, shapes, group_name, version, flush_cache))
        if version is not None:
            self._version = version

    async def destroy_weight_group(self, group_name: str) -> None:
        self.calls.append(("destroy_group", group_name))

    async def begin_weight_update(self, selector: str) -> None:
        self.calls.append(("begin", selector))

    async def end_weight_update(self) -> None:
        self.calls.append(("end",))

    async def set_weight_version(self, v: str) -> None:
        self.calls.append(("set_version", v))
        self._version = v

    async def release_memory(self, tags: Any) -> None:
        self.calls.append(("release", tags))

    async def resume_memory(self, tags: Any) -> None:
        self.calls.append(("resume_memory", tags))


def factory(args: Any) -> FakeEngine:
    """``--engine-factory fake_engine:factory`` for CLI tests."""
    return FakeEngine(worker_id=args.worker_id or f"{args.host}:{args.port}", weight_version=args.weight_version,
                      step_s=0.01, max_context=4096)  # fmt: skip
