"""``HttpFleetBackend``: the protocol over HTTP, for any adapter's wire format.

An adapter supplies a ``Wire``: pure functions from protocol calls to ``HttpRequest`` values and
from ``HttpResponse`` values to results. This module owns everything else, once for all
adapters: sending (through ``HttpClient``), fan-out of control calls to every worker, timeouts,
per-worker version bookkeeping (for engines that do not report versions), and health.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from rollout_backends._base import BackendBase, fan_out
from rollout_backends._errors import (
    BackendClosed,
    BackendUnavailable,
    ContractViolation,
    ControlFailed,
    InvalidRequest,
    RolloutBackendError,
    TransientError,
    Unsupported,
    WorkerFailure,
)
from rollout_backends._http import HttpClient, HttpRequest, HttpResponse
from rollout_backends._ops import (
    AbortAll,
    AbortRequest,
    BeginWeightUpdate,
    Command,
    DestroyWeightGroup,
    EndWeightUpdate,
    FlushCache,
    GetVersion,
    InitWeightGroup,
    Live,
    NamedTensors,
    Operation,
    Pause,
    Probe,
    Progress,
    Ready,
    ReleaseMemory,
    Resume,
    ResumeMemory,
    SetVersion,
    UpdateFromDisk,
    UpdateFromDistributed,
    UpdateFromTensors,
)
from rollout_backends._types import (
    Capabilities,
    FinishReason,
    GenerateRequest,
    Generation,
    HealthReport,
    MemoryTag,
    PauseMode,
    VersionSource,
    WeightBucket,
    WeightGroup,
    WeightTransport,
    WorkerHealth,
    ensure_tags,
)
from rollout_backends._versions import VersionBook

__all__ = ["HttpFleetBackend", "Wire", "Worker"]


def _cancelling() -> bool:
    """Whether the current task itself is being cancelled (3.11+; on 3.10 assume not)."""
    task = asyncio.current_task()
    counter = getattr(task, "cancelling", None)
    return bool(counter()) if counter is not None else False


@attrs.frozen(slots=True, kw_only=True)
class Worker:
    """One engine of a fleet, as the client reaches it."""

    id: str
    #: Base URL of the worker's control routes (SGLang: the server; Dynamo: its system port).
    control_url: str
    #: Where to send generation pinned to this worker, if it can be reached directly.
    generate_url: str | None = None
    #: An engine-specific id the router knows the worker by (Dynamo instance id).
    instance_id: Any = None
    #: How many ranks this worker contributes to a weight-update group (its TP size).
    ranks: int = 1


class Wire(Protocol):
    """An adapter's wire format. Pure: no I/O, no state beyond configuration.

    Every optional feature is a declared member (``aborts_by_id``, ``router_health``), never found
    by reflection or by calling a builder to see what comes back.
    """

    def capabilities(self) -> Capabilities: ...

    @property
    def aborts_by_id(self) -> bool:
        """Whether every worker aborts one request by id (``AbortRequest``) and answers its partial
        tokens; if not, the fleet cancels its own in-flight HTTP call for that request instead."""
        ...

    def generate(self, request: GenerateRequest, worker: Worker | None) -> HttpRequest:
        """Build the generation call: to ``worker`` when pinned, else to the fleet's entry point."""
        ...

    def parse_generation(
        self, request: GenerateRequest, response: HttpResponse, latency_s: float, *, worker: str | None = None
    ) -> Generation:
        """Parse a generation answer (any status). Raise ``InvalidRequest`` for a rejected input,
        ``ContractViolation`` for a malformed answer. ``worker`` is the id of the worker the fleet
        knows served the call (pinned, or the only one), else ``None``; ``Generation.worker`` is
        the worker id if known."""
        ...

    def control(self, op: Operation, worker: Worker) -> HttpRequest | None:
        """Build a control call; ``None`` = nothing to send on this engine (a no-op step; for
        ``Ready``: ready when live; for ``GetVersion``: the engine does not report it)."""
        ...

    def parse_control(self, op: Command, worker: Worker, response: HttpResponse) -> None:
        """Check a command's answer: return, or raise ``ControlFailed``/``ContractViolation``."""
        ...

    def parse_version(self, worker: Worker, response: HttpResponse) -> str | None:
        """The version a ``GetVersion`` answer reports."""
        ...

    def parse_probe(self, probe: Probe, worker: Worker, response: HttpResponse) -> bool:
        """The answer of a ``Live``/``Ready``/``Progress`` probe (any status)."""
        ...

    def router_health(self) -> HttpRequest | None:
        """The entry point's liveness call; ``None`` where there is no router (one server)."""
        ...


def _check_version(version: object, field: str = "version") -> None:
    if version is not None and (not isinstance(version, str) or not version):
        raise InvalidRequest(field, f"must be a non-empty string or None, got {version!r}"[:200])


class HttpFleetBackend(BackendBase):
    """The ``RolloutBackend`` protocol over HTTP for a fleet of workers behind one entry point."""

    def __init__(
        self,
        wire: Wire,
        workers: Sequence[Worker],
        *,
        client: HttpClient | None = None,
        name: str = "http",
        on_close: Any = None,
    ) -> None:
        if not workers:
            raise InvalidRequest("workers", "a fleet needs at least one worker")
        ids = [w.id for w in workers]
        if len(set(ids)) != len(ids):
            raise InvalidRequest("workers", f"duplicate worker ids: {ids}")
        self.wire = wire
        self.client = client or HttpClient()
        self.name = name
        self._workers: dict[str, Worker] = {w.id: w for w in workers}
        #: The one worker of a single-worker fleet: it served every unpinned call.
        self._sole_worker: str | None = ids[0] if len(ids) == 1 else None
        self.capabilities: Capabilities = wire.capabilities()
        # The version each worker was last told to serve (used where engines do not report it), and
        # the version the fleet is expected to serve.
        self._versions = VersionBook(ids)
        self._paused: set[str] = set()
        # Whether every worker can abort one request by id; if not, abort() cancels our HTTP call.
        self._abort_by_id = wire.aborts_by_id
        # generate() calls in flight by request id (only tracked where abort cancels them).
        self._inflight: dict[str, asyncio.Future[HttpResponse]] = {}
        self._cancelled: set[str] = set()
        self._on_close = on_close
        self._closed = False

    # -- bookkeeping --------------------------------------------------------------------------

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self._workers)

    def worker(self, worker_id: str) -> Worker:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise InvalidRequest("worker", f"unknown worker {worker_id!r} (known: {sorted(self._workers)})") from None

    def set_installed_version(self, version: str | None, workers: Sequence[str] | None = None) -> None:
        """Record the version workers serve (a launcher knows the start-up version); declares nothing."""
        self._versions.record(version, workers)

    async def _send_control(self, op: Operation, worker_id: str) -> HttpResponse | None:
        req = self.wire.control(op, self._workers[worker_id])
        if req is None:
            return None
        if req.timeout is None:
            req = attrs.evolve(req, timeout=self.client.control_timeout)
        try:
            return await self.client.send(req, worker=worker_id)
        except RolloutBackendError as exc:
            raise ControlFailed(op.name, [WorkerFailure(worker_id, op.name, str(exc))]) from exc

    async def _control(self, op: Command, worker_id: str) -> None:
        """One command on one worker (the seam fault injection shadows: ``gpu_tier``)."""
        resp = await self._send_control(op, worker_id)
        if resp is not None:
            self.wire.parse_control(op, self._workers[worker_id], resp)

    async def _served_version(self, worker_id: str) -> str | None:
        resp = await self._send_control(GetVersion(), worker_id)
        return None if resp is None else self.wire.parse_version(self._workers[worker_id], resp)

    async def _fan(self, op: Command, workers: Sequence[str] | None) -> None:
        if self._closed:
            raise BackendClosed(f"{self.name}: {op.name} after aclose()")
        selected = self._select(workers)
        await fan_out(op.name, selected, lambda w: self._control(op, w))

    # -- data plane ---------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> Generation:
        """Generate; with ``RetryPolicy(generate_resends=N)`` (opt-in), resend up to N times, same
        request id, after an error that guarantees no engine started the request
        (``TransientError.nothing_generated``). Nothing else is ever resent: tokens are never
        counted twice."""
        # One coroutine for the whole call, resends included: a nested coroutine per call was
        # measurable at hundreds of calls in flight (client-overhead benchmark).
        if self._closed:
            raise BackendClosed(f"{self.name}: generate after aclose()")
        if not isinstance(request, GenerateRequest):
            raise InvalidRequest("request", f"must be a GenerateRequest, got {type(request).__name__}")
        caps = self.capabilities
        if caps.vocab_size is not None and max(request.input_ids) >= caps.vocab_size:  # one C-level pass
            for i, t in enumerate(request.input_ids):  # name the first offending token
                if t >= caps.vocab_size:
                    raise InvalidRequest(f"input_ids[{i}]", f"token id {t} >= vocab size {caps.vocab_size}")
        if caps.max_context is not None and len(request.input_ids) >= caps.max_context:
            raise InvalidRequest(
                "input_ids", f"prompt of {len(request.input_ids)} tokens does not fit the context ({caps.max_context})"
            )
        pinned = self.worker(request.worker) if request.worker is not None else None
        if pinned is not None and not caps.worker_pinning:
            raise Unsupported("worker_pinning")
        http = self.wire.generate(request, pinned)
        # The worker that served the call, when known without asking the engine.
        known = pinned.id if pinned is not None else self._sole_worker
        resends = self.client.retry.generate_resends
        attempt = 0
        while True:
            t0 = time.perf_counter()
            try:  # the send and the parse: either may raise a TransientError worth a resend
                if self._abort_by_id:  # the hot path: no extra task per request
                    resp = await self.client.send(http, worker=pinned.id if pinned else None)
                else:
                    resp_or_gen = await self._send_cancellable(request, http, pinned, t0)
                    if isinstance(resp_or_gen, Generation):
                        return resp_or_gen
                    resp = resp_or_gen
                gen = self.wire.parse_generation(request, resp, time.perf_counter() - t0, worker=known)
                break
            except TransientError as exc:
                if not exc.nothing_generated or attempt >= resends:
                    raise
                attempt += 1
                await asyncio.sleep(self.client.retry.delay(attempt))
        if gen.worker is None and known is not None:
            gen = attrs.evolve(gen, worker=known)
        if gen.logprobs is not None and len(gen.logprobs) != len(gen.output_ids):
            raise ContractViolation("logprobs and output ids differ in length", worker=gen.worker)
        if caps.version_source is VersionSource.STAMPED and gen.worker is not None:
            gen = attrs.evolve(gen, weight_version=self._versions.label(gen.worker))
        return gen

    async def _send_cancellable(
        self, request: GenerateRequest, http: HttpRequest, pinned: Worker | None, t0: float
    ) -> HttpResponse | Generation:
        """Send in a task of its own so ``abort(request_id)`` can cancel just this call (the server
        sees a disconnect). A call cancelled that way yields an ABORT generation with no tokens."""
        rid = request.request_id
        send = asyncio.ensure_future(self.client.send(http, worker=pinned.id if pinned else None))
        self._inflight[rid] = send
        try:
            return await send
        except asyncio.CancelledError:
            if rid in self._cancelled and send.cancelled() and not _cancelling():
                return await self._cancelled_generation(request, pinned, time.perf_counter() - t0)
            raise
        finally:
            if self._inflight.get(rid) is send:
                del self._inflight[rid]
                self._cancelled.discard(rid)

    async def abort(self, request_id: str) -> None:
        """Abort one request: by id on every worker where the wire can (the answer then carries
        the partial tokens); else cancel this client's in-flight HTTP call, which the server sees
        as a disconnect. A cancelled call returns ``FinishReason.ABORT`` with no tokens (what was
        generated is lost with the connection)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("request_id", f"must be a non-empty string, got {type(request_id).__name__}")
        if self._abort_by_id:
            # The router does not say which worker holds a request: ask every worker.
            await self._fan(AbortRequest(request_id), None)
            return
        task = self._inflight.get(request_id)
        if task is not None and not task.done():
            self._cancelled.add(request_id)
            task.cancel()

    @property
    def inflight(self) -> tuple[str, ...]:
        """Request ids whose ``generate`` call is in flight from this client and would be aborted by
        cancelling it. Empty where the engine aborts by id (no per-request bookkeeping there)."""
        return tuple(self._inflight)

    async def _cancelled_generation(
        self, request: GenerateRequest, pinned: Worker | None, latency_s: float
    ) -> Generation:
        worker = pinned.id if pinned is not None else self._sole_worker
        version = self._versions.label(worker)
        if version is None and self.capabilities.version_source is not VersionSource.NONE:
            # No answer came back to carry it: the version is what the fleet serves (if it agrees).
            try:
                version = await asyncio.shield(self.weight_version())
            except RolloutBackendError:
                version = None
        return Generation(
            request_id=request.request_id,
            output_ids=(),
            logprobs=() if request.return_logprobs and self.capabilities.logprobs else None,
            finish_reason=FinishReason.ABORT,
            weight_version=version,
            prompt_tokens=len(request.input_ids),
            worker=worker,
            latency_s=latency_s,
        )

    async def abort_all(self, *, workers: Sequence[str] | None = None) -> None:
        await self._fan(AbortAll(), workers)

    # -- pause --------------------------------------------------------------------------------

    async def pause(self, mode: PauseMode = PauseMode.RETRACT, *, workers: Sequence[str] | None = None) -> None:
        m = self._require_pause_mode(mode)
        selected = self._select(workers)
        self._paused.update(selected)
        await self._fan(Pause(m), selected)

    async def resume(self, *, workers: Sequence[str] | None = None) -> None:
        selected = self._select(workers)
        await self._fan(Resume(), selected)
        self._paused.difference_update(selected)

    # -- weights ------------------------------------------------------------------------------

    async def init_weight_group(self, group: WeightGroup, *, workers: Sequence[str] | None = None) -> None:
        self._require_transport(WeightTransport.DISTRIBUTED)
        if not isinstance(group, WeightGroup):
            raise InvalidRequest("group", f"must be a WeightGroup, got {type(group).__name__}")
        selected = self._select(workers)
        offsets: dict[str, int] = {}
        cursor = group.rank_offset
        for w in selected:
            offsets[w] = cursor
            cursor += self._workers[w].ranks
        if cursor > group.world_size:
            raise InvalidRequest(
                "group.world_size", f"{group.world_size} is too small for {cursor - group.rank_offset} engine ranks"
            )
        await fan_out(InitWeightGroup.name, selected, lambda w: self._control(InitWeightGroup(group, offsets[w]), w))

    async def update_weights_from_distributed(
        self,
        bucket: WeightBucket,
        *,
        group_name: str = "weight_update_group",
        version: str | None = None,
        flush_cache: bool = True,
        workers: Sequence[str] | None = None,
    ) -> None:
        self._require_transport(WeightTransport.DISTRIBUTED)
        if not isinstance(bucket, WeightBucket):
            raise InvalidRequest("bucket", f"must be a WeightBucket, got {type(bucket).__name__}")
        if not isinstance(group_name, str) or not group_name:
            raise InvalidRequest("group_name", "must be a non-empty string")
        _check_version(version)
        selected = self._select(workers)
        op = UpdateFromDistributed(bucket=bucket, group_name=group_name, version=version, flush_cache=flush_cache)
        await self._fan(op, selected)
        self._versions.relabelled(version, selected)

    async def destroy_weight_group(
        self, group_name: str = "weight_update_group", *, workers: Sequence[str] | None = None
    ) -> None:
        await self._fan(DestroyWeightGroup(group_name), workers)

    async def update_weights_from_tensors(
        self,
        named_tensors: Sequence[tuple[str, Any]],
        *,
        version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
        workers: Sequence[str] | None = None,
    ) -> None:
        self._require_transport(WeightTransport.TENSOR)
        _check_version(version)
        selected = self._select(workers)
        tensors = NamedTensors.of(named_tensors)
        tensors.payload()  # a bad pair is the caller's InvalidRequest, not a worker's failure
        op = UpdateFromTensors(tensors=tensors, version=version, flush_cache=flush_cache, load_format=load_format)
        await self._fan(op, selected)
        self._versions.relabelled(version, selected)

    async def update_weights_from_disk(
        self,
        path: str,
        *,
        version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        workers: Sequence[str] | None = None,
    ) -> None:
        self._require_transport(WeightTransport.DISK)
        if not isinstance(path, str) or not path:
            raise InvalidRequest("path", "must be a non-empty string")
        _check_version(version)
        if load_format is not None and not isinstance(load_format, str):
            raise InvalidRequest("load_format", "must be a string or None")
        selected = self._select(workers)
        op = UpdateFromDisk(path=path, version=version, load_format=load_format, flush_cache=flush_cache)
        await self._fan(op, selected)
        self._versions.relabelled(version, selected)

    async def begin_weight_update(self, selector: str = "all", *, workers: Sequence[str] | None = None) -> None:
        if not isinstance(selector, str) or not selector:
            raise InvalidRequest("selector", "must be a non-empty string")
        await self._fan(BeginWeightUpdate(selector), workers)

    async def end_weight_update(self, *, workers: Sequence[str] | None = None) -> None:
        await self._fan(EndWeightUpdate(), workers)

    async def set_weight_version(self, version: str, *, workers: Sequence[str] | None = None) -> None:
        if not isinstance(version, str) or not version:
            raise InvalidRequest("version", "must be a non-empty string")
        selected = self._select(workers)
        await self._fan(SetVersion(version), selected)
        self._versions.relabelled(version, selected)

    async def weight_versions(self) -> Mapping[str, str | None]:
        if self.capabilities.version_source is not VersionSource.RESPONSE:
            return self._versions.labels
        return await fan_out(GetVersion.name, self.workers, self._served_version)

    async def flush_cache(self, *, workers: Sequence[str] | None = None) -> None:
        await self._fan(FlushCache(), workers)

    # -- memory -------------------------------------------------------------------------------

    async def release_memory(
        self, tags: Sequence[MemoryTag | str] | None = None, *, workers: Sequence[str] | None = None
    ) -> None:
        if not self.capabilities.memory_release:
            raise Unsupported("memory_release")
        await self._fan(ReleaseMemory(ensure_tags(tags)), workers)

    async def resume_memory(
        self, tags: Sequence[MemoryTag | str] | None = None, *, workers: Sequence[str] | None = None
    ) -> None:
        if not self.capabilities.memory_release:
            raise Unsupported("memory_release")
        await self._fan(ResumeMemory(ensure_tags(tags)), workers)

    # -- health -------------------------------------------------------------------------------

    async def _probe(self, probe: Probe, worker_id: str) -> tuple[bool | None, str | None]:
        try:
            resp = await self._send_control(probe, worker_id)
            result = None if resp is None else self.wire.parse_probe(probe, self._workers[worker_id], resp)
        except RolloutBackendError as exc:
            return False, str(exc)
        return result, None

    async def _worker_health(self, worker_id: str, probe: bool, expected: str | None) -> WorkerHealth:
        live, err = await self._probe(Live(), worker_id)
        ready: bool | None = False
        progress: bool | None = None
        version: str | None = None
        if live:
            ready, err2 = await self._probe(Ready(), worker_id)
            err = err or err2
            # No readiness route (None) means ready when live; a worker we paused is never ready.
            ready = (ready is None or bool(ready)) and worker_id not in self._paused
            if probe:
                progress, err3 = await self._probe(Progress(), worker_id)
                err = err or err3
            if self.capabilities.version_source is VersionSource.RESPONSE:
                try:
                    version = await self._served_version(worker_id)
                except RolloutBackendError as exc:
                    err = err or str(exc)
            else:
                version = self._versions.label(worker_id)
        stale = VersionBook.is_stale(version, expected=expected, live=live is True)
        return WorkerHealth(
            worker=worker_id,
            live=bool(live),
            ready=bool(ready),
            making_progress=progress,
            weight_version=version,
            stale=stale,
            error=err,
        )

    async def health(self, *, probe: bool = False) -> HealthReport:
        expected = self._versions.expected
        results = await asyncio.gather(*(self._worker_health(w, probe, expected) for w in self.workers))
        router_live = await self._router_live()
        return HealthReport(workers=tuple(results), expected_version=expected, router_live=router_live)

    async def _router_live(self) -> bool | None:
        """Whether the entry point answers; adapters with a router override ``router_health``."""
        http = self.wire.router_health()
        if http is None:
            return None
        try:
            resp = await self.client.send(attrs.evolve(http, timeout=http.timeout or 5.0))
        except RolloutBackendError:
            return False
        return bool(resp.ok)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.client.aclose()
        finally:
            if self._on_close is not None:
                result = self._on_close()
                if asyncio.iscoroutine(result):
                    await result

    def require_live(self, report: HealthReport) -> None:
        if not report.any_ready:
            raise BackendUnavailable(f"{self.name}: no worker is ready ({', '.join(report.unhealthy_workers)})")
