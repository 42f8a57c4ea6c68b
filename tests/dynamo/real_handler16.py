"""ai-dynamo 1.6.x's real ``BaseWorkerHandler`` engine routes, stock and under the shim, with SGLang
stubbed out and a real runtime under file discovery.

``python -m tests.dynamo.real_handler16`` (with ``DYN_FILE_KV`` set) prints one JSON object: for
the stock handler and then the shim's (patches 5 and 9 applied to the same class), what each engine
route a paused weight update and an abort-all send answered, and how many instances file discovery
held after it. Run in a subprocess (``test_sglang_shim.py``): the import hook that stubs SGLang
(and the image/tensor libraries 1.6.1's handler package imports) must not leak into other tests.

The engine routes, their discovery sync and the route wrapper are 1.6.1's own code; the endpoint
is a real ``DistributedRuntime``'s. The fake tokenizer manager pauses and resumes as SGLang 0.5.16's
does (``is_pause``), and its synchronous ``abort_request`` asks for the thread's event loop, as
SGLang 0.5.16's does when it sends the abort over its ``zmq.asyncio`` socket.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import types
from typing import Any

from .real_handler import _StubSGLang

#: What 1.6.1's ``dynamo.sglang`` imports that this CPU venv does not carry.
_STUBBED = ("sglang", "PIL", "torch", "transformers", "numpy", "redis")
#: The launcher's allowlist (``_commands.SGLANG_ENGINE_ROUTES_ENV``), the part these steps use.
_CONFIGURED_ROUTES = ["flush_cache", "abort_request:tm"]


class TokenizerManager:
    def __init__(self) -> None:
        self.is_pause = False
        self.calls: list[str] = []

    async def pause_generation(self, mode: str = "abort") -> None:
        self.is_pause = True
        self.calls.append(f"pause:{mode}")

    async def continue_generation(self) -> None:
        self.is_pause = False
        self.calls.append("continue")

    async def release_memory_occupation(self, tags: Any = None) -> None:
        self.calls.append("release")

    async def resume_memory_occupation(self, tags: Any = None) -> None:
        self.calls.append("resume")

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        asyncio.get_event_loop()  # SGLang 0.5.16: the zmq.asyncio send needs the thread's loop
        self.calls.append(f"abort:{rid}:{abort_all}")


class Engine:
    def __init__(self) -> None:
        self.tokenizer_manager = TokenizerManager()
        self.loop = None

    async def async_generate(self, **kwargs: Any) -> Any:
        yield {}

    def flush_cache(self) -> dict[str, Any]:
        self.tokenizer_manager.calls.append("flush")
        return {"success": True}


class Routes:
    """The ``register_engine_route`` side of a runtime: keeps what the handler registers."""

    def __init__(self) -> None:
        self.routes: dict[str, Any] = {}

    def register_engine_route(self, path: str, fn: Any) -> None:
        self.routes[path] = fn


def _instances(kv: str) -> int:
    d = os.path.join(kv, "v1", "instances")
    return len(os.listdir(d)) if os.path.isdir(d) else 0


async def _steps(handler_cls: type, kv: str, endpoint: Any) -> dict[str, Any]:
    config = types.SimpleNamespace(
        serving_mode=None,
        server_args=types.SimpleNamespace(),
        dynamo_args=types.SimpleNamespace(use_sglang_tokenizer=False, engine_routes=_CONFIGURED_ROUTES),
    )
    handler = handler_cls(Engine(), config, generate_endpoint=endpoint)
    runtime = Routes()
    handler.register_engine_routes(runtime)
    answered: list[list[Any]] = []
    update: list[tuple[str, dict[str, Any]]] = [
        ("pause_generation", {"mode": "retract"}),
        ("flush_cache", {}),
        ("continue_generation", {}),
    ]
    # Two paused updates (the second after a resume), then an abort-all each way.
    calls = [*update, *update, ("abort_request", {"abort_all": True}), ("rollout/abort", {"abort_all": True})]
    for path, body in calls:
        if path not in runtime.routes:
            continue
        try:
            await runtime.routes[path](body)
            answered.append([path, "ok", _instances(kv)])
        except Exception as exc:  # what the route's caller would get as HTTP 500
            answered.append([path, f"{type(exc).__name__}: {exc}", _instances(kv)])
    return {"answered": answered, "engine": handler.engine.tokenizer_manager.calls}


async def main() -> None:
    sys.meta_path.insert(0, _StubSGLang(_STUBBED, dataclasses=True))
    from dynamo.runtime import DistributedRuntime
    from dynamo.sglang.request_handlers.handler_base import BaseWorkerHandler

    from rollout_backends.adapters.dynamo._sglang_shim import patch_discovery_sync, patch_routes

    class Handler(BaseWorkerHandler):  # type: ignore[misc]
        async def generate(self, request: Any, context: Any) -> Any:
            yield {}

    kv = os.environ["DYN_FILE_KV"]
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint("ns.backend.generate")

    async def serve(request: Any, context: Any = None) -> Any:
        yield {}

    serving = asyncio.ensure_future(endpoint.serve_endpoint(serve))
    await asyncio.sleep(1.0)
    out: dict[str, Any] = {"instances_at_start": _instances(kv)}
    out["stock"] = await _steps(Handler, kv, endpoint)
    patch_discovery_sync(BaseWorkerHandler)
    patch_routes(BaseWorkerHandler)
    out["shim"] = await _steps(Handler, kv, endpoint)
    print(json.dumps(out), flush=True)
    runtime.shutdown()
    serving.cancel()


if __name__ == "__main__":
    asyncio.run(main())
