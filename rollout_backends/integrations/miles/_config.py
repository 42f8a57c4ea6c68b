"""Miles flags for the rollout backend, and the per-process backend cache.

``add_arguments(parser)`` is what Miles calls as ``generate.add_arguments`` (its
``add_user_provided_function_arguments``). ``backend_url(args)`` turns the parsed flags into the URL
that ``rollout_backends.open_backend`` takes; ``get_backend(args)`` opens it once per process and
event loop.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from rollout_backends import InvalidRequest, RolloutBackend, open_backend

__all__ = ["DYNAMO_QUERY_KEYS", "add_arguments", "backend_url", "close_backends", "get_backend"]

#: Dynamo flag (attribute on Miles' ``args``) → query key of the ``dynamo://`` URL.
#: These are the knobs of Miles #1514/#1646; the keys are what ``adapters.dynamo`` reads.
DYNAMO_QUERY_KEYS: dict[str, str] = {
    "dynamo_router_mode": "router_mode",
    "dynamo_page_size": "page_size",
    "dynamo_router_kv_events": "kv_events",
    "dynamo_router_predict_on_route": "predict_on_route",
    "dynamo_router_predicted_ttl_secs": "router_predicted_ttl_secs",
    "dynamo_stream_interval": "stream_interval",
    "dynamo_discovery_backend": "discovery_backend",
    "dynamo_model_name": "model_name",
}


def _has_option(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--rollout-backend`` and its knobs to Miles' parser (flags Miles already has are kept)."""

    def add(flag: str, **kwargs: Any) -> None:
        # Miles #1646 adds --rollout-backend itself; never register a flag twice (argparse raises).
        if not _has_option(parser, flag):
            parser.add_argument(flag, **kwargs)

    add(
        "--rollout-backend",
        choices=["sglang", "dynamo"],
        default="sglang",
        help="rollout-backends: which engine fleet generates (default sglang).",
    )
    add(
        "--rollout-backend-url",
        type=str,
        default=None,
        help="rollout-backends: the backend URL (sglang://host:port, dynamo://host:port, reference://...). "
        "Default: <--rollout-backend>://<--sglang-router-ip>:<--sglang-router-port>.",
    )
    add(
        "--rollout-backend-max-retries",
        type=int,
        default=60,
        help="rollout-backends: retries of a generation that failed before any token (Miles' post() uses 60).",
    )
    add(
        "--dynamo-router-mode",
        choices=["kv", "round-robin", "random"],
        default=None,
        help="Dynamo frontend router mode (default: the frontend's).",
    )
    add("--dynamo-page-size", type=int, default=None, help="Dynamo workers' KV page size = router block size.")
    add(
        "--dynamo-router-kv-events",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="KV router fed by workers' KV events (--no-...: approximate mode).",
    )
    add(
        "--dynamo-router-predict-on-route",
        action="store_true",
        default=False,
        help="Predict cache state on route (for GRPO sibling bursts; needs KV events).",
    )
    add(
        "--dynamo-router-predicted-ttl-secs",
        type=float,
        default=None,
        help="TTL of predicted-on-route blocks (Dynamo --router-predicted-ttl-secs).",
    )
    add(
        "--dynamo-stream-interval",
        type=int,
        default=None,
        help="Workers' SGLang --stream-interval (Miles #1514 used DYN_SGLANG_STREAM_INTERVAL=50).",
    )
    add(
        "--dynamo-discovery-backend",
        choices=["etcd", "file", "kubernetes", "mem"],
        default=None,
        help="Dynamo discovery backend (kv mode across hosts needs etcd or kubernetes).",
    )
    add("--dynamo-model-name", type=str, default=None, help="Served model name on the Dynamo frontend.")
    return parser


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def backend_url(args: Any) -> str:
    """The backend URL from Miles' ``args``.

    ``--rollout-backend-url`` wins; otherwise ``<backend>://<router ip>:<router port>``. For
    Dynamo, every Dynamo knob that is set is added to the query unless the URL already has it.
    """
    kind = getattr(args, "rollout_backend", None) or "sglang"
    url = getattr(args, "rollout_backend_url", None)
    if not url:
        ip = getattr(args, "sglang_router_ip", None)
        port = getattr(args, "sglang_router_port", None)
        if not ip or not port:
            raise InvalidRequest(
                "rollout_backend_url", "set --rollout-backend-url, or --sglang-router-ip and --sglang-router-port"
            )
        url = f"{kind}://{ip}:{port}"
    parts = urlsplit(url)
    if parts.scheme == "dynamo":
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        for attr, key in DYNAMO_QUERY_KEYS.items():
            value = getattr(args, attr, None)
            if value is None or key in query or (attr == "dynamo_router_predict_on_route" and not value):
                continue
            query[key] = _query_value(value)
        url = urlunsplit(parts._replace(query=urlencode(query)))
    return str(url)


# -- the per-process cache ------------------------------------------------------------------------

_CACHE: dict[tuple[str, int], asyncio.Future[RolloutBackend]] = {}


async def get_backend(args_or_url: Any) -> RolloutBackend:
    """The backend for ``args`` (or a URL), opened once per process and event loop, then cached.

    Concurrent first calls share one ``open_backend``; a failed open is not cached.
    """
    url = args_or_url if isinstance(args_or_url, str) else backend_url(args_or_url)
    loop = asyncio.get_running_loop()
    key = (url, id(loop))
    fut = _CACHE.get(key)
    if fut is None:
        fut = loop.create_task(open_backend(url))
        _CACHE[key] = fut
    try:
        return await asyncio.shield(fut)
    except Exception:
        if _CACHE.get(key) is fut:
            del _CACHE[key]
        raise


async def close_backends() -> None:
    """Close every backend this process opened on the running loop (tests, shutdown)."""
    loop_id = id(asyncio.get_running_loop())
    for key in [k for k in _CACHE if k[1] == loop_id]:
        fut = _CACHE.pop(key)
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            await fut.result().aclose()
