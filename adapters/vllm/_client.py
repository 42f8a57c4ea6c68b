"""Connecting to running vLLM servers: read what each serves once, then build the backend."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs

from rollout_backends import BackendUnavailable, InvalidRequest, RolloutBackendError, RoutingKind
from rollout_backends.kit import HttpClient, HttpFleetBackend, Worker, get_json, normalise_url, worker_id_of

from ._wire import DEFAULT_LOGPROBS_MODE, VllmWire

__all__ = ["ServedConfig", "connect", "open_from_url", "served_config"]


def _normalise(url: str) -> str:
    return normalise_url(url, "vllm")


async def _get_json(client: HttpClient, url: str) -> Any:
    """The JSON body; ``None`` for a missing route (404); other errors raise."""
    status, data = await get_json(url, client=client, timeout=60.0)
    if status == 404:
        return None
    if not 200 <= status < 300:
        raise BackendUnavailable(f"GET {url}: HTTP {status}")
    return data


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


@attrs.frozen(slots=True, kw_only=True)
class ServedConfig:
    """What one vLLM server says about itself, read once at connect."""

    dev_routes: bool = False
    transfer_backend: str | None = None
    sleep_mode: bool = False
    max_logprobs: int = 20
    batch_invariant: bool = False
    max_model_len: int | None = None
    model_path: str | None = None
    #: ``--logprobs-mode``. Without the dev routes there is no ``/server_info`` to say: vLLM's
    #: default is assumed (our launcher always serves them, and says ``processed_logprobs``); a
    #: server that differs fails the filter checks, naming the cause, never passes them.
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE


async def served_config(client: HttpClient, url: str) -> ServedConfig:
    """``GET /is_paused`` (answered only with ``VLLM_SERVER_DEV_MODE=1``, which adds the RL and dev
    routes; side-effect free), ``GET /server_info?config_format=json`` (dev mode: the ``VllmConfig``
    and the ``VLLM_*`` environment) and ``GET /v1/models`` (``max_model_len``, the model path)."""
    dev = isinstance(await _get_json(client, f"{url}/is_paused"), dict)
    models = await _get_json(client, f"{url}/v1/models")
    data = models.get("data") if isinstance(models, dict) else None
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    max_len = _int(first.get("max_model_len"))
    if not dev:
        return ServedConfig(dev_routes=dev, max_model_len=max_len, model_path=first.get("root"))
    info = await _get_json(client, f"{url}/server_info?config_format=json") or {}
    info = info if isinstance(info, dict) else {}
    cfg = info.get("vllm_config") if isinstance(info.get("vllm_config"), dict) else {}
    assert isinstance(cfg, dict)
    model = cfg.get("model_config") if isinstance(cfg.get("model_config"), dict) else {}
    assert isinstance(model, dict)
    transfer = cfg.get("weight_transfer_config")
    env = info.get("vllm_env") if isinstance(info.get("vllm_env"), dict) else {}
    assert isinstance(env, dict)
    return ServedConfig(
        dev_routes=True,
        transfer_backend=transfer.get("backend") if isinstance(transfer, dict) else None,
        sleep_mode=bool(model.get("enable_sleep_mode")),
        max_logprobs=_int(model.get("max_logprobs")) or 20,
        batch_invariant=bool(env.get("VLLM_BATCH_INVARIANT")),
        max_model_len=max_len or _int(model.get("max_model_len")),
        model_path=model.get("model") if isinstance(model.get("model"), str) else first.get("root"),
        logprobs_mode=_str(model.get("logprobs_mode")) or DEFAULT_LOGPROBS_MODE,
    )


def vocab_size_of(model_path: object) -> int | None:
    """``vocab_size`` from a local model directory's ``config.json`` (``None`` if not readable here)."""
    if not isinstance(model_path, str) or not model_path:
        return None
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return _int(cfg.get("vocab_size")) if isinstance(cfg, dict) else None


async def connect(
    url: str,
    *,
    workers: Sequence[str] | None = None,
    routing: RoutingKind | str | None = None,
    vocab_size: int | None = None,
    cached_tokens: bool = False,
    initial_version: str | None = None,
    api_key: str | None = None,
    client: HttpClient | None = None,
    on_close: Any = None,
) -> HttpFleetBackend:
    """Connect to vLLM servers (``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1`` for the control routes).

    ``workers`` lists the servers' URLs; without it ``url`` is the one server. Where ``url`` is one
    of the workers (or none is given) there is no router: unpinned requests go to each server in
    turn. Otherwise ``url`` is a router in front of them (generation goes there; control calls
    still go to each server). ``initial_version``: the label the fleet's ``VersionBook`` starts with
    (vLLM 0.26 keeps none). ``cached_tokens``: the servers run with
    ``--enable-prompt-tokens-details`` (not visible from outside; the launcher says so). What each
    server serves is read from the first (``served_config``); the vocabulary size, unless given,
    from its model directory where readable here.
    """
    entry = _normalise(url)
    worker_urls = [_normalise(w) for w in workers] if workers else [entry]
    if not worker_urls:
        raise InvalidRequest("workers", "at least one server")
    router = entry not in worker_urls
    client = client or HttpClient(api_key=api_key)
    try:
        served = await served_config(client, worker_urls[0])
    except RolloutBackendError:
        await client.aclose()
        raise
    if routing is None:
        kind = RoutingKind.OTHER if router else RoutingKind.SINGLE if len(worker_urls) == 1 else RoutingKind.ROUND_ROBIN
    else:
        try:
            kind = RoutingKind(routing)
        except ValueError:
            await client.aclose()
            raise InvalidRequest("routing", f"unknown routing kind {routing!r}") from None
    wire = VllmWire(
        entry_url=entry,
        router=router,
        routing=kind,
        dev_routes=served.dev_routes,
        transfer_backend=served.transfer_backend,
        sleep_mode=served.sleep_mode,
        max_logprobs=served.max_logprobs,
        cached_tokens=cached_tokens,
        batch_invariant=served.batch_invariant,
        logprobs_mode=served.logprobs_mode,
        max_context=served.max_model_len,
        vocab_size=vocab_size if vocab_size is not None else vocab_size_of(served.model_path),
    )
    fleet = [Worker(id=worker_id_of(u), control_url=u, generate_url=u) for u in worker_urls]
    backend = HttpFleetBackend(wire, fleet, client=client, name="vllm", on_close=on_close, rotate=not router)
    if initial_version is not None:
        backend.set_installed_version(initial_version)
    return backend


#: The query keys ``open_from_url`` reads (what the launcher prints).
_URL_KEYS = frozenset({"workers", "routing", "vocab_size", "cached_tokens", "initial_version"})


def _flag(key: str, raw: str) -> bool:
    if raw.lower() not in ("0", "1", "true", "false"):
        raise InvalidRequest(f"url.{key}", f"must be 0/1/true/false, got {raw!r}")
    return raw.lower() in ("1", "true")


async def open_from_url(url: str, **kwargs: Any) -> HttpFleetBackend:
    """Registry entry: ``vllm://host:port?workers=h1:p1,h2:p2&vocab_size=N&cached_tokens=1&initial_version=v0``
    (the launcher prints such a URL with every key it knows)."""
    parts = urlsplit(url)
    query: Mapping[str, list[str]] = parse_qs(parts.query, keep_blank_values=True)
    for key in query:  # a typo (``?worker=2``) is refused, never ignored
        if key not in _URL_KEYS:
            raise InvalidRequest(f"url.{key}", f"unknown option (known: {sorted(_URL_KEYS)})")
    workers = [w for item in query.get("workers", ()) for w in item.split(",") if w]
    if workers:
        kwargs.setdefault("workers", workers)
    if "routing" in query:
        kwargs.setdefault("routing", query["routing"][-1])
    if "vocab_size" in query and "vocab_size" not in kwargs:
        raw = query["vocab_size"][-1]
        if not raw.isdigit() or int(raw) < 1:
            raise InvalidRequest("url.vocab_size", f"must be an integer >= 1, got {raw!r}")
        kwargs["vocab_size"] = int(raw)
    if "initial_version" in query:
        kwargs.setdefault("initial_version", query["initial_version"][-1])
    if "cached_tokens" in query:
        kwargs.setdefault("cached_tokens", _flag("cached_tokens", query["cached_tokens"][-1]))
    return await connect(f"http://{parts.netloc}{parts.path}", **kwargs)
