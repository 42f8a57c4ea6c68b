"""The HTTP driver: a ``Fleet`` of engines reached over HTTP, for any adapter's wire format.

An adapter supplies a ``Wire``: pure functions from operations to ``HttpRequest`` values and from
``HttpResponse`` values to results. ``HttpDriver`` sends one worker's calls through the fleet's
``HttpClient`` (timeouts, retries, auth); ``HttpEntry`` sends unpinned generation to the entry
point (a router, or the one server). Everything else (validation, fan-out, versions, health, the
transaction) is the ``Fleet``'s, once for every engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Protocol, TypeAlias

import attrs

from rollout_backends._errors import (
    ContractViolation,
    ControlFailed,
    Overloaded,
    RolloutBackendError,
    TransientError,
    WorkerFailure,
)
from rollout_backends._fleet import Fleet
from rollout_backends._http import HttpClient, HttpRequest, HttpResponse
from rollout_backends._ops import AbortRequest, Command, GetVersion, Operation, Probe, busy_wait_s
from rollout_backends._types import Capabilities, GenerateRequest, Generation, TokenChunk

__all__ = ["ControlCalls", "HttpDriver", "HttpEntry", "HttpFleetBackend", "HttpLink", "StreamParser", "Wire", "Worker"]

#: What ``Wire.control`` builds for one operation on one worker: one call; for a command the engine
#: takes in several calls, their tuple, sent in order, each answer checked by ``parse_control``
#: before the next is sent (the first refusal ends the command: vLLM 0.26's weight transfer is
#: ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``); or ``None``: nothing
#: to send. Probes and ``GetVersion`` are one call.
ControlCalls: TypeAlias = HttpRequest | tuple[HttpRequest, ...] | None


def _calls(built: ControlCalls) -> tuple[HttpRequest, ...]:
    if built is None:
        return ()
    return built if isinstance(built, tuple) else (built,)


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


class StreamParser(Protocol):
    """The events of one streamed answer -> its chunks. Pure (no I/O) but stateful: it knows what
    it delivered so far (an engine may send each event cumulative or as a delta)."""

    #: The worker serving the stream (from the fleet or the answer's head), where known.
    worker: str | None

    def event(self, data: bytes, latency_s: float) -> TokenChunk | None:
        """One event's data -> the chunk of tokens it adds (contiguous with those before), the
        last one carrying the ``Generation`` (the same as ``parse_generation`` gives for the
        answer); ``None`` for an end-of-stream marker. An error event raises as
        ``parse_generation`` does for a refused or failed call."""
        ...


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

    def stream(self, request: GenerateRequest, worker: Worker | None) -> HttpRequest:
        """Build a streamed generation call (an answer of server-sent events), as ``generate``.
        Only called where ``capabilities().streaming``; else raise ``Unsupported("streaming")``."""
        ...

    def stream_parser(self, request: GenerateRequest, head: HttpResponse, *, worker: str | None) -> StreamParser:
        """Check a streamed call's head (status and headers; the body where it is not 2xx): raise
        as ``parse_generation`` does for a refused call; else the parser of this answer's events
        (``worker``: the worker the fleet sent it to, where it knows)."""
        ...

    def control(self, op: Operation, worker: Worker) -> ControlCalls:
        """Build a control call (several, in order, for a command the engine takes in steps:
        ``ControlCalls``); ``None`` = nothing to send on this engine (a no-op step; for ``Ready``:
        ready when live; for ``GetVersion``: the engine does not report it)."""
        ...

    def parse_control(self, op: Command, worker: Worker, response: HttpResponse) -> None:
        """Check a command's answer: return, or raise ``ControlFailed``/``ContractViolation``; or
        ``Overloaded`` where the engine refused it only because it is busy and did nothing (the
        driver sends it again while the command may wait: ``busy_wait_s``)."""
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


@attrs.define(slots=True, eq=False)
class HttpLink:
    """The wire and the client a fleet's HTTP drivers and entry share (replacing either on the
    fleet, as fault-injection tests do, reaches every worker at once)."""

    wire: Wire
    client: HttpClient


async def _generate(link: HttpLink, request: GenerateRequest, worker: Worker | None, known: str | None) -> Generation:
    """Send and parse one generation; with ``RetryPolicy(generate_resends=N)`` (opt-in), resend up
    to N times, same request id, after an error that guarantees no engine started the request
    (``TransientError.nothing_generated``). Nothing else is ever resent."""
    # One coroutine for the whole call, resends included: a nested coroutine per call was
    # measurable at hundreds of calls in flight (client-overhead benchmark).
    wire, client = link.wire, link.client
    http = wire.generate(request, worker)
    target = worker.id if worker is not None else None
    attempt = 0
    while True:
        t0 = time.perf_counter()
        try:  # the send and the parse: either may raise a TransientError worth a resend
            resp = await client.send(http, worker=target)
            return wire.parse_generation(request, resp, time.perf_counter() - t0, worker=known)
        except TransientError as exc:
            if not exc.nothing_generated or attempt >= client.retry.generate_resends:
                raise
            attempt += 1
            await asyncio.sleep(client.retry.delay(attempt))


async def _stream(
    link: HttpLink,
    request: GenerateRequest,
    worker: Worker | None,
    known: str | None,
    abort_at: Callable[[str | None], Sequence[Worker]],
) -> AsyncGenerator[TokenChunk, None]:
    """One streamed generation: the wire's chunks, in order, the final one after the stream's end
    marker (the connection then goes back to the pool). Left early, the connection is closed (SGLang
    aborts a request whose client went away) and, where the wire aborts by id, the serving worker
    is told to abort it before this returns (``abort_at``: the workers to tell, given the serving
    worker's id where known: behind a router that does not say, every worker; an abort of an id a
    worker does not hold is a no-op on SGLang). The closed connection alone is not enough: SGLang
    notices a client gone only when it next writes an event, and a paused engine writes none."""
    wire, client = link.wire, link.client
    http = wire.stream(request, worker)
    t0 = time.perf_counter()
    events = client.stream(http, worker=worker.id if worker is not None else None)
    serving = known
    final: TokenChunk | None = None
    try:
        head = await events.__anext__()
        assert isinstance(head, HttpResponse)
        parser = wire.stream_parser(request, head, worker=known)
        serving = parser.worker
        async for data in events:
            assert isinstance(data, bytes)
            chunk = parser.event(data, time.perf_counter() - t0)
            if chunk is None:
                break
            if final is not None:
                raise ContractViolation(f"{request.request_id!r}: an event after the last one", worker=serving)
            if chunk.final is not None:
                final = chunk  # delivered after the end marker
            elif chunk.output_ids:  # an event may add no token (Dynamo's first chunk can be empty)
                yield chunk
        if final is None:
            raise ContractViolation(
                f"{request.request_id!r}: the stream ended before the generation did", worker=serving
            )
        yield final
    finally:
        await events.aclose()
        if final is None:
            targets = abort_at(serving) if wire.aborts_by_id else ()
            calls = [c for t in targets for c in _calls(wire.control(AbortRequest(request.request_id), t))]
            with contextlib.suppress(RolloutBackendError):  # best effort: the closed connection asked already
                await asyncio.gather(
                    *(client.send(attrs.evolve(c, timeout=c.timeout or client.control_timeout)) for c in calls)
                )


class HttpDriver:
    """One worker over HTTP: its ``Worker`` addresses, the shared wire and client."""

    __slots__ = ("_caps", "link", "worker")

    def __init__(self, link: HttpLink, worker: Worker, capabilities: Capabilities) -> None:
        self.link = link
        self.worker = worker
        self._caps = capabilities

    @property
    def id(self) -> str:
        return self.worker.id

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def aborts_by_id(self) -> bool:
        return self.link.wire.aborts_by_id

    @property
    def ranks(self) -> int:
        return self.worker.ranks

    async def generate(self, request: GenerateRequest) -> Generation:
        return await _generate(self.link, request, self.worker, self.worker.id)

    def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        return _stream(self.link, request, self.worker, self.worker.id, lambda _: (self.worker,))

    async def _call(self, op: Operation, req: HttpRequest) -> HttpResponse:
        if req.timeout is None:
            req = attrs.evolve(req, timeout=self.link.client.control_timeout)
        try:
            return await self.link.client.send(req, worker=self.worker.id)
        except RolloutBackendError as exc:
            raise ControlFailed(op.name, [WorkerFailure(self.worker.id, op.name, str(exc))]) from exc

    async def _send(self, op: Operation) -> HttpResponse | None:
        req = self.link.wire.control(op, self.worker)
        if isinstance(req, tuple):
            raise TypeError(f"{op.name}: a probe or a version read is one call, the wire built {len(req)}")
        return None if req is None else await self._call(op, req)

    async def control(self, op: Command) -> None:
        # Several calls: in order, each answer checked before the next is sent (ControlCalls).
        for req in _calls(self.link.wire.control(op, self.worker)):
            await self._until_taken(op, req)

    async def _until_taken(self, op: Command, req: HttpRequest) -> None:
        """Send one call; while the engine refuses it as busy (``Overloaded`` from the wire), send
        it again, backing off, until the command's wait (``busy_wait_s``) has passed; then
        ``ControlFailed`` with the engine's last answer."""
        wait_s = busy_wait_s(op)
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + wait_s, 0.02
        while True:
            try:
                self.link.wire.parse_control(op, self.worker, await self._call(op, req))
                return
            except Overloaded as exc:
                left = deadline - loop.time()
                if left <= 0:
                    busy = f"{exc} (still refused after {wait_s:g} s)" if wait_s else str(exc)
                    raise ControlFailed(op.name, [WorkerFailure(self.worker.id, op.name, busy)]) from exc
            await asyncio.sleep(min(pause, left))
            pause = min(2 * pause, 0.25)

    async def probe(self, op: Probe) -> bool | None:
        resp = await self._send(op)
        return None if resp is None else self.link.wire.parse_probe(op, self.worker, resp)

    async def served_version(self) -> str | None:
        resp = await self._send(GetVersion())
        return None if resp is None else self.link.wire.parse_version(self.worker, resp)

    async def aclose(self) -> None:
        return None  # the client is the fleet's, closed by its entry

    def __repr__(self) -> str:
        return f"<HttpDriver {self.worker.id} {self.worker.control_url}>"


class HttpEntry:
    """Unpinned generation through the fleet's entry point; its liveness is the router's.

    ``rotate``: there is no router; each unpinned request goes to the next worker in turn, sent as
    the wire sends a pinned one (so every answer names its worker)."""

    __slots__ = ("_next", "_sole", "_workers", "link")

    def __init__(
        self, link: HttpLink, sole_worker: str | None, workers: Sequence[Worker] = (), *, rotate: bool = False
    ) -> None:
        self.link = link
        #: The one worker of a single-worker fleet: it served every unpinned call.
        self._sole = sole_worker
        self._workers = {w.id: w for w in workers}
        self._next: Callable[[], Worker] | None = itertools.cycle(tuple(workers)).__next__ if rotate else None

    async def generate(self, request: GenerateRequest) -> Generation:
        if self._next is not None:
            w = self._next()
            return await _generate(self.link, request, w, w.id)
        return await _generate(self.link, request, None, self._sole)

    def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        if self._next is not None:
            w = self._next()
            return _stream(self.link, request, w, w.id, lambda _: (w,))
        return _stream(self.link, request, None, self._sole, self._abort_targets)

    def _abort_targets(self, serving: str | None) -> Sequence[Worker]:
        w = self._workers.get(serving) if serving is not None else None
        return (w,) if w is not None else tuple(self._workers.values())

    async def live(self) -> bool | None:
        http = self.link.wire.router_health()
        if http is None:
            return None
        try:
            resp = await self.link.client.send(attrs.evolve(http, timeout=http.timeout or 5.0))
        except RolloutBackendError:
            return False
        return bool(resp.ok)

    async def aclose(self) -> None:
        await self.link.client.aclose()


class HttpFleetBackend(Fleet):
    """The ``Fleet`` over HTTP: one ``HttpDriver`` per worker, generation through one entry point.

    Only construction and the HTTP accessors are here; the protocol is ``Fleet``'s.
    """

    def __init__(
        self,
        wire: Wire,
        workers: Sequence[Worker],
        *,
        client: HttpClient | None = None,
        name: str = "http",
        on_close: Callable[[], object] | None = None,
        rotate: bool = False,
    ) -> None:
        """``rotate``: no router in front of the workers; unpinned requests go to each in turn."""
        self._link = HttpLink(wire, client or HttpClient())
        caps = wire.capabilities()
        workers = tuple(workers)
        super().__init__(
            [HttpDriver(self._link, w, caps) for w in workers],
            entry=HttpEntry(self._link, workers[0].id if len(workers) == 1 else None, workers, rotate=rotate),
            capabilities=caps,
            name=name,
            on_close=on_close,
        )
        self._http_workers = {w.id: w for w in workers}

    @property
    def wire(self) -> Wire:
        return self._link.wire

    @wire.setter
    def wire(self, wire: Wire) -> None:
        self._link.wire = wire

    @property
    def client(self) -> HttpClient:
        return self._link.client

    @client.setter
    def client(self, client: HttpClient) -> None:
        self._link.client = client

    def worker(self, worker_id: str) -> Worker:
        """The addresses of one worker (``InvalidRequest`` for an unknown id)."""
        self.driver(worker_id)
        return self._http_workers[worker_id]
