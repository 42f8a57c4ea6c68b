"""The HTTP driver: a ``Fleet`` of engines reached over HTTP, for any adapter's wire format.

An adapter supplies a ``Wire``: pure functions from operations to ``HttpRequest`` values and from
``HttpResponse`` values to results. ``HttpDriver`` sends one worker's calls through the fleet's
``HttpClient`` (timeouts, retries, auth); ``HttpEntry`` sends unpinned generation to the entry
point (a router, or the one server). Everything else (validation, fan-out, versions, health, the
transaction) is the ``Fleet``'s, once for every engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Protocol

import attrs

from rollout_backends._errors import ControlFailed, RolloutBackendError, TransientError, WorkerFailure
from rollout_backends._fleet import Fleet, not_streamed
from rollout_backends._http import HttpClient, HttpRequest, HttpResponse
from rollout_backends._ops import Command, GetVersion, Operation, Probe
from rollout_backends._types import Capabilities, GenerateRequest, Generation, TokenChunk

__all__ = ["HttpDriver", "HttpEntry", "HttpFleetBackend", "HttpLink", "Wire", "Worker"]


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
        return not_streamed(self.worker.id)

    async def _send(self, op: Operation) -> HttpResponse | None:
        req = self.link.wire.control(op, self.worker)
        if req is None:
            return None
        if req.timeout is None:
            req = attrs.evolve(req, timeout=self.link.client.control_timeout)
        try:
            return await self.link.client.send(req, worker=self.worker.id)
        except RolloutBackendError as exc:
            raise ControlFailed(op.name, [WorkerFailure(self.worker.id, op.name, str(exc))]) from exc

    async def control(self, op: Command) -> None:
        resp = await self._send(op)
        if resp is not None:
            self.link.wire.parse_control(op, self.worker, resp)

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
    """Unpinned generation through the fleet's entry point; its liveness is the router's."""

    __slots__ = ("_sole", "link")

    def __init__(self, link: HttpLink, sole_worker: str | None) -> None:
        self.link = link
        #: The one worker of a single-worker fleet: it served every unpinned call.
        self._sole = sole_worker

    async def generate(self, request: GenerateRequest) -> Generation:
        return await _generate(self.link, request, None, self._sole)

    def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        return not_streamed("the entry")

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
    ) -> None:
        self._link = HttpLink(wire, client or HttpClient())
        caps = wire.capabilities()
        workers = tuple(workers)
        super().__init__(
            [HttpDriver(self._link, w, caps) for w in workers],
            entry=HttpEntry(self._link, workers[0].id if len(workers) == 1 else None),
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
