"""The one HTTP core: requests, responses, a transport seam, retries and timeouts.

Adapters never do I/O: they build ``HttpRequest`` values and parse ``HttpResponse`` values.
``HttpClient`` sends them through a ``Transport``: ``AiohttpTransport`` for real servers,
``MockTransport`` for tests (no network).

aiohttp is the core client because it keeps CPU per request flat at hundreds of concurrent
requests, where httpx's does not (the figures: ``docs/benchmarks.md``, "Figures behind the hot
path").
"""

from __future__ import annotations

import asyncio
import json as _json
import random
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from rollout_backends._errors import (
    BackendTimeout,
    ConnectionFailed,
    ContractViolation,
    InvalidRequest,
    RolloutBackendError,
    TransientError,
)
from rollout_backends._timeouts import Deadlines


def _stdlib_dumps(obj: Any) -> bytes:
    return _json.dumps(obj, separators=(",", ":")).encode()


def _stdlib_loads(data: bytes) -> Any:
    return _json.loads(data)


_dumps: Callable[[Any], bytes] = _stdlib_dumps
_loads: Callable[[bytes], Any] = _stdlib_loads
try:  # orjson is optional: faster, same output for the JSON we send
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    pass
else:  # its C functions themselves: no Python frame per call
    _dumps = _orjson.dumps
    _loads = _orjson.loads

#: JSON bytes to a value, with orjson where it is installed: for adapters parsing bodies that are
#: not one JSON object (an SSE stream's events), the same parser ``HttpResponse.json`` uses.
json_loads: Callable[[bytes], Any] = _loads


__all__ = [
    "AiohttpTransport",
    "HttpClient",
    "HttpRequest",
    "HttpResponse",
    "MockTransport",
    "RetryPolicy",
    "SseDecoder",
    "StreamItem",
    "Transport",
    "get_json",
    "json_loads",
    "sse_json",
    "normalise_url",
    "worker_id_of",
]

#: 3.11+ (``Task.uncancel``): per-call deadlines without a task per call (``_timeouts``).
_HAS_UNCANCEL = hasattr(asyncio.Task, "uncancel")
#: Header names whose values are secrets: never shown in a repr or message.
_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie"})


def _seconds(field: str, value: object) -> float:
    """A positive, finite number of seconds, else ``InvalidRequest`` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise InvalidRequest(field, f"must be a positive number of seconds, got {value!r}")
    return float(value)


def _headers_repr(headers: Mapping[str, str]) -> str:
    """``repr`` of a header map with secret values replaced (an ``HttpRequest`` may be logged)."""
    return repr({k: ("***" if k.lower() in _SECRET_HEADERS else v) for k, v in headers.items()})


@attrs.frozen(slots=True)
class HttpRequest:
    """One HTTP call, fully described. ``json`` is serialised by the client."""

    method: str
    url: str
    json: Any = attrs.field(default=None, repr=False)  # bodies may be huge (tensor payloads)
    headers: Mapping[str, str] = attrs.field(factory=dict, repr=_headers_repr)
    #: Seconds for the whole call; ``None`` uses the client's default.
    timeout: float | None = None
    #: Safe to send twice (no side effect beyond the first). Only idempotent calls are retried
    #: after a failure that may have reached the server (never after a timeout).
    idempotent: bool = False
    #: An admin (control) route: sent with the client's ``admin_api_key`` when it has one.
    admin: bool = False


@attrs.frozen(slots=True)
class HttpResponse:
    status: int
    body: bytes
    headers: Mapping[str, str] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; an unparseable body is a ``ContractViolation``."""
        try:
            return _loads(self.body) if self.body else None
        except ValueError as exc:
            raise ContractViolation(f"expected JSON (HTTP {self.status}), got {self.text[:200]!r}") from exc

    @classmethod
    def from_json(cls, data: Any, status: int = 200) -> HttpResponse:
        return cls(status, _dumps(data), {"Content-Type": "application/json"})


#: What a streamed call yields: first the head (an ``HttpResponse``: status and headers, the body
#: empty where the status is 2xx, else the whole body and nothing after it), then each server-sent
#: event's data (``bytes``, its ``data:`` lines joined).
StreamItem = HttpResponse | bytes


class SseDecoder:
    """Server-sent events from a byte stream, incrementally: ``feed`` the bytes as they come, get
    each complete event's data (its ``data:`` lines joined by newlines; events without data, and
    comments, are skipped). Lines end in LF or CRLF (the WHATWG rules, less the lone CR)."""

    __slots__ = ("_buf", "_data")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        events: list[bytes] = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
        return events

    def close(self) -> list[bytes]:
        """What is left when the stream ends (an event not followed by a blank line still counts)."""
        events = self.feed(b"\n\n") if self._buf or self._data else []
        return events


#: The data of the event that ends an SGLang or OpenAI-style stream.
SSE_DONE = b"[DONE]"


def sse_json(data: bytes, what: str, *, worker: str | None) -> object:
    """One server-sent event's data as JSON (``what`` names the stream in the error); ``None`` for
    the end marker ``data: [DONE]``."""
    if data == SSE_DONE:
        return None
    try:
        return json_loads(data)
    except ValueError as exc:
        raise ContractViolation(f"{what}: an event is not JSON: {data[:200]!r}", worker=worker) from exc


@runtime_checkable
class Transport(Protocol):
    """Sends one request. Raises ``ConnectionFailed`` or ``BackendTimeout``, never library-specific errors."""

    async def send(self, request: HttpRequest, timeout: float) -> HttpResponse: ...

    def stream(self, request: HttpRequest, timeout: float, idle_timeout: float) -> AsyncGenerator[StreamItem, None]:
        """Send one request whose answer is server-sent events: the head (``StreamItem``) within
        ``timeout``, then each event, each within ``idle_timeout`` of the bytes before it.
        Closing the generator early closes the connection (a server sees the client go away)."""
        ...

    async def aclose(self) -> None: ...


class AiohttpTransport:
    """The real transport: one pooled ``aiohttp.ClientSession``, created lazily inside the loop."""

    def __init__(
        self,
        *,
        max_connections: int = 0,
        max_connections_per_host: int = 0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        import aiohttp  # here, not per call: even a cached import statement showed in profiles

        self._aiohttp = aiohttp
        self._limit = max_connections
        self._limit_per_host = max_connections_per_host
        #: Sent with every request (a request's own header of the same name wins).
        self._headers = dict(headers or {})
        self._session: Any = None
        #: Per-call timeouts, one loop timer per timeout value (see ``_timeouts``); 3.11+.
        self._deadlines = Deadlines() if _HAS_UNCANCEL else None

    def _ensure(self) -> Any:
        if self._session is None or self._session.closed:
            aiohttp = self._aiohttp
            connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=self._limit_per_host, ttl_dns_cache=300)
            # Timeouts are per call (``send`` below); the session's own are off. Bodies are read
            # as sent (no decompression on the hot path), so say so: without this aiohttp offers
            # gzip/deflate and a server that takes the offer answers bytes nobody decodes.
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None),
                auto_decompress=False,
                headers={"Accept-Encoding": "identity", **self._headers},
            )
        return self._session

    async def send(self, request: HttpRequest, timeout: float) -> HttpResponse:
        aiohttp = self._aiohttp
        try:
            session = self._session
            if session is None or session.closed:
                session = self._ensure()
            # A JSON body goes as a ready ``BytesPayload`` carrying its own ``Content-Type``, so a
            # request without headers of its own passes none: aiohttp then skips its payload-type
            # lookup and the per-call conversion of a header dict. A request's own Content-Type
            # still wins (aiohttp applies a payload's headers only where the request has none).
            headers = request.headers or None
            data = None
            if request.json is not None:
                data = aiohttp.BytesPayload(_dumps(request.json), content_type="application/json")
            if self._deadlines is None:  # 3.10: no Task.uncancel, so a task per call
                return await asyncio.wait_for(_exchange(session, request.method, request.url, data, headers), timeout)
            with self._deadlines.enter(timeout):  # no task, no loop timer of its own per call
                async with session.request(request.method, request.url, data=data, headers=headers) as resp:
                    return HttpResponse(resp.status, await resp.read(), resp.headers)
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise BackendTimeout(f"{request.method} {_safe_url(request.url)}: no answer in {timeout:.1f}s") from exc
        except aiohttp.ClientConnectorError as exc:
            # Nothing was sent: the server cannot have acted on the request.
            raise ConnectionFailed(
                f"{request.method} {_safe_url(request.url)}: cannot connect ({exc.os_error})", nothing_generated=True
            ) from exc
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            raise ConnectionFailed(f"{request.method} {_safe_url(request.url)}: {type(exc).__name__}: {exc}") from exc

    async def stream(
        self, request: HttpRequest, timeout: float, idle_timeout: float
    ) -> AsyncGenerator[StreamItem, None]:
        aiohttp = self._aiohttp
        where = f"{request.method} {_safe_url(request.url)}"
        data = None
        if request.json is not None:
            data = aiohttp.BytesPayload(_dumps(request.json), content_type="application/json")
        session = self._session if self._session is not None and not self._session.closed else self._ensure()
        try:
            resp = await asyncio.wait_for(
                session.request(request.method, request.url, data=data, headers=request.headers or None), timeout
            )
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise BackendTimeout(f"{where}: no answer in {timeout:.1f}s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise ConnectionFailed(f"{where}: cannot connect ({exc.os_error})", nothing_generated=True) from exc
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            raise ConnectionFailed(f"{where}: {type(exc).__name__}: {exc}") from exc
        done = False
        try:
            if not 200 <= resp.status < 300:
                body = await asyncio.wait_for(resp.read(), timeout)
                done = True
                yield HttpResponse(resp.status, body, resp.headers)
                return
            yield HttpResponse(resp.status, b"", resp.headers)
            decoder = SseDecoder()
            while True:
                # Not readline(): aiohttp refuses a line past its buffer limit (128 KiB), and
                # SGLang's cumulative events of a long output are longer.
                chunk = await asyncio.wait_for(resp.content.readany(), idle_timeout)
                if not chunk:
                    break
                for event in decoder.feed(chunk):
                    yield event
            for event in decoder.close():
                yield event
            done = True
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise BackendTimeout(f"{where}: no event in {idle_timeout:.1f}s") from exc
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            raise ConnectionFailed(f"{where}: {type(exc).__name__}: {exc}") from exc
        finally:
            if done:
                resp.release()  # read to the end: the connection goes back to the pool
            else:
                resp.close()  # left early: the connection is closed, which the server sees

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _exchange(session: Any, method: str, url: str, data: Any, headers: Mapping[str, str] | None) -> HttpResponse:
    """One call through aiohttp (3.10's path; 3.11+ inlines it in ``AiohttpTransport.send``)."""
    async with session.request(method, url, data=data, headers=headers) as resp:
        return HttpResponse(resp.status, await resp.read(), resp.headers)


Handler = Callable[[HttpRequest], "HttpResponse | Awaitable[HttpResponse] | AsyncIterator[bytes]"]


class MockTransport:
    """A transport that calls ``handler(request)`` in process: tests need no network.

    The handler may raise ``ConnectionFailed``/``BackendTimeout`` to simulate faults. For a streamed
    call it may return an ``HttpResponse`` (its body is the whole event stream) or an async
    iterator of body bytes (status 200): closing the stream early closes that iterator (``aclose``,
    where it has one), as a server sees a client go away.
    """

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[HttpRequest] = []

    async def send(self, request: HttpRequest, timeout: float) -> HttpResponse:
        self.requests.append(request)
        result = self.handler(request)
        if isinstance(result, HttpResponse):
            return result
        if isinstance(result, AsyncIterator):
            raise TypeError("the handler streamed an answer to a call that is not streamed")
        try:
            return await asyncio.wait_for(result, timeout)
        except asyncio.TimeoutError as exc:
            raise BackendTimeout(f"{request.method} {request.url}: no answer in {timeout:.1f}s") from exc

    async def stream(
        self, request: HttpRequest, timeout: float, idle_timeout: float
    ) -> AsyncGenerator[StreamItem, None]:
        self.requests.append(request)
        result = self.handler(request)
        where = f"{request.method} {request.url}"
        if not isinstance(result, (HttpResponse, AsyncIterator)):
            try:
                result = await asyncio.wait_for(result, timeout)
            except asyncio.TimeoutError as exc:
                raise BackendTimeout(f"{where}: no answer in {timeout:.1f}s") from exc
        if isinstance(result, HttpResponse):
            if not result.ok:
                yield result
                return
            yield HttpResponse(result.status, b"", result.headers)
            decoder = SseDecoder()
            for event in [*decoder.feed(result.body), *decoder.close()]:
                yield event
            return
        body = result
        yield HttpResponse(200, b"", {"Content-Type": "text/event-stream"})
        decoder = SseDecoder()
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(body.__anext__(), idle_timeout)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError as exc:
                    raise BackendTimeout(f"{where}: no event in {idle_timeout:.1f}s") from exc
                for event in decoder.feed(chunk):
                    yield event
            for event in decoder.close():
                yield event
        finally:
            close = getattr(body, "aclose", None)
            if close is not None:
                await close()

    async def aclose(self) -> None:
        return None


@attrs.frozen(slots=True, kw_only=True)
class RetryPolicy:
    """Retries for transient failures.

    * ``attempts``: sends of one HTTP call. Any call is resent when the connection was never made
      (``nothing_generated``); idempotent calls also after a dropped connection. A timeout is never
      resent: the timeout is the budget of the whole call (a hung worker would multiply it).
    * ``generate_resends``: **opt-in** (0 = off). How many times ``generate`` is resent, same
      request id, after an error that guarantees no engine started it (``TransientError`` with
      ``nothing_generated``: e.g. a router or frontend that could not reach a worker). Errors after
      which tokens may exist (timeouts, connections lost mid-answer, a worker dying mid-request)
      are never resent. See ``docs/reliability.md``.
    """

    attempts: int = 3
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    generate_resends: int = 0

    def __attrs_post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise InvalidRequest("retry.attempts", f"must be an int >= 1, got {self.attempts!r}")
        if (
            isinstance(self.generate_resends, bool)
            or not isinstance(self.generate_resends, int)
            or self.generate_resends < 0
        ):
            raise InvalidRequest("retry.generate_resends", f"must be an int >= 0, got {self.generate_resends!r}")

    def delay(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.backoff_s * (2**attempt))
        return float(base * (0.5 + random.random() / 2))


def _safe_url(url: str) -> str:
    """The URL without credentials or query (which may carry keys): safe for messages."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class HttpClient:
    """Sends ``HttpRequest`` values with timeouts, retries and auth headers. One per backend.

    ``api_key`` is sent as ``Authorization: Bearer`` on every call; ``admin_api_key`` (SGLang's
    ``--admin-api-key``) instead of it on calls marked ``HttpRequest.admin`` (control routes).
    Neither key appears in a repr, a message or a log line of this library.
    """

    def __init__(
        self,
        transport: Transport | None = None,
        *,
        timeout: float = 600.0,
        control_timeout: float = 120.0,
        retry: RetryPolicy | None = None,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        stream_idle_timeout: float = 600.0,
    ) -> None:
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._admin_auth = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
        # Our own transport sends the auth header as a session default: no per-request copy.
        self._auth_in_transport = transport is None
        self.transport: Transport = transport if transport is not None else AiohttpTransport(headers=self._auth)
        self.timeout = _seconds("timeout", timeout)
        self.control_timeout = _seconds("control_timeout", control_timeout)
        #: A streamed answer's longest silence between events (a paused engine sends none: as long
        #: as the whole-call ``timeout`` by default).
        self.stream_idle_timeout = _seconds("stream_idle_timeout", stream_idle_timeout)
        self.retry = retry or RetryPolicy()

    def set_admin_api_key(self, admin_api_key: str | None) -> None:
        """Use ``admin_api_key`` on admin calls from now on (``None``: the ``api_key``)."""
        self._admin_auth = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}

    def __repr__(self) -> str:  # the keys never appear
        return (
            f"<HttpClient transport={type(self.transport).__name__} auth={'yes' if self._auth else 'no'}"
            f" admin_auth={'yes' if self._admin_auth else 'no'}>"
        )

    async def send(self, request: HttpRequest, *, worker: str | None = None) -> HttpResponse:
        timeout = request.timeout if request.timeout is not None else self.timeout
        if "Authorization" not in request.headers:
            if request.admin and self._admin_auth:
                request = attrs.evolve(request, headers={**self._admin_auth, **request.headers})
            elif self._auth and not self._auth_in_transport:
                request = attrs.evolve(request, headers={**self._auth, **request.headers})
        attempt = 0
        while True:
            try:
                return await self.transport.send(request, timeout)
            except TransientError as exc:
                if exc.worker is None and worker is not None:
                    exc.worker = worker
                if isinstance(exc, BackendTimeout):
                    raise  # the timeout was the whole call's budget
                # A refused connection never reached the server: safe to resend anything.
                safe = (
                    exc.nothing_generated
                    or request.idempotent
                    or (isinstance(exc, ConnectionFailed) and "cannot connect" in str(exc))
                )
                attempt += 1
                if not safe or attempt >= self.retry.attempts:
                    raise
                await asyncio.sleep(self.retry.delay(attempt))

    async def stream(self, request: HttpRequest, *, worker: str | None = None) -> AsyncGenerator[StreamItem, None]:
        """``send`` for an answer of server-sent events (``Transport.stream``): the head within the
        call's timeout, then the events, each within ``stream_idle_timeout``. Resent only where the
        connection was never made (nothing can have been generated). Closing it early closes the
        connection."""
        timeout = request.timeout if request.timeout is not None else self.timeout
        if "Authorization" not in request.headers and self._auth and not self._auth_in_transport:
            request = attrs.evolve(request, headers={**self._auth, **request.headers})
        attempt = 0
        while True:
            events = self.transport.stream(request, timeout, self.stream_idle_timeout)
            try:
                head = await events.__anext__()
                break
            except TransientError as exc:
                await events.aclose()
                if exc.worker is None and worker is not None:
                    exc.worker = worker
                attempt += 1
                if not exc.nothing_generated or attempt >= self.retry.attempts:
                    raise
                await asyncio.sleep(self.retry.delay(attempt))
            except StopAsyncIteration:
                raise ContractViolation(f"{request.method} {_safe_url(request.url)}: a stream with no answer") from None
        try:
            yield head
            async for item in events:
                yield item
        except TransientError as exc:
            if exc.worker is None and worker is not None:
                exc.worker = worker
            raise
        finally:
            await events.aclose()

    async def aclose(self) -> None:
        await self.transport.aclose()


async def get_json(url: str, *, client: HttpClient | None = None, timeout: float = 10.0) -> tuple[int, Any]:
    """``GET url`` (idempotent): the status and the body as JSON (``None`` when empty or not JSON).

    Through ``client`` (its retries and auth), or a one-shot client without retries (readiness
    checks, which are retried by their caller). Connection errors raise (``ConnectionFailed``...).
    """
    own = client is None
    c = client if client is not None else HttpClient(retry=RetryPolicy(attempts=1))
    try:
        resp = await c.send(HttpRequest("GET", url, timeout=timeout, idempotent=True))
    finally:
        if own:
            await c.aclose()
    try:
        return resp.status, resp.json()
    except RolloutBackendError:
        return resp.status, None


def normalise_url(url: str, scheme: str | None = None) -> str:
    """``http://host:port`` from ``host:port``, ``http://host:port/`` or ``<scheme>://host:port``."""
    url = url.rstrip("/")
    if scheme and url.startswith(f"{scheme}://"):
        url = "http://" + url[len(scheme) + 3 :]
    if "://" not in url:
        url = "http://" + url
    return url


def worker_id_of(url: str) -> str:
    """A worker's id: its URL's ``host:port`` (stable; what routers list)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url if "://" in url else f"http://{url}")
    return f"{parts.hostname}:{parts.port}"
