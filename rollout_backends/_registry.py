"""``open_backend(url)``: the one place that maps a URL scheme to an adapter.

Built-in schemes: ``reference://`` (in-process CPU engine), ``sglang://`` (a server or router),
``dynamo://`` (a Dynamo frontend), ``vllm://`` (vLLM servers). Third-party adapters register an entry point in the group
``rollout_backends.adapters`` whose name is the scheme and whose object is
``async def open_from_url(url: str, **kwargs) -> RolloutBackend``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from rollout_backends._errors import InvalidRequest, Unsupported
from rollout_backends._protocol import RolloutBackend

__all__ = ["ENTRY_POINT_GROUP", "available_schemes", "open_backend", "register_scheme"]

ENTRY_POINT_GROUP = "rollout_backends.adapters"

_BUILTIN: dict[str, str] = {
    "reference": "rollout_backends.adapters.reference:open_from_url",
    "sglang": "rollout_backends.adapters.sglang:open_from_url",
    "dynamo": "rollout_backends.adapters.dynamo:open_from_url",
    "vllm": "rollout_backends.adapters.vllm:open_from_url",
}
_REGISTERED: dict[str, Callable[..., Any]] = {}


def register_scheme(scheme: str, opener: Callable[..., Any]) -> None:
    """Register an opener at run time (tests, notebooks); entry points are the packaged way."""
    _REGISTERED[scheme] = opener


def _entry_point_targets() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_schemes() -> list[str]:
    return sorted(set(_BUILTIN) | set(_entry_point_targets()) | set(_REGISTERED))


def _load(target: str) -> Callable[..., Any]:
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


async def open_backend(url: str, **kwargs: Any) -> RolloutBackend:
    """Open a backend by URL, e.g. ``open_backend("sglang://127.0.0.1:30000")``.

    Raises ``InvalidRequest`` (field ``url``) for a malformed URL or unknown scheme, and
    whatever the adapter raises while connecting (``BackendUnavailable``, ...).
    """
    if not isinstance(url, str) or "://" not in url:
        raise InvalidRequest("url", f"expected '<scheme>://...', got {url!r}")
    scheme = url.split("://", 1)[0].lower()
    opener: Callable[..., Any] | None = _REGISTERED.get(scheme)
    if opener is None:
        target = _entry_point_targets().get(scheme) or _BUILTIN.get(scheme)
        if target is None:
            raise InvalidRequest("url", f"unknown backend scheme {scheme!r} (known: {available_schemes()})")
        try:
            opener = _load(target)
        except ImportError as exc:
            raise Unsupported(f"backend.{scheme}", f"adapter not importable: {exc}") from exc
    result = opener(url, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result  # type: ignore[no-any-return]
