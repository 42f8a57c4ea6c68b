#!/usr/bin/env python
"""Bring up (or connect to) a Dynamo fleet, serve the Miles facade over it, print the Miles flags.

    # connect to a running Dynamo frontend (the common case)
    python examples/miles/launch_dynamo_fleet.py --rollout-backend-url dynamo://127.0.0.1:8000 \\
        --tokenizer Qwen/Qwen2.5-0.5B-Instruct --port 30000

    # launch the fleet too, where the Dynamo adapter provides a launcher
    python examples/miles/launch_dynamo_fleet.py --model Qwen/Qwen2.5-0.5B-Instruct --workers 2 --tp 2 \\
        --dynamo-router-mode kv --dynamo-page-size 64 --dynamo-stream-interval 50 --port 30000

The Dynamo knobs are the same flags the custom generate function adds to Miles (``--dynamo-*``) and
travel in the ``dynamo://`` URL's query. Any backend URL works (``sglang://``, ``reference://``).
Runs until SIGINT/SIGTERM, then stops the facade and closes (or stops) the fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import signal
import sys
from collections.abc import Sequence
from typing import Any

import rollout_backends as rb
from rollout_backends.integrations.miles import MilesFacade, add_arguments, backend_url, start_facade

GENERATE_PATH = "rollout_backends.integrations.miles.generate"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)  # --rollout-backend, --rollout-backend-url, --dynamo-*
    p.set_defaults(rollout_backend="dynamo")
    p.add_argument("--frontend", default="127.0.0.1:8000", help="Dynamo frontend host:port (without a URL)")
    p.add_argument("--model", default=None, help="launch a fleet of this model (needs the Dynamo launcher)")
    p.add_argument("--workers", type=int, default=2, help="engines to launch (with --model)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size per engine (with --model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer for the facade's text (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="facade host (0.0.0.0 to serve other hosts)")
    p.add_argument("--port", type=int, default=30000, help="facade port (0 = any free port)")
    p.add_argument("--public-host", default=None, help="host Miles reaches the facade at (default: --host)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    return p


async def open_fleet(ns: argparse.Namespace) -> rb.RolloutBackend:
    if ns.model is None:
        if not ns.rollout_backend_url:
            host, _, port = ns.frontend.rpartition(":")
            ns.sglang_router_ip, ns.sglang_router_port = host, int(port)
        return await rb.open_backend(backend_url(ns))
    dynamo: Any = importlib.import_module("rollout_backends.adapters.dynamo")
    launch = getattr(dynamo, "launch_fleet", None)
    if launch is None:
        raise SystemExit(
            "this rollout-backends has no Dynamo launcher yet (rollout_backends.adapters.dynamo.launch_fleet): "
            "start the Dynamo frontend and workers yourself (see docs/miles.md) and pass --rollout-backend-url"
        )
    knobs = {k: getattr(ns, k) for k in vars(ns) if k.startswith("dynamo_") and getattr(ns, k) not in (None, False)}
    result = launch(model=ns.model, workers=ns.workers, tp=ns.tp, **knobs)
    return await result if asyncio.iscoroutine(result) else result  # type: ignore[no-any-return]


def miles_flags(facade_host: str, facade_port: int, url: str) -> list[str]:
    return [
        "# stock Miles, data plane through the facade:",
        f"--sglang-router-ip {facade_host} --sglang-router-port {facade_port}",
        "# or the custom generate function (no facade needed for generation):",
        f"--custom-generate-function-path {GENERATE_PATH} --rollout-backend-url {url}",
    ]


async def run(ns: argparse.Namespace, *, stop: asyncio.Event | None = None) -> None:
    backend = await open_fleet(ns)
    try:
        report = await backend.wait_ready(ns.ready_timeout)
        tokenizer = None
        if ns.tokenizer or ns.model:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(ns.tokenizer or ns.model, trust_remote_code=True)
        facade = MilesFacade(backend, tokenizer=tokenizer, model_path=ns.tokenizer or ns.model)
        running = await start_facade(facade, host=ns.host, port=ns.port)
        try:
            url = ns.rollout_backend_url or backend_url(ns)
            print(f"fleet ready: {len(report.workers)} worker(s): {', '.join(backend.workers)}", flush=True)
            print(f"facade: {running.url}", flush=True)
            for line in miles_flags(ns.public_host or running.host, running.port, url):
                print(line, flush=True)
            stop = stop or asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, stop.set)
            await stop.wait()
        finally:
            await running.stop()
    finally:
        await backend.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    asyncio.run(run(build_parser().parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
