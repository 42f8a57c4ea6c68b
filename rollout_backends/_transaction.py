"""The weight-update transaction and the protocol helpers every backend shares.

``weight_update`` is the one place that sequences a weight update; backends only supply the
individual steps. Its guarantees:

* every worker it tried to pause is resumed, whatever failed (resume runs in ``finally``);
* an opened update session (``begin``) is always closed (``end``);
* the new version label is set only after the body succeeded, and if setting or closing fails,
  the labels already moved are put back, so no half-updated fleet advertises the new version;
* any failure raises ``WeightUpdateFailed`` naming each worker and step.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs

from rollout_backends._errors import (
    BackendUnavailable,
    ControlFailed,
    InvalidRequest,
    RolloutBackendError,
    WeightUpdateFailed,
    WorkerFailure,
)
from rollout_backends._protocol import RolloutBackend
from rollout_backends._tensors import TensorBuckets
from rollout_backends._types import (
    GenerateRequest,
    Generation,
    HealthReport,
    PauseMode,
    SamplingParams,
    WeightBucket,
)

__all__ = ["WeightUpdateTransaction", "generate_group", "group_requests", "wait_ready", "weight_update"]


@attrs.define(slots=True)
class WeightUpdateTransaction:
    """Handed to the body of ``weight_update``: the loaders to call, with the right flags.

    The loaders never pass ``version`` (the label moves only at commit) and never flush (the
    transaction flushed already, or must not in ``IN_PLACE`` mode).
    """

    backend: RolloutBackend
    version: str
    mode: PauseMode
    previous: Mapping[str, str | None]
    #: False when the prefix cache could not be dropped (``IN_PLACE`` with frozen requests holding
    #: KV): prefixes cached under the old weights may then still be served after the update.
    cache_flushed: bool = True

    async def update_from_distributed(self, bucket: WeightBucket, *, group_name: str = "weight_update_group") -> None:
        await self.backend.update_weights_from_distributed(bucket, group_name=group_name, flush_cache=False)

    async def update_from_tensors(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        *,
        load_format: str | None = None,
        buckets: TensorBuckets | None = None,
    ) -> None:
        """Load in-memory tensors on the same host (CUDA IPC on GPU).

        With ``buckets`` the tensors are copied into its flat buffers (reused from push to push)
        and sent bucket by bucket: each bucket as one flat tensor where the backend declares
        ``flattened_buckets``, else as the bucket's views (per-tensor payloads over one storage).
        """
        if buckets is None:
            named = named_tensors if isinstance(named_tensors, Sequence) else list(named_tensors)
            await self.backend.update_weights_from_tensors(named, flush_cache=False, load_format=load_format)
            return
        if load_format is not None:
            raise InvalidRequest("load_format", "is the buckets' own (flattened_bucket, or per tensor if undeclared)")
        flat = self.backend.capabilities.flattened_buckets
        for bucket in buckets.pack(named_tensors):
            await self.backend.update_weights_from_tensors(bucket if flat else bucket.views(), flush_cache=False)

    async def update_from_disk(self, path: str, *, load_format: str | None = None) -> None:
        await self.backend.update_weights_from_disk(path, load_format=load_format, flush_cache=False)


def _failures(step: str, exc: BaseException, workers: Sequence[str]) -> list[WorkerFailure]:
    if isinstance(exc, ControlFailed):
        return [WorkerFailure(f.worker, step, f.message) for f in exc.failures]
    worker = getattr(exc, "worker", None)
    targets = [worker] if isinstance(worker, str) else list(workers) or ["*"]
    msg = f"{type(exc).__name__}: {exc}"
    return [WorkerFailure(w, step, msg) for w in targets]


#: ``weight_update``'s step runner: runs a named step, records its failures, says whether it succeeded.
_StepRunner = Callable[[str, Callable[[], Awaitable[None]]], Awaitable[bool]]


async def _pause_and_flush(backend: RolloutBackend, mode: PauseMode, step: _StepRunner) -> tuple[bool, bool]:
    """``weight_update``'s first steps: pause, then flush the prefix cache. Returns ``(ok,
    cache_flushed)``; the caller resumes whatever this paused, in its ``finally``."""
    ok = await step("pause", lambda: backend.pause(mode))
    cache_flushed = True
    if ok and mode is not PauseMode.IN_PLACE:
        ok = await step("flush_cache", backend.flush_cache)
    elif ok:
        # IN_PLACE: an engine refuses to flush while frozen requests hold KV, and that is not a
        # failure. When none is frozen the flush succeeds, and prefixes cached under the old
        # weights are not served after the update (miles#2783).
        try:
            await backend.flush_cache()
        except RolloutBackendError:
            cache_flushed = False
    return ok, cache_flushed


async def _restore_labels(
    backend: RolloutBackend, previous: Mapping[str, str | None], prev_common: str | None, step: _StepRunner
) -> None:
    """After a failed update whose labels may have moved: put each worker's old label back and
    declare the old common version (``None`` where workers disagreed before)."""
    # Put back the labels that moved: a half-updated fleet must not advertise `version`.
    for worker, old in previous.items():
        if old is not None:
            await step("rollback_version", functools.partial(backend.set_weight_version, old, workers=[worker]))
    # The fleet is expected to serve the old version again: declare it (a set_version that
    # succeeded declared `version`). Where workers disagreed before, None withdraws it.
    backend.expect_version(prev_common)


@asynccontextmanager
async def weight_update(
    backend: RolloutBackend,
    version: str,
    *,
    mode: PauseMode = PauseMode.RETRACT,
    selector: str = "all",
) -> AsyncIterator[WeightUpdateTransaction]:
    """Pause → flush (unless ``IN_PLACE``) → begin → *body* → set version → end → resume.

    Usage::

        async with backend.weight_update("step-7") as tx:
            await tx.update_from_disk("/ckpt/step-7")

    Raises ``WeightUpdateFailed`` (the version is not advanced; every worker is resumed).
    """
    if not isinstance(version, str) or not version:
        raise InvalidRequest("version", "must be a non-empty string")
    mode = PauseMode(mode)
    caps = backend.capabilities
    workers = backend.workers
    failures: list[WorkerFailure] = []
    try:
        previous = dict(await backend.weight_versions())
    except RolloutBackendError as exc:
        raise WeightUpdateFailed(_failures("read_version", exc, workers), version=version, previous=None) from exc
    prev_common = next(iter(previous.values()), None) if len(set(previous.values())) == 1 else None

    async def step(name: str, call: Callable[[], Awaitable[None]]) -> bool:
        try:
            await call()
            return True
        except Exception as exc:  # any failure is recorded against the step; cleanup still runs
            failures.extend(_failures(name, exc, workers))
            return False

    began: list[str] = []
    labelled = False
    first_exc: BaseException | None = None
    try:
        ok, cache_flushed = await _pause_and_flush(backend, mode, step)
        if ok and caps.begin_end_update:
            n_failed = len(failures)
            ok = await step("begin", lambda: backend.begin_weight_update(selector))
            # Close the session wherever it opened, even if it failed to open elsewhere.
            failed_here = {f.worker for f in failures[n_failed:]}
            began = [w for w in workers if w not in failed_here]
        if ok:
            tx = WeightUpdateTransaction(backend, version, mode, previous, cache_flushed)
            try:
                yield tx
            except Exception as exc:
                first_exc = exc
                failures.extend(_failures("update", exc, workers))
                ok = False
        if ok:
            labelled = True
            ok = await step("set_version", lambda: backend.set_weight_version(version))
        if began:
            closing, began = began, []
            ok = await step("end", functools.partial(backend.end_weight_update, workers=closing)) and ok
        if not ok and labelled:
            await _restore_labels(backend, previous, prev_common, step)
    except BaseException as exc:  # cancellation or an error thrown into the body's frame
        first_exc = first_exc or exc
        failures.extend(_failures("update", exc, workers))
        raise
    finally:
        if began:
            await step("end", functools.partial(backend.end_weight_update, workers=began))
        # Resume everything we may have paused, even after a cancellation.
        await asyncio.shield(step("resume", backend.resume))
    if failures:
        raise WeightUpdateFailed(failures, version=version, previous=prev_common) from first_exc


async def wait_ready(
    backend: RolloutBackend,
    timeout: float = 60.0,
    *,
    interval: float = 0.1,
    on_poll: Callable[[HealthReport], None] | None = None,
) -> HealthReport:
    """Poll ``health()`` until every worker is ready; ``BackendUnavailable`` names those that are not."""
    deadline = time.monotonic() + timeout
    report: HealthReport | None = None
    while True:
        report = await backend.health()
        if on_poll is not None:
            on_poll(report)
        if report.ready:
            return report
        if time.monotonic() >= deadline:
            bad = report.unhealthy_workers or ("<router>",)
            detail = "; ".join(
                f"{w.worker}: live={w.live} ready={w.ready}" + (f" ({w.error})" if w.error else "")
                for w in report.workers
                if w.worker in bad
            )
            raise BackendUnavailable(f"not ready after {timeout:.1f}s: {', '.join(bad)}. {detail}")
        await asyncio.sleep(interval)


def group_requests(
    input_ids: Sequence[int],
    n: int,
    sampling: SamplingParams | None = None,
    *,
    base_seed: int | None = None,
    group_id: str | None = None,
) -> list[GenerateRequest]:
    """The ``n`` requests of one group: ids ``<group_id>-<i>``, one routing key, seeds ``seed0 + i``.

    ``seed0`` is ``base_seed`` where given, else the sampling seed (no seeds if neither is set).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidRequest("n", f"must be an int >= 1, got {n!r}")
    sampling = sampling or SamplingParams()
    group_id = group_id or uuid.uuid4().hex
    seed0 = base_seed if base_seed is not None else sampling.seed
    return [
        GenerateRequest(
            input_ids=tuple(input_ids),
            sampling=sampling if seed0 is None else sampling.replace(seed=seed0 + i),
            request_id=f"{group_id}-{i}",
            routing_key=group_id,
        )
        for i in range(n)
    ]


async def generate_group(
    backend: RolloutBackend,
    input_ids: Sequence[int],
    n: int,
    sampling: SamplingParams | None = None,
    *,
    base_seed: int | None = None,
    group_id: str | None = None,
) -> list[Generation]:
    """``n`` samples of one prompt as ``n`` concurrent requests sharing a routing key.

    Each sample gets its own seed (``base_seed + i`` where given, else the sampling seed + i).
    If any request fails, the others are aborted and the first error is raised: no sample is
    silently dropped or left running.
    """
    requests = group_requests(input_ids, n, sampling, base_seed=base_seed, group_id=group_id)
    tasks = [asyncio.ensure_future(backend.generate(r)) for r in requests]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if t.exception() is not None]
        if failed:
            await asyncio.gather(
                *(backend.abort(r.request_id) for r, t in zip(requests, tasks, strict=False) if not t.done()),
                return_exceptions=True,
            )
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            exc = failed[0].exception()
            assert exc is not None
            raise exc
        return [t.result() for t in tasks]
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
