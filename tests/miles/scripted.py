"""A ``BackendBase`` that answers generations from a script and records every call."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import rollout_backends as rb
from rollout_backends.kit import BackendBase, VersionBook


class ScriptedBackend(BackendBase):
    def __init__(self, workers: Sequence[str] = ("w0", "w1"), *, pinning: bool = True) -> None:
        self._workers = tuple(workers)
        self.capabilities = rb.Capabilities(
            pause_modes=set(rb.PauseMode),
            weight_transports=set(rb.WeightTransport),
            memory_release=True,
            begin_end_update=True,
            worker_pinning=pinning,
            routing=rb.RoutingKind.ROUND_ROBIN,
        )
        self.script: list[rb.Generation] = []
        self.failures: list[BaseException] = []
        self.requests: list[rb.GenerateRequest] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []
        #: What each worker serves (tests may set it directly); ``_versions`` keeps the labels the
        #: calls gave and the expected version.
        self.versions: dict[str, str | None] = dict.fromkeys(self._workers, "default")
        self._versions = VersionBook(self._workers, label="default")
        self.closed = False
        self.hold: asyncio.Event | None = None  # set: generations wait for it (or an abort)
        self._aborted: set[str] = set()

    @property
    def workers(self) -> tuple[str, ...]:
        return self._workers

    def _rec(self, name: str, **kw: Any) -> None:
        self.calls.append((name, kw))

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    async def generate(self, request: rb.GenerateRequest) -> rb.Generation:
        self.requests.append(request)
        if self.failures:
            raise self.failures.pop(0)
        if self.hold is not None:
            while not self.hold.is_set() and request.request_id not in self._aborted:
                await asyncio.sleep(0.01)
            if request.request_id in self._aborted:
                return rb.Generation(
                    request_id=request.request_id,
                    output_ids=(7,),
                    logprobs=(-0.5,),
                    finish_reason=rb.FinishReason.ABORT,
                    weight_version=self.versions[request.worker or self._workers[0]],
                    prompt_tokens=len(request.input_ids),
                    worker=request.worker,
                )
        if self.script:
            return self.script.pop(0)
        n = request.sampling.max_new_tokens
        out = tuple(range(10, 10 + n))
        return rb.Generation(
            request_id=request.request_id,
            output_ids=out,
            logprobs=tuple(-0.1 * (i + 1) for i in range(n)) if request.return_logprobs else None,
            finish_reason=rb.FinishReason.LENGTH,
            weight_version=self.versions[request.worker or self._workers[0]],
            prompt_tokens=len(request.input_ids),
            worker=request.worker,
        )

    async def abort(self, request_id: str) -> None:
        self._rec("abort", request_id=request_id)
        self._aborted.add(request_id)

    async def abort_all(self, *, workers: Sequence[str] | None = None) -> None:
        sel = self._select(workers)
        self._rec("abort_all", workers=sel)
        for r in self.requests:
            if r.worker is None or r.worker in sel:
                self._aborted.add(r.request_id)

    async def pause(self, mode: rb.PauseMode = rb.PauseMode.RETRACT, *, workers: Sequence[str] | None = None) -> None:
        self._rec("pause", mode=self._require_pause_mode(mode), workers=self._select(workers))

    async def resume(self, *, workers: Sequence[str] | None = None) -> None:
        self._rec("resume", workers=self._select(workers))

    async def init_weight_group(self, group: rb.WeightGroup, *, workers: Sequence[str] | None = None) -> None:
        self._rec("init_weight_group", group=group, workers=self._select(workers))

    async def update_weights_from_distributed(
        self,
        bucket: rb.WeightBucket,
        *,
        group_name: str = "weight_update_group",
        version: str | None = None,
        flush_cache: bool = True,
        workers: Sequence[str] | None = None,
    ) -> None:
        sel = self._select(workers)
        self._rec(
            "update_distributed",
            bucket=bucket,
            group_name=group_name,
            version=version,
            flush_cache=flush_cache,
            workers=sel,
        )
        self._label(version, sel)

    async def destroy_weight_group(
        self, group_name: str = "weight_update_group", *, workers: Sequence[str] | None = None
    ) -> None:
        self._rec("destroy_weight_group", group_name=group_name, workers=self._select(workers))

    async def update_weights_from_tensors(
        self,
        named_tensors: Sequence[tuple[str, Any]],
        *,
        version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
        workers: Sequence[str] | None = None,
    ) -> None:
        sel = self._select(workers)
        self._rec(
            "update_tensors",
            named=list(named_tensors),
            version=version,
            flush_cache=flush_cache,
            load_format=load_format,
            workers=sel,
        )
        self._label(version, sel)

    async def update_weights_from_disk(
        self,
        path: str,
        *,
        version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        workers: Sequence[str] | None = None,
    ) -> None:
        sel = self._select(workers)
        if path == "/missing":
            raise rb.ControlFailed("update_weights_from_disk", [rb.WorkerFailure(sel[0], "update", "no such dir")])
        self._rec(
            "update_disk", path=path, version=version, load_format=load_format, flush_cache=flush_cache, workers=sel
        )
        self._label(version, sel)

    def _label(self, version: str | None, workers: Sequence[str]) -> None:
        if version is not None:
            for w in workers:
                self.versions[w] = version
        self._versions.relabelled(version, workers)

    async def begin_weight_update(self, selector: str = "all", *, workers: Sequence[str] | None = None) -> None:
        self._rec("begin", selector=selector, workers=self._select(workers))

    async def end_weight_update(self, *, workers: Sequence[str] | None = None) -> None:
        self._rec("end", workers=self._select(workers))

    async def set_weight_version(self, version: str, *, workers: Sequence[str] | None = None) -> None:
        sel = self._select(workers)
        self._rec("set_version", version=version, workers=sel)
        self._label(version, sel)

    async def weight_versions(self) -> Mapping[str, str | None]:
        return dict(self.versions)

    async def flush_cache(self, *, workers: Sequence[str] | None = None) -> None:
        self._rec("flush_cache", workers=self._select(workers))

    async def release_memory(
        self, tags: Sequence[rb.MemoryTag | str] | None = None, *, workers: Sequence[str] | None = None
    ) -> None:
        self._rec("release_memory", tags=tags, workers=self._select(workers))

    async def resume_memory(
        self, tags: Sequence[rb.MemoryTag | str] | None = None, *, workers: Sequence[str] | None = None
    ) -> None:
        self._rec("resume_memory", tags=tags, workers=self._select(workers))

    async def health(self, *, probe: bool = False) -> rb.HealthReport:
        expected = self._versions.expected
        return rb.HealthReport(
            workers=tuple(
                rb.WorkerHealth(
                    worker=w,
                    live=True,
                    ready=True,
                    making_progress=True if probe else None,
                    weight_version=self.versions[w],
                    stale=VersionBook.is_stale(self.versions[w], expected=expected, live=True),
                )
                for w in self._workers
            ),
            expected_version=expected,
        )

    async def aclose(self) -> None:
        self.closed = True
