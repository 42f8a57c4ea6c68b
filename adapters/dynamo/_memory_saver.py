"""Whether a Dynamo fleet's SGLang engines run with ``--enable-memory-saver``, asked of the workers.

Without the memory saver SGLang 0.5.16 answers ``release_memory_occupation`` with success and frees
nothing (its no-op memory-saver adapter), so ``Capabilities.memory_release`` follows what the
workers say; ``connect(memory_saver=None)`` (the default) asks them here, once per worker:

* ``rollout`` (our worker), ``sglang14`` and ``sglang14-shim`` (ai-dynamo 1.4.x with
  ``--enable-rl``): ``POST /engine/call_tokenizer_manager {"method": "get_internal_state"}``.
  ai-dynamo 1.4.2's ``RLMixin.call_tokenizer_manager``
  (``dynamo/sglang/request_handlers/handler_base.py``) calls
  ``engine.tokenizer_manager.<method>(*args, **kwargs)`` and passes the result through
  ``_normalize_result``, which turns a list into ``{"result": [...]}``. SGLang 0.5.16's
  ``TokenizerControlMixin.get_internal_state`` (``sglang/srt/managers/tokenizer_control_mixin.py``)
  returns one ``internal_state`` per DP rank, and ``Scheduler.get_internal_state``
  (``sglang/srt/managers/scheduler.py``) builds each from ``vars(get_server_args())`` (plus load
  figures): ``enable_memory_saver`` is one of its keys (``/server_info`` merges the same states
  with the server args: ``sglang/srt/entrypoints/http_server.py``). Our worker answers the same
  shape (``_worker.py``); the shim's control-results patch leaves lists alone.
* ``sglang16-shim``: the shim's ``rollout/server_args`` (SGLang's resolved ``ServerArgs``,
  ``enable_memory_saver`` among them).
* ``sglang16`` (stock 1.6.x): ``call_tokenizer_manager`` is gone and no fixed engine route shows
  the server args (``docs/dynamo.md``, "ai-dynamo 1.6.1"). The one way is opt-in: a worker started
  with ``--engine-route server_info=get_server_info`` (upstream's own example of the allowlist,
  ``dynamo/sglang/engine_routes.py``) serves SGLang's ``Engine.get_server_info``
  (SGLang 0.5.16 ``sglang/srt/entrypoints/engine.py``: the server args with ``internal_states``) at
  ``server_info``, which is asked; without it the route is missing (404 "Route not found"). Not
  yet run against a real 1.6.x worker.
* ``vllm``: not asked. dynamo.vllm 1.4.2's routes (``dynamo/vllm/worker_factory.py``
  ``register_engine_routes``) show neither the engine args nor ``--enable-sleep-mode``.
* ``mocker`` / ``none``: no memory routes: nothing to ask.

Where the answer cannot be read (a route error, the key missing, no worker URLs) the value is
``DEFAULT_MEMORY_SAVER``, what ``connect`` assumed before it asked, and the note says why
(``DynamoWire.memory_saver_note``): detection never fails a connect.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from rollout_backends import RolloutBackendError
from rollout_backends.kit import HttpClient, HttpRequest, Worker

from ._wire import ROUTES, to_flavor

__all__ = ["DEFAULT_MEMORY_SAVER", "detect_memory_saver", "memory_saver_of", "memory_saver_request"]

logger = logging.getLogger("rollout_backends.dynamo")

#: What ``connect`` takes where the workers do not say (a colocated RL deployment's setting).
DEFAULT_MEMORY_SAVER = True
_TIMEOUT_S = 10.0


def memory_saver_request(flavor: str, worker: Worker) -> HttpRequest | None:
    """The call that reads ``enable_memory_saver`` from one worker; ``None`` where no route shows it."""
    routes = ROUTES[to_flavor(flavor)]
    if not routes.sglang or not worker.control_url:
        return None
    if not routes.native:  # 1.4.x (and our worker): through the tokenizer manager
        body = {"method": "get_internal_state", "args": [], "kwargs": {}}
        url = f"{worker.control_url}/engine/call_tokenizer_manager"
        return HttpRequest("POST", url, json=body, timeout=_TIMEOUT_S)
    route = "rollout/server_args" if routes.rollout_routes else "server_info"  # 1.6.x: the shim's, or allowlisted
    return HttpRequest("POST", f"{worker.control_url}/engine/{route}", json={}, timeout=_TIMEOUT_S)


def memory_saver_of(answer: Any) -> bool:
    """``enable_memory_saver`` from an answer: ``call_tokenizer_manager``'s ``{"result": [state per
    DP rank]}`` (true only where every rank says so) or a server-args object. ``ValueError`` saying
    what is missing where it does not say."""
    states = answer.get("result") if isinstance(answer, dict) and "result" in answer else [answer]
    if not isinstance(states, list) or not states:
        raise ValueError(f"no per-rank states in the answer ({str(answer)[:120]!r})")
    flags = [s.get("enable_memory_saver") if isinstance(s, dict) else None for s in states]
    if not all(isinstance(f, bool) for f in flags):
        raise ValueError(f"no enable_memory_saver in the answer ({str(answer)[:120]!r})")
    return all(flags)


async def _ask(client: HttpClient, req: HttpRequest) -> bool | str | None:
    """One worker's ``enable_memory_saver``, or why it could not be read; ``None``: no such route."""
    try:
        resp = await client.send(req)
        if resp.status == 404 and "Route not found" in resp.text:
            return None
        if not resp.ok:
            return f"HTTP {resp.status}: {resp.text[:160]}"
        return memory_saver_of(resp.json())
    except (RolloutBackendError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _not_asked(flavor: str, workers: Sequence[Worker]) -> str:
    """Why the workers' answer is not there to read."""
    routes = ROUTES[to_flavor(flavor)]
    if routes.vllm:
        return "dynamo.vllm serves no route that shows --enable-sleep-mode"
    if not routes.sglang:
        return f"{flavor} workers serve no memory routes"
    if not workers or not all(w.control_url for w in workers):
        return "no worker control URLs to ask"
    missing = f"{flavor} workers serve no route that shows SGLang's server args"
    return f"{missing} (none allowlisted as server_info)" if routes.native and not routes.rollout_routes else missing


async def detect_memory_saver(client: HttpClient, flavor: str, workers: Sequence[Worker]) -> tuple[bool, str, str]:
    """``(memory_saver, source, note)`` for the fleet: read from every worker (``False`` if any says
    so), else ``DEFAULT_MEMORY_SAVER`` with the reason in the note. Never raises (but for an unknown
    flavor: ``InvalidRequest``, as ``connect`` refuses it)."""
    reqs = [memory_saver_request(flavor, w) for w in workers]
    if not workers or any(r is None for r in reqs):  # no SGLang routes, or no worker URLs
        return DEFAULT_MEMORY_SAVER, "default", f"assumed {DEFAULT_MEMORY_SAVER}: {_not_asked(flavor, workers)}"
    said = await asyncio.gather(*(_ask(client, r) for r in reqs if r is not None))
    off = [w.id for w, s in zip(workers, said, strict=True) if s is False]
    if off:
        return False, "workers", f"enable_memory_saver is off on {', '.join(off)}"
    if all(s is True for s in said):
        return True, "workers", "enable_memory_saver is on on every worker"
    if all(s is None for s in said):
        return DEFAULT_MEMORY_SAVER, "default", f"assumed {DEFAULT_MEMORY_SAVER}: {_not_asked(flavor, workers)}"
    unread = {w.id: "no such route" if s is None else s for w, s in zip(workers, said, strict=True) if s is not True}
    why = "; ".join(f"{w}: {s}" for w, s in unread.items())
    logger.warning("cannot read enable_memory_saver (%s): memory_release assumed %s", why, DEFAULT_MEMORY_SAVER)
    return DEFAULT_MEMORY_SAVER, "default", f"assumed {DEFAULT_MEMORY_SAVER}: not read ({why})"
