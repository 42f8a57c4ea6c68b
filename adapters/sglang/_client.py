"""Connecting to a running SGLang fleet: discover workers and features once, then build the backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

from rollout_backends import BackendUnavailable, InvalidRequest, RolloutBackendError, RoutingKind
from rollout_backends.kit import HttpClient, HttpFleetBackend, Worker, get_json, normalise_url, worker_id_of

from ._wire import SGLangWire

__all__ = ["connect", "open_from_url", "worker_id_of"]


def _normalise(url: str) -> str:
    return normalise_url(url, "sglang")


async def _get_json(client: HttpClient, url: str) -> Any:
    """The JSON body; ``None`` for a missing route (404); other errors raise."""
    status, data = await get_json(url, client=client)
    if status == 404:
        return None
    if not 200 <= status < 300:
        raise BackendUnavailable(f"GET {url}: HTTP {status}")
    return data


async def discover_router_workers(client: HttpClient, router_url: str) -> list[str] | None:
    """Worker URLs from a router's ``GET /workers`` (smg and sglang-router); None if not a router."""
    data = await _get_json(client, f"{router_url}/workers")
    if data is None:
        return None
    entries = data.get("workers", data) if isinstance(data, dict) else data
    if not isinstance(entries, list):
        return None
    urls = []
    for e in entries:
        u = e.get("url") if isinstance(e, dict) else e
        if isinstance(u, str):
            urls.append(u.rstrip("/"))
    return urls


async def connect(
    url: str,
    *,
    workers: Sequence[str] | None = None,
    routing: RoutingKind | str | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    client: HttpClient | None = None,
    vocab_size: int | None = None,
    on_close: Any = None,
) -> HttpFleetBackend:
    """Connect to a server or router at ``url``.

    ``workers`` lists worker URLs (control calls go to each); without it, a router's
    ``GET /workers`` is asked, and a plain server is its own single worker. Features
    (begin/end sessions, ``/ready``, memory saver, deterministic mode) are detected once here.
    ``admin_api_key`` (SGLang's ``--admin-api-key``) is sent on the admin control routes instead
    of ``api_key``.
    """
    entry = _normalise(url)
    client = client or HttpClient(api_key=api_key)
    if admin_api_key:
        client.set_admin_api_key(admin_api_key)
    try:
        if workers is None:
            found = await discover_router_workers(client, entry)
            worker_urls = found if found is not None else [entry]
            is_router = found is not None
        else:
            worker_urls = [_normalise(w) for w in workers]
            is_router = worker_urls != [entry]
        if not worker_urls:
            raise BackendUnavailable(f"{entry}: the router lists no workers")
        probe = worker_urls[0]
        openapi = await _get_json(client, f"{probe}/openapi.json") or {}
        paths = set((openapi.get("paths") or {}).keys()) if isinstance(openapi, dict) else set()
        info = await _get_json(client, f"{probe}/server_info")
        if info is None:
            info = await _get_json(client, f"{probe}/get_server_info") or {}
    except RolloutBackendError:
        await client.aclose()
        raise
    if routing is None:
        kind = RoutingKind.OTHER if is_router else RoutingKind.SINGLE
    else:
        try:
            kind = RoutingKind(routing)
        except ValueError:
            raise InvalidRequest("routing", f"unknown routing kind {routing!r}") from None
    ctx = info.get("context_length") if isinstance(info, dict) else None
    wire = SGLangWire(
        entry_url=entry,
        routing=kind,
        has_begin_end="/begin_weight_update" in paths,
        has_ready_route="/ready" in paths,
        memory_saver=bool(info.get("enable_memory_saver")) if isinstance(info, dict) else False,
        deterministic=bool(info.get("enable_deterministic_inference")) if isinstance(info, dict) else False,
        max_context=int(ctx) if isinstance(ctx, int) else None,
        vocab_size=vocab_size,
        url_workers={u.rstrip("/"): worker_id_of(u) for u in worker_urls},
    )
    fleet = [Worker(id=worker_id_of(u), control_url=u, generate_url=u) for u in worker_urls]
    return HttpFleetBackend(wire, fleet, client=client, name="sglang", on_close=on_close)


async def open_from_url(url: str, **kwargs: Any) -> HttpFleetBackend:
    """Registry entry: ``sglang://host:port?workers=h1:p1,h2:p2&routing=cache_aware&vocab_size=N``
    (``vocab_size``: token ids are checked against it before they are sent; the launcher prints
    such a URL with every key it knows)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    if "workers" in query and "workers" not in kwargs:
        kwargs["workers"] = [w for item in query["workers"] for w in item.split(",") if w]
    if "routing" in query and "routing" not in kwargs:
        kwargs["routing"] = query["routing"][0]
    if "vocab_size" in query and "vocab_size" not in kwargs:
        raw = query["vocab_size"][-1]
        if not raw.isdigit() or int(raw) < 1:
            raise InvalidRequest("url.vocab_size", f"must be an integer >= 1, got {raw!r}")
        kwargs["vocab_size"] = int(raw)
    base = f"http://{parts.netloc}{parts.path}"
    return await connect(base, **kwargs)
