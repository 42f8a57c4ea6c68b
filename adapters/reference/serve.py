"""Command line: serve the CPU reference engine over SGLang's native HTTP API.

    rollout-backends serve-reference --model-path DIR --host 127.0.0.1 --port P \
        [--worker-id W] [--weight-version v0] [--api-key K] [--admin-api-key K] [--page-size 16] \
        [--with-begin-end] [--make-model SEED] [--fault-injection]
    rollout-backends serve-reference --no-compute 8 --port P

--make-model SEED first writes a tiny seeded model to --model-path (if it has no config.json).
Keys given on the command line are never printed. Generation is served streamed ("stream": true,
as SGLang streams) or not. --fault-injection (tests only, never on by default) adds /_faults,
which arms one-shot failures on any route.

--no-compute N serves the same server with no model and no torch: every generation answers
min(N, max_new_tokens) fixed tokens with logprobs at once (client-overhead benchmarks).
--model-path is then only the name the server reports.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout_backends.launch import HelpFormatter

__all__ = ["build_parser", "load_engine", "main", "parse_args"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-backends serve-reference", description=__doc__,
                                formatter_class=HelpFormatter)  # fmt: skip
    p.add_argument(
        "--model-path",
        default=None,
        help="the model to load (required; with --no-compute only the name it reports, default: no-compute)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=30000, help="HTTP port")
    p.add_argument("--worker-id", default=None, help="the id answers name (default: host:port)")
    p.add_argument("--weight-version", default="default", help="the weight version it starts with")
    p.add_argument("--served-model-name", default=None, help="the model name it reports (default: the model path)")
    p.add_argument("--api-key", default=os.environ.get("SGLANG_API_KEY"),
                   help="bearer key of every route (default: $SGLANG_API_KEY, else none)")  # fmt: skip
    p.add_argument("--admin-api-key", default=None, help="key of the control routes (default: none)")
    p.add_argument("--page-size", type=int, default=16, help="KV page size (tokens) of the prefix index")
    p.add_argument("--with-begin-end", action="store_true", help="serve /begin_weight_update and /end_weight_update")
    p.add_argument("--sglang-version", default=None, help="the version /server_info reports (default: ours)")
    p.add_argument("--make-model", type=int, default=None, metavar="SEED",
                   help="write a tiny model to --model-path first (default: load what is there)")  # fmt: skip
    p.add_argument("--model-size", default="tiny", help="preset for --make-model")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads of the engine")
    p.add_argument("--log-level", default="info", help="logging level")
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="token ids only, as SGLang's flag: no text in answers, no text prompts (default: the model's "
        "tokenizer.json, where there is one)",
    )
    p.add_argument(
        "--ignore-unknown-keys",
        action="store_true",
        help="drop unknown top-level /generate keys, as stock SGLang does (default: refuse them with a 400 naming "
        "the key)",
    )
    p.add_argument(
        "--fault-injection",
        action="store_true",
        help="TEST ONLY: serve POST /_faults, which arms one-shot failures on any route (admin key applies)",
    )
    p.add_argument(
        "--engine-factory",
        default=None,
        metavar="MODULE:CALLABLE",
        help="build the engine with CALLABLE(args) instead of ReferenceEngine (tests; default: ReferenceEngine)",
    )
    p.add_argument(
        "--no-compute",
        type=int,
        default=None,
        metavar="N",
        help="no model: answer min(N, max_new_tokens) fixed tokens with logprobs at once (benchmarks; default: off)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.no_compute is not None:
        if args.no_compute < 1:
            p.error(f"--no-compute: must be >= 1, got {args.no_compute}")
        if args.engine_factory or args.make_model is not None:
            p.error("--no-compute builds its own engine: it excludes --engine-factory and --make-model")
        args.model_path = args.model_path or "no-compute"
    elif args.model_path is None:
        p.error("--model-path is required (unless --no-compute)")
    return args


def load_engine(args: argparse.Namespace) -> Any:
    """Build the ``ReferenceEngine`` for ``args`` (imports torch), or call ``--engine-factory``, or
    build the ``NoComputeEngine`` of ``--no-compute`` (no torch)."""
    worker_id = args.worker_id or f"{args.host}:{args.port}"
    if args.no_compute is not None:
        from ._no_compute import NoComputeEngine

        return NoComputeEngine(args.no_compute, worker_id=worker_id, weight_version=args.weight_version)
    if args.engine_factory:
        import importlib

        module, _, attr = args.engine_factory.partition(":")
        return getattr(importlib.import_module(module), attr)(args)
    from ._engine import ReferenceEngine

    kw: dict[str, Any] = {
        "worker_id": worker_id,
        "weight_version": args.weight_version,
        "page_size": args.page_size,
    }
    if args.num_threads != 1:
        kw["num_threads"] = args.num_threads
    return ReferenceEngine(args.model_path, **kw)


async def _serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    from rollout_backends.sglang_native import UnknownKeys

    from ._server import build_app

    engine = load_engine(args)
    start = getattr(engine, "start", None)
    if start is not None:
        res = start()
        if asyncio.iscoroutine(res):
            await res
    app = build_app(
        engine,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        with_begin_end=args.with_begin_end,
        page_size=args.page_size,
        sglang_version=args.sglang_version,
        host=args.host,
        port=args.port,
        fault_injection=args.fault_injection,
        skip_tokenizer_init=args.skip_tokenizer_init,
        unknown_keys=UnknownKeys.IGNORE if args.ignore_unknown_keys else UnknownKeys.REFUSE,
    )
    runner = web.AppRunner(app, access_log=None, handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logging.getLogger("rollout_backends.reference").info(
        "serving %s (worker %s, weight_version %s) on http://%s:%d",
        args.model_path, engine.worker_id, engine.weight_version, args.host, args.port,
    )  # fmt: skip
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        close = getattr(engine, "aclose", None) or getattr(engine, "close", None)
        if close is not None:
            res = close()
            if asyncio.iscoroutine(res):
                await res


def _preflight(args: argparse.Namespace) -> None:
    """What fails before the model loads (seconds): a port already bound, a model that is not a
    directory here (``InvalidRequest``; nothing is fetched, so a Hugging Face name is refused at once)."""
    from rollout_backends import BackendUnavailable
    from rollout_backends.launch import port_in_use, require_model_dir

    if args.port and port_in_use(args.host, args.port):
        raise BackendUnavailable(f"port {args.host}:{args.port} is already in use; nothing was started")
    if args.no_compute is None and args.engine_factory is None and args.make_model is None:
        require_model_dir(args.model_path, "--model-path")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _preflight(args)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    if args.make_model is not None and not (Path(args.model_path) / "config.json").exists():
        from ._model import make_tiny_model

        make_tiny_model(args.model_path, seed=args.make_model, size=args.model_size)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
