"""``Fleet``: the ``RolloutBackend`` protocol, implemented once, over per-worker ``Driver``s.

Everything the protocol promises lives here, for every engine: input validation, capability
checks, worker selection, fan-out of control calls (every call runs to completion, failures named
per worker), installed / expected / stamped versions (through one ``VersionBook``), health
aggregation, and the weight-update transaction (``rollout_backends._transaction``). What differs
between engines is a ``Driver``: what one worker is told and how it answers. The drivers:

- HTTP: ``HttpFleetBackend`` (``rollout_backends._http_driver``), a wire format and a client;
- in process: the reference engines (``rollout_backends.adapters.reference``);
- in memory: ``rollout_backends.testing``, for unit tests of rollout code without servers.

Before this class the protocol was written by hand four times (the HTTP fleet, the reference
backend and two test fakes) and their rules drifted (issue 15; ``tests/test_versions.py``).

Generation without a pinned worker goes to the fleet's ``Entry``: a router (HTTP) or
``RoundRobin`` over the drivers (in process, in memory).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Protocol, TypeVar

import attrs

from rollout_backends._errors import (
    BackendClosed,
    BackendUnavailable,
    ConnectionFailed,
    ContractViolation,
    ControlFailed,
    InvalidRequest,
    NoCompatibleVersion,
    Overloaded,
    RolloutBackendError,
    Unsupported,
    WorkerFailure,
)
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
from rollout_backends._tensors import FLATTENED_BUCKET, FlatBucket
from rollout_backends._token_stream import TokenStream
from rollout_backends._transaction import WeightUpdateTransaction, wait_ready, weight_update
from rollout_backends._types import (
    Capabilities,
    FinishReason,
    GenerateRequest,
    Generation,
    HealthReport,
    MemoryTag,
    PauseMode,
    TokenChunk,
    VersionSource,
    WeightBucket,
    WeightGroup,
    WeightTransport,
    WorkerHealth,
    ensure_tags,
)
from rollout_backends._versions import VersionBook
from rollout_backends._worker_loss import DEFAULT_WORKER_LOSS, WorkerLossPolicy

__all__ = ["Driver", "Entry", "Fleet", "RoundRobin", "fan_out"]

_T = TypeVar("_T")
_F = TypeVar("_F", bound="Fleet")


class Driver(Protocol):
    """One worker, as a fleet reaches it: the part of the protocol that differs between engines.

    A driver does what it is told to its one worker and nothing else: the fleet has validated the
    input, checked the capabilities and picked the workers before it calls. Errors are the
    library's: ``ControlFailed`` naming this worker for a refused command, ``InvalidRequest``
    for input the engine refuses, ``TransientError`` / ``BackendUnavailable`` from ``generate``.
    """

    @property
    def id(self) -> str:
        """The worker id (unique in its fleet)."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What this worker's engine can do (a fleet takes its first driver's unless told)."""
        ...

    @property
    def aborts_by_id(self) -> bool:
        """Whether ``control(AbortRequest(id))`` aborts one request and its answer keeps the partial
        tokens; if not, the fleet cancels its own in-flight call for that request instead."""
        ...

    @property
    def ranks(self) -> int:
        """How many ranks this worker contributes to a weight-update group (its TP size)."""
        ...

    async def generate(self, request: GenerateRequest) -> Generation:
        """Generate on this worker (a pinned request, or one an ``Entry`` routed here)."""
        ...

    def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """Generate on this worker, chunk by chunk (``TokenChunk``: the new tokens, contiguous; the
        last one carries the ``Generation``). Closing the generator before its end (``aclose``)
        aborts the request on the engine before it returns. Only called where the fleet declares
        ``Capabilities.streaming``; a driver that cannot stream raises ``Unsupported("streaming")``."""
        ...

    async def control(self, op: Command) -> None:
        """Carry out one command (``rollout_backends.kit`` operation values, dispatched with ``match``)."""
        ...

    async def probe(self, op: Probe) -> bool | None:
        """Answer ``Live`` / ``Ready`` / ``Progress``; ``None``: no such probe (``Ready``: ready when
        live). Raising reports the worker failing the probe, with the error's text."""
        ...

    async def served_version(self) -> str | None:
        """The version the engine reports serving (asked only where ``VersionSource.RESPONSE``)."""
        ...

    async def aclose(self) -> None:
        """Release what the driver holds (the fleet calls it once, from ``Fleet.aclose``)."""
        ...


class Entry(Protocol):
    """Where generation goes when no worker is pinned: a router, or the fleet's own round robin."""

    async def generate(self, request: GenerateRequest) -> Generation: ...

    def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """``Driver.stream`` for an unpinned request, on the worker the entry picks."""
        ...

    async def live(self) -> bool | None:
        """Whether the entry answers (``HealthReport.router_live``); ``None``: there is no router."""
        ...

    async def aclose(self) -> None: ...


class RoundRobin:
    """An ``Entry`` that hands each unpinned request to the next driver in turn (no router)."""

    __slots__ = ("_next",)

    def __init__(self, drivers: Sequence[Driver]) -> None:
        self._next = itertools.cycle(tuple(drivers)).__next__

    async def generate(self, request: GenerateRequest) -> Generation:
        return await self._next().generate(request)

    def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        return self._next().stream(request)

    async def live(self) -> bool | None:
        return None

    async def aclose(self) -> None:
        return None


async def fan_out(
    operation: str,
    workers: Sequence[str],
    call: Callable[[str], Awaitable[_T]],
) -> dict[str, _T]:
    """Run ``call(worker)`` on every worker concurrently; ``ControlFailed`` names each that failed.

    Every call runs to completion even when some fail, so the error is complete and no worker is
    left half-way through a step because a sibling failed first. Where every failure is the
    caller's own bad input (``InvalidRequest``) or a feature the engines lack (``Unsupported``),
    that error is raised as it is: no worker is at fault.
    """
    if not workers:
        raise InvalidRequest("workers", f"{operation}: no workers selected")
    results = await asyncio.gather(*(call(w) for w in workers), return_exceptions=True)
    failures: list[WorkerFailure] = []
    refusals: list[InvalidRequest | Unsupported] = []
    out: dict[str, _T] = {}
    for worker, res in zip(workers, results, strict=False):
        if isinstance(res, BaseException):
            if isinstance(res, asyncio.CancelledError):
                raise res
            if isinstance(res, (InvalidRequest, Unsupported)):
                refusals.append(res)
            if isinstance(res, ControlFailed):
                failures.extend(res.failures)
            else:
                msg = str(res) if isinstance(res, RolloutBackendError) else f"{type(res).__name__}: {res}"
                failures.append(WorkerFailure(worker, operation, msg))
        else:
            out[worker] = res
    if refusals and len(refusals) == len(failures):
        raise refusals[0]
    if failures:
        raise ControlFailed(operation, failures)
    return out


def _cancelling() -> bool:
    """Whether the current task itself is being cancelled (3.11+; on 3.10 assume not)."""
    task = asyncio.current_task()
    counter = getattr(task, "cancelling", None)
    return bool(counter()) if counter is not None else False


def _check_version(version: object, field: str = "version") -> None:
    if version is not None and (not isinstance(version, str) or not version):
        raise InvalidRequest(field, f"must be a non-empty string or None, got {version!r}"[:200])


def _check_selector(selector: object) -> None:
    if not isinstance(selector, str) or not selector:
        raise InvalidRequest("selector", "must be a non-empty string")


def _tag_set(op: ReleaseMemory | ResumeMemory) -> frozenset[MemoryTag]:
    """The tags ``op`` names; none (``None`` or empty) means every tag, as SGLang reads it."""
    return frozenset(op.tags) if op.tags else frozenset(MemoryTag)


class Fleet:
    """The ``RolloutBackend`` protocol over a fleet of ``Driver``s behind one ``Entry``.

    ``capabilities`` defaults to the first driver's; ``entry`` to ``RoundRobin`` over the drivers.
    ``on_close`` runs once after the drivers are closed (a launcher stops its processes there).
    """

    def __init__(
        self,
        drivers: Sequence[Driver],
        *,
        entry: Entry | None = None,
        capabilities: Capabilities | None = None,
        name: str = "fleet",
        on_close: Callable[[], object] | None = None,
    ) -> None:
        if not drivers:
            raise InvalidRequest("workers", "a fleet needs at least one worker")
        ids = [d.id for d in drivers]
        if len(set(ids)) != len(ids):
            raise InvalidRequest("workers", f"duplicate worker ids: {ids}")
        self.name = name
        self._drivers: dict[str, Driver] = {d.id: d for d in drivers}
        self._ids = tuple(ids)
        #: The one worker of a single-worker fleet: it served every unpinned call.
        self._sole_worker: str | None = ids[0] if len(ids) == 1 else None
        self._entry: Entry = entry if entry is not None else RoundRobin(drivers)
        self.capabilities: Capabilities = capabilities if capabilities is not None else drivers[0].capabilities
        # Each worker's label (what it was last told to serve) and the expected version.
        self._versions = VersionBook(ids)
        # The workers this fleet paused (and how): never ready, and never asked to generate a probe.
        self._paused: dict[str, PauseMode] = {}
        # Per worker, the memory tags this fleet released and has not resumed; no entry: not known
        # (this fleet has not released, nor resumed all, there).
        self._released: dict[str, frozenset[MemoryTag]] = {}
        # Held by a load that pauses workers itself (_load_paused).
        self._load_lock = asyncio.Lock()
        # Whether every worker aborts one request by id; if not, abort() cancels our own call.
        self._abort_by_id = all(d.aborts_by_id for d in drivers)
        # generate() calls in flight by request id (only tracked where abort cancels them).
        self._inflight: dict[str, asyncio.Future[Generation]] = {}
        self._cancelled: set[str] = set()
        self._on_close = on_close
        self._closed = False
        # Per worker, a count that moves when a weight load or relabel of it starts and when it
        # ends (a new mapping each time: a snapshot never moves): a generation whose worker's count
        # did not move overlapped no update this fleet made there.
        self._epochs: Mapping[str, int] = dict.fromkeys(ids, 0)
        self._version_pick = itertools.count()
        #: What to do with a generation cut off by a lost worker (resend it whole, by default).
        self.worker_loss: WorkerLossPolicy = DEFAULT_WORKER_LOSS
        # Requests between a lost attempt and their resend, and those aborted meanwhile.
        self._resending: dict[str, int] = {}
        self._abort_asked: set[str] = set()
        self._resends_done = 0
        # Request ids whose generate() or stream() is running in this fleet. An engine refuses a duplicate only
        # among its own requests (SGLang: "Duplicate request ID detected"); behind an entry that
        # spreads requests two calls with one id land on different workers, and abort(id) then
        # ends both (seen through Dynamo 1.4.2 on CPU, 2026-12-02). Refused here, before anything
        # is sent; a resend after a lost worker keeps its claim.
        self._claimed: set[str] = set()

    # -- bookkeeping --------------------------------------------------------------------------

    @property
    def workers(self) -> tuple[str, ...]:
        return self._ids

    @property
    def closed(self) -> bool:
        """Whether ``aclose`` ran."""
        return self._closed

    def driver(self, worker_id: str) -> Driver:
        """The driver of one worker (``InvalidRequest`` for an unknown id)."""
        try:
            return self._drivers[worker_id]
        except KeyError:
            raise InvalidRequest("worker", f"unknown worker {worker_id!r} (known: {sorted(self._drivers)})") from None

    @property
    def drivers(self) -> tuple[Driver, ...]:
        return tuple(self._drivers[w] for w in self._ids)

    def set_installed_version(self, version: str | None, workers: Sequence[str] | None = None) -> None:
        """Record the version workers serve (a launcher knows the start-up version); declares nothing."""
        self._versions.record(version, workers)

    @property
    def resends_after_worker_loss(self) -> int:
        """How many times this fleet resent a generation cut off by a lost worker (``worker_loss``)."""
        return self._resends_done

    @property
    def inflight(self) -> tuple[str, ...]:
        """Request ids whose ``generate`` call is in flight from this client and would be aborted by
        cancelling it. Empty where the engines abort by id (no per-request bookkeeping there)."""
        return tuple(self._inflight)

    def _select(self, workers: Sequence[str] | None) -> tuple[str, ...]:
        """Validate a worker selection; ``None`` = all."""
        if workers is None:
            return self._ids
        if isinstance(workers, (str, bytes)) or not isinstance(workers, (list, tuple)):
            raise InvalidRequest("workers", f"must be a list of worker ids or None, got {type(workers).__name__}")
        for i, w in enumerate(workers):
            if not isinstance(w, str) or w not in self._drivers:
                raise InvalidRequest(f"workers[{i}]", f"unknown worker {w!r} (known: {sorted(self._drivers)})")
        return tuple(workers)

    def _require_pause_mode(self, mode: PauseMode | str) -> PauseMode:
        try:
            m = PauseMode(mode)
        except (ValueError, TypeError):
            raise InvalidRequest("mode", f"unknown pause mode {mode!r}") from None
        if m not in self.capabilities.pause_modes:
            raise Unsupported(f"pause_mode.{m.value}")
        return m

    def _require_transport(self, transport: WeightTransport) -> None:
        if transport not in self.capabilities.weight_transports:
            raise Unsupported(f"weight_transport.{transport.value}")

    def _require_open(self, operation: str) -> None:
        if self._closed:
            raise BackendClosed(f"{self.name}: {operation} after aclose()")

    async def _control(self, op: Command, worker_id: str) -> None:
        """One command on one worker (the seam fault injection shadows: ``gpu_tier``)."""
        await self._drivers[worker_id].control(op)

    async def _fan(self, op: Command, workers: Sequence[str] | None) -> None:
        self._require_open(op.name)
        await self._fan_each(op.name, dict.fromkeys(self._select(workers), op))

    async def _fan_each(self, operation: str, ops: Mapping[str, Command]) -> None:
        """Every command a fleet sends goes out here: ``ops[w]`` to each worker ``w``, at once."""
        await fan_out(operation, tuple(ops), lambda w: self._control(ops[w], w))

    async def _load(self, op: Command, selected: Sequence[str], version: str | None) -> None:
        """A weight load or relabel on ``selected``, then the labels; the epoch moves before and
        after, so a generation in flight meanwhile knows an update overlapped it."""
        self._bump(selected)
        try:
            if isinstance(op, SetVersion) or not self.capabilities.load_needs_pause:
                await self._fan(op, selected)
            else:
                await self._load_paused(op, selected)
            self._versions.relabelled(version, selected)
        finally:
            self._bump(selected)

    async def _load_paused(self, op: Command, selected: Sequence[str]) -> None:
        """A load on engines that take one only while paused (``Capabilities.load_needs_pause``):
        the workers not paused by this fleet (a transaction's are) are paused for it and resumed
        after it, also when it fails: no engine is left paused by a load. One such load at a time,
        so that one load's resume cannot unpause the workers another is loading."""
        async with self._load_lock:
            own = [w for w in selected if w not in self._paused]
            if not own:
                await self._fan(op, selected)
                return
            modes = self.capabilities.pause_modes
            mode = next((m for m in (PauseMode.RETRACT, PauseMode.IN_PLACE) if m in modes), None)
            if mode is None:
                why = "the engine loads weights only while paused (load_needs_pause), and neither RETRACT nor IN_PLACE"
                raise Unsupported("pause_mode.retract", why + " is declared")
            try:
                await self.pause(mode, workers=own)
                await self._fan(op, selected)
            finally:
                await self.resume(workers=own)

    def _bump(self, selected: Sequence[str]) -> None:
        epochs = dict(self._epochs)
        for w in selected:
            epochs[w] += 1
        self._epochs = epochs

    # -- data plane ---------------------------------------------------------------------------

    def _check_request(self, request: GenerateRequest) -> None:
        """What the fleet refuses before any engine sees it (the declared vocabulary and context)."""
        if not isinstance(request, GenerateRequest):
            raise InvalidRequest("request", f"must be a GenerateRequest, got {type(request).__name__}")
        caps = self.capabilities
        if caps.vocab_size is not None and max(request.input_ids) >= caps.vocab_size:  # one C-level pass
            for i, t in enumerate(request.input_ids):  # name the first offending token
                if t >= caps.vocab_size:
                    raise InvalidRequest(f"input_ids[{i}]", f"token id {t} >= vocab size {caps.vocab_size}")
        stops = request.sampling.stop_token_ids
        if caps.vocab_size is not None and stops and max(stops) >= caps.vocab_size:
            # Refused here, under its own name: engines name it input_ids (SGLang) or fail (Dynamo).
            i = next(i for i, t in enumerate(stops) if t >= caps.vocab_size)
            why = f"token id {stops[i]} >= vocab size {caps.vocab_size}"
            raise InvalidRequest(f"sampling.stop_token_ids[{i}]", why)
        if request.sampling.top_logprobs > caps.top_logprobs:
            raise InvalidRequest(
                "sampling.top_logprobs",
                f"{request.sampling.top_logprobs} asked; this backend returns at most {caps.top_logprobs}",
            )
        if caps.max_context is not None and len(request.input_ids) >= caps.max_context:
            raise InvalidRequest(
                "input_ids", f"prompt of {len(request.input_ids)} tokens does not fit the context ({caps.max_context})"
            )

    def _route_by_version(self, request: GenerateRequest) -> GenerateRequest:
        """Keep a version-constrained request to the workers whose installed label satisfies it:
        pinned where it is, to one of them when not every worker does (``NoCompatibleVersion``
        where none does, or where the fleet cannot pin and not every worker does)."""
        if not self.capabilities.version_constraints:
            raise Unsupported("version_constraints")
        book, least, exact = self._versions, request.min_version, request.exact_version
        if least is not None and exact is not None:
            at, floor = book.rank(exact), book.rank(least)
            if at is not None and floor is not None and at < floor:
                raise InvalidRequest(
                    "exact_version", f"{exact!r} was installed before min_version {least!r}: no version is both"
                )
        labels = book.view
        ok = [w for w in self._ids if book.satisfies(labels[w], min_version=least, exact_version=exact)]

        def refuse(reason: str) -> NoCompatibleVersion:
            return NoCompatibleVersion(
                min_version=least, exact_version=exact, served=labels, history=book.history, reason=reason
            )

        if request.worker is not None:
            self.driver(request.worker)  # an unknown id is the caller's InvalidRequest
            if request.worker not in ok:
                raise refuse(f"the pinned worker {request.worker!r} serves no accepted version")
            return request
        if not ok:
            raise refuse("no worker serves an accepted version")
        if len(ok) == len(self._ids):
            return request  # any worker will do: the entry chooses
        if not self.capabilities.worker_pinning:
            raise refuse("not every worker serves an accepted version, and this fleet cannot pin a request")
        return attrs.evolve(request, worker=ok[next(self._version_pick) % len(ok)])

    async def _learn_labels(self) -> None:
        """Record the version each unlabelled worker reports (a fleet connected to servers it did not
        start knows no labels until it sets one): asked once per worker, until it answers."""
        unknown = [w for w, v in self._versions.view.items() if v is None]
        if not unknown:
            return
        served = await asyncio.gather(*(self._drivers[w].served_version() for w in unknown), return_exceptions=True)
        for w, v in zip(unknown, served, strict=True):
            if isinstance(v, str) and v and self._versions.label(w) is None:
                self._versions.record(v, [w])
            elif isinstance(v, BaseException) and not isinstance(v, RolloutBackendError):
                raise v

    async def generate(self, request: GenerateRequest) -> Generation:
        """Generate on the pinned worker, else through the entry. Drivers may resend where nothing
        can have been generated (HTTP: ``RetryPolicy.generate_resends``); a generation cut off by
        a lost worker is resent whole per ``worker_loss`` (``rollout_backends._worker_loss``);
        tokens are never counted twice. A request with ``min_version`` / ``exact_version`` goes
        only to a worker whose label satisfies it (``_route_by_version``, again for each resend)."""
        self._require_open("generate")
        self._check_request(request)
        rid = self._claim(request)
        try:
            return await self._generate_claimed(request)
        finally:
            self._claimed.discard(rid)

    def _claim(self, request: GenerateRequest) -> str:
        """Claim a request id for a ``generate`` or ``stream`` in flight (``_claimed``); the caller
        discards it when the call ends."""
        rid = request.request_id
        if rid in self._claimed:
            raise InvalidRequest(
                "request_id", f"Duplicate request ID detected: {rid!r} is already in flight in this fleet"
            )
        self._claimed.add(rid)
        return rid

    async def _prepare_constraints(self, request: GenerateRequest) -> bool:
        """Whether the request names versions (``min_version`` / ``exact_version``); if so, the labels
        of workers not yet known are asked first where engines report them (``_route_by_version``
        then picks among them)."""
        constrained = request.min_version is not None or request.exact_version is not None
        if constrained and self.capabilities.version_source is VersionSource.RESPONSE:
            await self._learn_labels()
        return constrained

    async def _generate_claimed(self, request: GenerateRequest) -> Generation:
        constrained = await self._prepare_constraints(request)
        policy = self.worker_loss
        if request.worker is not None or not policy.resends_lost:
            return await self._generate_once(self._route_by_version(request) if constrained else request)
        attempt = 0
        t0 = time.perf_counter()
        rid = request.request_id
        try:
            while True:
                try:
                    return await self._generate_once(self._route_by_version(request) if constrained else request)
                except (ConnectionFailed, Overloaded, BackendUnavailable) as exc:
                    if isinstance(exc, BackendClosed) or self._closed or attempt >= policy.resends:
                        raise
                attempt += 1
                self._resending[rid] = self._resending.get(rid, 0) + 1
                await asyncio.sleep(policy.delay(attempt))
                if rid in self._abort_asked:  # aborted between attempts: nothing runs anywhere
                    return await self._cancelled_generation(request, self._sole_worker, time.perf_counter() - t0)
                self._require_open("generate")
        finally:
            if attempt:
                self._resends_done += attempt
                self._resending.pop(rid, None)
                self._abort_asked.discard(rid)

    def stream(self, request: GenerateRequest) -> TokenStream:
        """``generate``, its tokens delivered as they come (``RolloutBackend.stream``).

        Refused as ``generate`` refuses (here: ``InvalidRequest``, ``Unsupported``; on entering the
        block: a request id in flight in this fleet, a version no worker satisfies). A stream is not
        resent after a lost worker (its tokens are delivered already): the error ends it. The
        fleet checks what the driver streams (contiguous chunks that add up to the final
        ``Generation``: ``ContractViolation`` otherwise) and stamps the final ``Generation`` with
        the versions exactly as ``generate`` does (``_stamped``)."""
        self._require_open("stream")
        if not self.capabilities.streaming:
            raise Unsupported("streaming")
        self._check_request(request)
        return TokenStream(request.request_id, self._relay(request))

    async def _relay(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk | None, None]:
        """``stream``'s source: open (claim, route; then ``None``), then relay and check the chunks.
        Closed early, it closes the driver's generator, which aborts the request on the engine."""
        rid = self._claim(request)
        try:
            self._require_open("stream")
            constrained = await self._prepare_constraints(request)
            routed = self._route_by_version(request) if constrained else request
            target, known = self._target(routed)
            labels, epochs = self._versions.view, self._epochs  # what was installed when it started
            yield None  # open: what could be refused before any token was
            chunks = target.stream(routed)
            try:
                ids: list[int] = []
                lps: list[float] | None = [] if request.return_logprobs else None
                # (first index, version) runs of the chunks' reported versions; None once a chunk
                # with tokens reports none.
                runs: list[tuple[int, str]] | None = [] if self.capabilities.stream_version_spans else None
                async for chunk in chunks:
                    self._check_chunk(chunk, rid, len(ids), known)
                    if runs is not None and chunk.output_ids:
                        v = chunk.weight_version
                        if v is None:
                            runs = None
                        elif not runs or runs[-1][1] != v:
                            runs.append((chunk.index, v))
                    ids.extend(chunk.output_ids)
                    if lps is not None and chunk.logprobs is not None:
                        lps.extend(chunk.logprobs)
                    if chunk.final is None:
                        yield chunk
                        continue
                    final = chunk.final
                    if (lps is not None and final.logprobs is not None and tuple(lps) != final.logprobs) or tuple(
                        ids
                    ) != final.output_ids:
                        raise ContractViolation(
                            f"the chunks of {rid!r} do not add up to its final Generation", worker=final.worker or known
                        )
                    if runs and final.version_spans is None and runs[-1][1] == final.weight_version:
                        # The engine's own per-event versions: where the tokens changed version.
                        final = attrs.evolve(final, version_spans=tuple(runs), version_at_start=runs[0][1])
                    yield attrs.evolve(chunk, final=self._stamped(final, known, labels, epochs))
                    return
                raise ContractViolation(f"the stream of {rid!r} ended without its final chunk", worker=known)
            finally:
                await chunks.aclose()
        finally:
            self._claimed.discard(rid)

    @staticmethod
    def _check_chunk(chunk: object, rid: str, sent: int, known: str | None) -> None:
        if not isinstance(chunk, TokenChunk):
            raise ContractViolation(
                f"the stream of {rid!r} yielded {type(chunk).__name__}, not a TokenChunk", worker=known
            )
        if chunk.request_id != rid:
            raise ContractViolation(f"the stream of {rid!r} yielded a chunk of {chunk.request_id!r}", worker=known)
        if chunk.index != sent:
            what = "repeats" if chunk.index < sent else "skips"
            raise ContractViolation(
                f"the stream of {rid!r} {what} tokens: a chunk at index {chunk.index} after {sent} tokens", worker=known
            )

    async def _generate_once(self, request: GenerateRequest) -> Generation:
        target, known = self._target(request)
        labels, epochs = self._versions.view, self._epochs  # what was installed when it started
        if self._abort_by_id:  # the hot path: no extra task per request
            gen = await target.generate(request)
        else:
            gen = await self._generate_cancellable(target, request, known)
        return self._stamped(gen, known, labels, epochs)

    def _target(self, request: GenerateRequest) -> tuple[Driver | Entry, str | None]:
        """Where a request goes (its pinned worker, else the entry) and the worker known to serve it."""
        if request.worker is not None:
            target = self.driver(request.worker)
            if not self.capabilities.worker_pinning:
                raise Unsupported("worker_pinning")
            return target, request.worker
        return self._entry, self._sole_worker

    def _stamped(
        self, gen: Generation, known: str | None, labels: Mapping[str, str | None], epochs: Mapping[str, int]
    ) -> Generation:
        """A driver's answer with the fleet's view filled in: the worker, the version at the end (the
        label where versions are STAMPED), the version at the start and the spans, given the labels
        and epochs snapshot when the call started (``generate`` and ``stream`` alike)."""
        worker = gen.worker if gen.worker is not None else known
        if gen.logprobs is not None and len(gen.logprobs) != len(gen.output_ids):
            raise ContractViolation("logprobs and output ids differ in length", worker=worker)
        end = gen.weight_version
        if self.capabilities.version_source is VersionSource.STAMPED and worker is not None:
            end = self._versions.label(worker)
        start, spans = gen.version_at_start, gen.version_spans
        # Nothing this fleet loaded or relabelled on the worker (or anywhere, where the worker is not
        # known) overlapped the call: the version at the end served all of it. Otherwise the start
        # is the label the worker had when the call started, and where the tokens changed version
        # is not known here: no spans (never guessed).
        now = self._epochs
        quiet = end is not None and (now is epochs or (worker is not None and epochs.get(worker) == now.get(worker)))
        if start is None:
            start = end if quiet else labels.get(worker) if worker is not None else None
        if spans is None and quiet and end is not None and self.capabilities.version_spans is VersionSource.STAMPED:
            spans = ((0, end),) if gen.output_ids else ()
        if (
            worker is not gen.worker
            or end is not gen.weight_version
            or start is not gen.version_at_start
            or spans is not gen.version_spans
        ):
            gen = attrs.evolve(gen, worker=worker, weight_version=end, version_at_start=start, version_spans=spans)
        return gen

    async def _generate_cancellable(
        self, target: Driver | Entry, request: GenerateRequest, known: str | None
    ) -> Generation:
        """Generate in a task of its own so ``abort(request_id)`` can cancel just this call (an HTTP
        server sees a disconnect). A call cancelled that way yields an ABORT generation, no tokens."""
        rid = request.request_id
        t0 = time.perf_counter()
        task = asyncio.ensure_future(target.generate(request))
        self._inflight[rid] = task
        try:
            return await task
        except asyncio.CancelledError:
            if rid in self._cancelled and task.cancelled() and not _cancelling():
                return await self._cancelled_generation(request, known, time.perf_counter() - t0)
            raise
        finally:
            if self._inflight.get(rid) is task:
                del self._inflight[rid]
                self._cancelled.discard(rid)

    async def _cancelled_generation(self, request: GenerateRequest, worker: str | None, latency_s: float) -> Generation:
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
            version_at_start=self._versions.label(worker),
        )

    async def abort(self, request_id: str) -> None:
        """Abort one request: by id on every worker where the drivers can (the answer then carries
        the partial tokens); else cancel this client's in-flight call, which an HTTP server sees as
        a disconnect. A cancelled call returns ``FinishReason.ABORT`` with no tokens."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("request_id", f"must be a non-empty string, got {type(request_id).__name__}")
        if request_id in self._resending:
            self._abort_asked.add(request_id)  # not resent again; a resend already out is aborted below
        if self._abort_by_id:
            # The entry does not say which worker holds a request: ask every worker.
            await self._fan(AbortRequest(request_id), None)
            return
        task = self._inflight.get(request_id)
        if task is not None and not task.done():
            self._cancelled.add(request_id)
            task.cancel()

    async def abort_all(self, *, workers: Sequence[str] | None = None) -> None:
        await self._fan(AbortAll(), workers)

    # -- pause --------------------------------------------------------------------------------

    async def pause(self, mode: PauseMode = PauseMode.RETRACT, *, workers: Sequence[str] | None = None) -> None:
        m = self._require_pause_mode(mode)
        selected = self._select(workers)
        self._require_open(Pause.name)
        # Marked before the call: a worker whose pause failed half-way is not trusted as ready.
        self._paused.update(dict.fromkeys(selected, m))
        await self._fan(Pause(m), selected)

    async def resume(self, *, workers: Sequence[str] | None = None) -> None:
        selected = self._select(workers)
        try:
            await self._fan(Resume(), selected)
        except ControlFailed as exc:
            failed = {f.worker for f in exc.failures}
            for w in selected:
                if w not in failed:
                    self._paused.pop(w, None)
            raise
        for w in selected:
            self._paused.pop(w, None)

    # -- weights ------------------------------------------------------------------------------

    async def init_weight_group(self, group: WeightGroup, *, workers: Sequence[str] | None = None) -> None:
        self._require_transport(WeightTransport.DISTRIBUTED)
        if not isinstance(group, WeightGroup):
            raise InvalidRequest("group", f"must be a WeightGroup, got {type(group).__name__}")
        selected = self._select(workers)
        self._require_open(InitWeightGroup.name)
        offsets: dict[str, int] = {}
        cursor = group.rank_offset
        for w in selected:
            offsets[w] = cursor
            cursor += self._drivers[w].ranks
        if cursor > group.world_size:
            raise InvalidRequest(
                "group.world_size", f"{group.world_size} is too small for {cursor - group.rank_offset} engine ranks"
            )
        await self._fan_each(InitWeightGroup.name, {w: InitWeightGroup(group, offsets[w]) for w in selected})

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
        await self._load(op, selected, version)

    async def destroy_weight_group(
        self, group_name: str = "weight_update_group", *, workers: Sequence[str] | None = None
    ) -> None:
        if not isinstance(group_name, str) or not group_name:
            raise InvalidRequest("group_name", "must be a non-empty string")
        await self._fan(DestroyWeightGroup(group_name), workers)

    async def update_weights_from_tensors(
        self,
        named_tensors: Sequence[tuple[str, Any]] | FlatBucket,
        *,
        version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
        workers: Sequence[str] | None = None,
    ) -> None:
        self._require_transport(WeightTransport.TENSOR)
        _check_version(version)
        if load_format is not None and not isinstance(load_format, str):
            raise InvalidRequest("load_format", "must be a string or None")
        selected = self._select(workers)
        # A bad pair is the caller's InvalidRequest (raised here, or by every driver: fan_out).
        tensors = NamedTensors.of(named_tensors)
        if tensors.flat is not None:
            if load_format not in (None, FLATTENED_BUCKET):
                msg = f"a FlatBucket is sent as {FLATTENED_BUCKET!r}, got {load_format!r}"
                raise InvalidRequest("load_format", msg)
            if not self.capabilities.flattened_buckets:
                raise Unsupported("flattened_buckets", "send its views: update_weights_from_tensors(bucket.views())")
            load_format = FLATTENED_BUCKET
        elif load_format == FLATTENED_BUCKET:
            raise InvalidRequest("load_format", f"{FLATTENED_BUCKET!r} takes a FlatBucket (TensorBuckets.pack)")
        op = UpdateFromTensors(tensors=tensors, version=version, flush_cache=flush_cache, load_format=load_format)
        await self._load(op, selected, version)

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
        await self._load(op, selected, version)

    async def begin_weight_update(self, selector: str = "all", *, workers: Sequence[str] | None = None) -> None:
        _check_selector(selector)
        await self._fan(BeginWeightUpdate(selector), workers)

    async def end_weight_update(self, *, workers: Sequence[str] | None = None) -> None:
        await self._fan(EndWeightUpdate(), workers)

    async def set_weight_version(self, version: str, *, workers: Sequence[str] | None = None) -> None:
        if not isinstance(version, str) or not version:
            raise InvalidRequest("version", "must be a non-empty string")
        selected = self._select(workers)
        await self._load(SetVersion(version), selected, version)

    async def weight_versions(self) -> Mapping[str, str | None]:
        if self.capabilities.version_source is not VersionSource.RESPONSE:
            return self._versions.labels
        return await fan_out(GetVersion.name, self._ids, lambda w: self._drivers[w].served_version())

    async def weight_version(self) -> str | None:
        return self._versions.fleet_version(await self.weight_versions())

    def expect_version(self, version: str | None) -> None:
        """Declare the version every worker should serve (see ``RolloutBackend.expect_version``)."""
        self._versions.declare(version)

    async def flush_cache(self, *, workers: Sequence[str] | None = None) -> None:
        await self._fan(FlushCache(), workers)

    def weight_update(
        self, version: str, *, mode: PauseMode = PauseMode.RETRACT, selector: str = "all"
    ) -> AbstractAsyncContextManager[WeightUpdateTransaction]:
        """A weight-update transaction; see :func:`rollout_backends.weight_update`."""
        self._require_pause_mode(mode)
        return weight_update(self, version, mode=mode, selector=selector)

    # -- memory -------------------------------------------------------------------------------

    async def release_memory(
        self, tags: Sequence[MemoryTag | str] | None = None, *, workers: Sequence[str] | None = None
    ) -> None:
        if not self.capabilities.memory_release:
            raise Unsupported("memory_release")
        await self._memory(ReleaseMemory(ensure_tags(tags)), workers)

    async def resume_memory(
        self, tags: Sequence[MemoryTag | str] | None = None, *, workers: Sequence[str] | None = None
    ) -> None:
        if not self.capabilities.memory_release:
            raise Unsupported("memory_release")
        await self._memory(ResumeMemory(ensure_tags(tags)), workers)

    async def _memory(self, op: ReleaseMemory | ResumeMemory, workers: Sequence[str] | None) -> None:
        """Send each worker only the tags that change its state, as far as this fleet knows it.

        Engines do not all make a repeated release or a resume of what is awake a no-op: SGLang
        0.5.16 removes every resumed tag from a set (``offload_tags.remove``, ``None`` = every tag;
        sglang/srt/managers/scheduler_components/weight_updater.py), so ``resume_memory()`` after
        ``resume_memory([WEIGHTS])`` raises KeyError in its scheduler. A worker this fleet has not
        released or resumed everything on is sent the call as asked (its state is not known here),
        and so is one whose last call failed.
        """
        self._require_open(op.name)
        sends = {w: send for w in self._select(workers) if (send := self._memory_op(op, w)) is not None}
        if not sends:
            return
        failed: set[str] = set(sends)
        try:
            await self._fan_each(op.name, sends)
            failed = set()
        except ControlFailed as exc:
            failed = {f.worker for f in exc.failures}
            raise
        finally:
            for w, send in sends.items():
                if w in failed:
                    self._released.pop(w, None)  # it may have done part of it
                else:
                    self._memory_done(send, w)

    def _memory_op(self, op: ReleaseMemory | ResumeMemory, worker: str) -> ReleaseMemory | ResumeMemory | None:
        """``op`` for ``worker`` trimmed to the tags that change its state; ``None``: nothing would."""
        asked = _tag_set(op)
        known = self._released.get(worker)
        if known is None:
            return op
        todo = asked - known if isinstance(op, ReleaseMemory) else asked & known
        if not todo:
            return None
        # The tags in MemoryTag's order (weights first); as asked when nothing is trimmed.
        return op if todo == asked else attrs.evolve(op, tags=tuple(t for t in MemoryTag if t in todo))

    def _memory_done(self, sent: ReleaseMemory | ResumeMemory, worker: str) -> None:
        tags = _tag_set(sent)
        known = self._released.get(worker)
        if isinstance(sent, ReleaseMemory):
            self._released[worker] = (known or frozenset()) | tags
        elif known is not None or tags == frozenset(MemoryTag):
            self._released[worker] = (known or frozenset()) - tags

    # -- health -------------------------------------------------------------------------------

    async def _probe(self, op: Probe, worker_id: str) -> tuple[bool | None, str | None]:
        try:
            return await self._drivers[worker_id].probe(op), None
        except RolloutBackendError as exc:
            return False, str(exc)

    async def _worker_health(self, worker_id: str, probe: bool, expected: str | None) -> WorkerHealth:
        live, err = await self._probe(Live(), worker_id)
        ready: bool | None = False
        progress: bool | None = None
        version: str | None = None
        if live:
            ready, err2 = await self._probe(Ready(), worker_id)
            err = err or err2
            paused = self._paused.get(worker_id)
            # No readiness probe (None) means ready when live; a worker we paused is never ready.
            ready = (ready is None or bool(ready)) and paused is None
            if probe and paused is not None:
                # It cannot make progress, and asking costs: stock SGLang's generating health route
                # waits ~20 s on a paused server before it answers 503 (3cdbb61).
                progress = False
                err = err or f"paused ({paused.value}) by this fleet"
            elif probe:
                progress, err3 = await self._probe(Progress(), worker_id)
                err = err or err3
            if self.capabilities.version_source is VersionSource.RESPONSE:
                try:
                    version = await self._drivers[worker_id].served_version()
                except RolloutBackendError as exc:
                    err = err or str(exc)
            else:
                version = self._versions.label(worker_id)
        return WorkerHealth(
            worker=worker_id,
            live=bool(live),
            ready=bool(ready),
            making_progress=progress,
            weight_version=version,
            stale=VersionBook.is_stale(version, expected=expected, live=live is True),
            error=err,
        )

    async def health(self, *, probe: bool = False) -> HealthReport:
        expected = self._versions.expected
        results = await asyncio.gather(*(self._worker_health(w, probe, expected) for w in self._ids))
        try:
            router_live = await self._entry.live()
        except RolloutBackendError:
            router_live = False
        return HealthReport(workers=tuple(results), expected_version=expected, router_live=router_live)

    async def wait_ready(self, timeout: float = 60.0) -> HealthReport:
        return await wait_ready(self, timeout)

    def require_live(self, report: HealthReport) -> None:
        if not report.any_ready:
            raise BackendUnavailable(f"{self.name}: no worker is ready ({', '.join(report.unhealthy_workers)})")

    # -- lifecycle ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the entry and every driver (each even if another fails), then run ``on_close``."""
        if self._closed:
            return
        self._closed = True
        try:
            closing = [self._entry.aclose(), *(d.aclose() for d in self.drivers)]
            errors = [r for r in await asyncio.gather(*closing, return_exceptions=True) if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        finally:
            if self._on_close is not None:
                result = self._on_close()
                if inspect.isawaitable(result):
                    await result

    async def __aenter__(self: _F) -> _F:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} workers={list(self._ids)}>"
