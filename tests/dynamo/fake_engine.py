"""A deterministic fake engine with the reference engine's interface (for worker spikes/tests).

Token ``i`` of a request is ``(sum(input_ids) * 31 + 7 * i + version_salt) % vocab`` and its
logprob is ``-(0.01 * (i + 1)) - 0.001 * (token % 97)``, so a test can recompute both exactly.
``delay`` (seconds per token) makes requests slow enough to abort. ``stop_token_ids`` end the
generation with ``FinishReason.STOP`` when produced (unless ``ignore_eos``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from rollout_backends._types import FinishReason, GenerateRequest, Generation, PauseMode

VOCAB = 1000


def expected(input_ids: list[int], n: int, version_salt: int = 0) -> tuple[list[int], list[float]]:
    base = sum(input_ids) * 31 + version_salt
    ids = [(base + 7 * i) % VOCAB for i in range(n)]
    lps = [-(0.01 * (i + 1)) - 0.001 * (t % 97) for i, t in enumerate(ids)]
    return ids, lps


class FakeEngine:
    def __init__(self, delay: float = 0.0, name: str = "fake") -> None:
        self.delay = delay
        self.name = name
        self._version: str | None = None
        self._salt = 0
        self._aborted: set[str] = set()
        self._paused = asyncio.Event()
        self._paused.set()  # set = running
        self.calls: list[tuple[str, Any]] = []

    @property
    def weight_version(self) -> str | None:
        return self._version

    async def generate(self, req: GenerateRequest) -> Generation:
        await self._paused.wait()
        n = req.sampling.max_new_tokens
        ids, lps = expected(list(req.input_ids), n, self._salt)
        out_ids: list[int] = []
        out_lps: list[float] = []
        reason = FinishReason.LENGTH
        matched = None
        for t, lp in zip(ids, lps, strict=True):
            if req.request_id in self._aborted:
                reason = FinishReason.ABORT
                break
            if self.delay:
                await asyncio.sleep(self.delay)
            out_ids.append(t)
            out_lps.append(lp)
            if not req.sampling.ignore_eos and t in req.sampling.stop_token_ids:
                reason, matched = FinishReason.STOP, t
                break
        self._aborted.discard(req.request_id)
        return Generation(
            request_id=req.request_id,
            output_ids=tuple(out_ids),
            logprobs=tuple(out_lps),
            finish_reason=reason,
            weight_version=self._version,
            prompt_tokens=len(req.input_ids),
            cached_tokens=3 if len(req.input_ids) >= 3 else 0,
            worker=self.name,
            matched_stop=matched,
        )

    async def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))
        self._aborted.add(request_id)

    async def pause(self, mode: PauseMode = PauseMode.RETRACT) -> None:
        self.calls.append(("pause", mode.value))
        self._paused.clear()

    async def resume(self) -> None:
        self.calls.append(("resume", None))
        self._paused.set()

    async def flush_cache(self) -> None:
        self.calls.append(("flush_cache", None))

    async def update_weights_from_disk(self, path: str, *, version: str | None = None, **_: Any) -> None:
        self.calls.append(("update_weights_from_disk", path))
        self._salt = len(path)
        if version is not None:
            self._version = version

    async def update_weights_from_tensors(self, named: Any, *, version: str | None = None, **_: Any) -> None:
        self.calls.append(("update_weights_from_tensors", len(named)))
        if version is not None:
            self._version = version

    async def init_weight_group(self, group: Any) -> None:
        self.calls.append(("init_weight_group", group.group_name))

    async def update_weights_from_distributed(self, bucket: Any, **kw: Any) -> None:
        self.calls.append(("update_weights_from_distributed", bucket.names))
        if kw.get("version") is not None:
            self._version = kw["version"]

    async def destroy_weight_group(self, group_name: str = "weight_update_group") -> None:
        self.calls.append(("destroy_weight_group", group_name))

    async def set_weight_version(self, version: str) -> None:
        self.calls.append(("set_weight_version", version))
        self._version = version

    async def release_memory(self, tags: Any = None) -> None:
        self.calls.append(("release_memory", tags))

    async def resume_memory(self, tags: Any = None) -> None:
        self.calls.append(("resume_memory", tags))


def make(arg: str = "") -> FakeEngine:
    """Factory for ``--engine tests.dynamo.fake_engine:make --engine-arg '{"delay": 0.05}'``."""
    cfg = json.loads(arg) if arg else {}
    return FakeEngine(**cfg)
