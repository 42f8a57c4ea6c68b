"""CLI: ``rollout-backends facade --backend URL --host 127.0.0.1 --port P``.

Serves the SGLang-compatible facade over the backend at ``URL`` until SIGINT/SIGTERM, then closes
the backend. Give Miles ``--sglang-router-ip <host> --sglang-router-port <P>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from rollout_backends import InvalidRequest, RolloutBackendError, open_backend
from rollout_backends.launch import HelpFormatter
from rollout_backends.sglang_native import UnknownKeys

from ._chat_parsers import ChatParsing
from ._facade import MilesFacade, start_facade

__all__ = ["build_parser", "load_tokenizer", "main", "serve"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollout-backends facade",
        description="SGLang-compatible router facade for Miles over any rollout backend.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--backend", required=True, help="backend URL: sglang://..., dynamo://..., reference://...")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=30000, help="0 = any free port (printed at start)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="Hugging Face tokenizer (path or name) to produce the text and the chat content; Miles' reward "
        "functions and its resume of aborted samples read them (default: --model-path, as SGLang's "
        "--tokenizer-path; with neither the facade refuses to start unless --token-only)",
    )
    p.add_argument("--model-path", default=None, help="reported by /model_info (default: --tokenizer)")
    p.add_argument(
        "--token-only",
        action="store_true",
        help="start without a tokenizer: answers carry token ids and empty text (default: off)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="SGLang's tool-call parser name (qwen25, llama3, mistral, deepseekv3, glm45, kimi_k2, ...): chat "
        "answers carry tool_calls and finish 'tool_calls', parsed by SGLang's own code (extra sglang-parsers; "
        "default: none)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        help="SGLang's reasoning parser name (deepseek-r1, qwen3, glm45, kimi, ...): chat answers carry "
        "reasoning_content (default: none)",
    )
    p.add_argument("--served-model-name", default=None, help="the model name it reports (default: the model path)")
    p.add_argument("--public-url", default=None, help="base URL workers are listed under (default: request Host)")
    p.add_argument(
        "--worker-port-base",
        type=int,
        default=None,
        help="also serve worker i's SGLang surface at the root of port BASE+i (0: free ports; for "
        "--rollout-external; default: off)",
    )
    p.add_argument(
        "--server-info",
        type=json.loads,
        default={},
        help="JSON object merged into /get_server_info (e.g. the fields Miles' --rollout-external check "
        "compares; default: {})",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("RB_FACADE_API_KEY"),
        help="require this bearer key on every route but /health* (default: $RB_FACADE_API_KEY; prefer the "
        "variable: a flag shows in process listings)",
    )
    p.add_argument(
        "--admin-api-key",
        default=os.environ.get("RB_FACADE_ADMIN_API_KEY"),
        help="require this key (only) on control routes (default: $RB_FACADE_ADMIN_API_KEY)",
    )
    p.add_argument(
        "--ignore-unknown-keys",
        action="store_true",
        help="drop unknown top-level /generate keys, as stock SGLang does (default: refuse them with a 400 "
        "naming the key)",
    )
    p.add_argument(
        "--strict-chat-keys",
        action="store_true",
        help="refuse unknown /v1/chat/completions keys with a 400 naming the key (default: drop them, as SGLang's "
        "ChatCompletionRequest does)",
    )
    p.add_argument("--wait-ready", type=float, default=600.0, help="seconds to wait for the fleet (0: do not)")
    p.add_argument("--log-level", default="INFO", help="logging level")
    return p


def load_tokenizer(name: str | None) -> Any:
    if not name:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, trust_remote_code=True)


def tokenizer_name(ns: argparse.Namespace) -> str | None:
    """``--tokenizer``, else ``--model-path`` (SGLang's ``--tokenizer-path`` default); neither is
    refused unless ``--token-only``: the answers would carry empty text."""
    name: str | None = ns.tokenizer or ns.model_path
    if name is None and not getattr(ns, "token_only", False):
        raise InvalidRequest(
            "--tokenizer",
            "without a tokenizer the facade answers empty text (Miles' rewards and its resume of aborted "
            "samples read it): pass --tokenizer (or --model-path), or --token-only for token-id clients",
        )
    return name


async def serve(
    ns: argparse.Namespace, *, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> list[str]:
    """Serve until SIGINT/SIGTERM (or ``stop``); returns the lines it printed."""
    tokenizer = load_tokenizer(tokenizer_name(ns))
    # Parser names are checked before the fleet is opened (MilesFacade checks them again).
    ChatParsing.for_flags(getattr(ns, "tool_call_parser", None), getattr(ns, "reasoning_parser", None), tokenizer)
    backend = await open_backend(ns.backend)
    try:
        if ns.wait_ready > 0:
            await backend.wait_ready(ns.wait_ready)
        facade = MilesFacade(
            backend,
            tokenizer=tokenizer,
            model_path=ns.model_path or ns.tokenizer,
            served_model_name=ns.served_model_name,
            public_url=ns.public_url,
            server_info=ns.server_info,
            api_key=getattr(ns, "api_key", None),
            admin_api_key=getattr(ns, "admin_api_key", None),
            unknown_keys=UnknownKeys.IGNORE if getattr(ns, "ignore_unknown_keys", False) else UnknownKeys.REFUSE,
            chat_unknown_keys=UnknownKeys.REFUSE if getattr(ns, "strict_chat_keys", False) else UnknownKeys.IGNORE,
            tool_call_parser=getattr(ns, "tool_call_parser", None),
            reasoning_parser=getattr(ns, "reasoning_parser", None),
            token_only=getattr(ns, "token_only", False),
        )
        ports = None
        if ns.worker_port_base is not None:
            base = ns.worker_port_base
            ports = {w: base + i if base else 0 for i, w in enumerate(backend.workers)}
        running = await start_facade(facade, host=ns.host, port=ns.port, worker_ports=ports)
        lines = [f"facade: {running.url} over {ns.backend} (workers: {', '.join(backend.workers)})"]
        lines += [f"facade: worker {w} at {url}" for w, url in running.worker_urls.items()]
        lines.append(f"miles flags: --sglang-router-ip {running.host} --sglang-router-port {running.port}")
        try:
            for line in lines:
                print(line, flush=True)
            stop = stop or asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, stop.set)
            if ready is not None:
                ready.set()
            await stop.wait()
        finally:
            await running.stop()
    finally:
        await backend.aclose()
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    from rollout_backends import BackendUnavailable
    from rollout_backends.launch import port_in_use

    if ns.port and port_in_use(ns.host, ns.port):  # before waiting for the fleet, not after
        raise BackendUnavailable(f"port {ns.host}:{ns.port} is already in use; nothing was started")
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(ns))
    except RolloutBackendError as exc:  # a refusal to start is one line naming the flag, not a traceback
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
