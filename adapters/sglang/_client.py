"""Connecting to a running SGLang fleet: discover workers and features once, then build the backend."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs

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


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def vocab_size_of(model_path: object) -> int | None:
    """``vocab_size`` from a local model directory's ``config.json`` (``None`` if not readable here)."""
    if not isinstance(model_path, str) or not model_path:
        return None
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return _positive_int(cfg.get("vocab_size")) if isinstance(cfg, dict) else None


@attrs.frozen(slots=True)
class ServedLimits:
    """What a server says about its model's limits (``None``: it does not say)."""

    vocab_size: int | None
    context_length: int | None
    #: The checkpoint directory the server loaded (``/model_info``'s ``model_path``).
    model_path: str | None = None


async def discover_limits(client: HttpClient, worker_url: str, server_info: Mapping[str, Any]) -> ServedLimits:
    """The vocabulary size and context length of the model ``worker_url`` serves, from the server.

    Context length: ``/server_info``'s ``context_length`` (the reference server, and stock SGLang
    when launched with ``--context-length``), else ``/v1/models``' ``max_model_len`` (stock
    SGLang's resolved context). Vocabulary size: a ``vocab_size`` in ``/model_info`` (or
    ``/get_model_info``) where a server reports one, else the ``config.json`` of the
    ``model_path`` it reports, where that directory is readable here (fleets launched on this
    host; what the launchers put in their connect URLs). Asked once, at connect.
    """
    ctx = _positive_int(server_info.get("context_length"))
    if ctx is None:
        models = await _get_json(client, f"{worker_url}/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict):
            ctx = _positive_int(data[0].get("max_model_len"))
    info = await _get_json(client, f"{worker_url}/model_info")
    if info is None:
        info = await _get_json(client, f"{worker_url}/get_model_info")
    info = info if isinstance(info, dict) else {}
    path = info.get("model_path") or server_info.get("model_path")
    vocab = _positive_int(info.get("vocab_size"))
    if vocab is None:
        vocab = vocab_size_of(path)
    return ServedLimits(
        vocab_size=vocab, context_length=ctx, model_path=path if isinstance(path, str) and path else None
    )


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
    of ``api_key``. The vocabulary size (unless given) and the context length are asked of the
    first worker (:func:`discover_limits`).
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
    try:
        limits = await discover_limits(client, probe, info if isinstance(info, dict) else {})
    except RolloutBackendError:
        await client.aclose()
        raise
    ctx = limits.context_length
    if vocab_size is None:
        vocab_size = limits.vocab_size
    wire = SGLangWire(
        entry_url=entry,
        routing=kind,
        has_begin_end="/begin_weight_update" in paths,
        has_ready_route="/ready" in paths,
        memory_saver=bool(info.get("enable_memory_saver")) if isinstance(info, dict) else False,
        deterministic=bool(info.get("enable_deterministic_inference")) if isinstance(info, dict) else False,
        # SGLang refuses stop strings under --skip-tokenizer-init (/server_info says which).
        stop_strings=isinstance(info, dict) and info.get("skip_tokenizer_init") is False,
        max_context=ctx,
        vocab_size=vocab_size,
        model_path=limits.model_path,
        url_workers={u.rstrip("/"): worker_id_of(u) for u in worker_urls},
    )
    fleet = [Worker(id=worker_id_of(u), control_url=u, generate_url=u) for u in worker_urls]
    return HttpFleetBackend(wire, fleet, client=client, name="sglang", on_close=on_close)


#: The query keys ``open_from_url`` reads (what the launcher prints).
_URL_KEYS = frozenset({"workers", "routing", "vocab_size"})


async def open_from_url(url: str, **kwargs: Any) -> HttpFleetBackend:
    """Registry entry: ``sglang://host:port?workers=h1:p1,h2:p2&routing=cache_aware&vocab_size=N``
    (``vocab_size``: token ids are checked against it before they are sent; the launcher prints
    such a URL with every key it knows)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query, keep_blank_values=True)
    for key in query:  # a typo (``?worker=2``) is refused, never ignored
        if key not in _URL_KEYS:
            raise InvalidRequest(f"url.{key}", f"unknown option (known: {sorted(_URL_KEYS)})")
    workers = [w for item in query.get("workers", ()) for w in item.split(",") if w]
    if workers and "workers" not in kwargs:
        kwargs["workers"] = workers
    if "routing" in query and "routing" not in kwargs:
        kwargs["routing"] = query["routing"][0]
    if "vocab_size" in query and "vocab_size" not in kwargs:
        raw = query["vocab_size"][-1]
        if not raw.isdigit() or int(raw) < 1:
            raise InvalidRequest("url.vocab_size", f"must be an integer >= 1, got {raw!r}")
        kwargs["vocab_size"] = int(raw)
    base = f"http://{parts.netloc}{parts.path}"
    return await connect(base, **kwargs)
