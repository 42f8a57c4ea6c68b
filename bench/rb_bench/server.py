"""A trivial SGLang-shaped HTTP/1.1 server for client-overhead benchmarks (loopback only).

Run in its own process so that the client's CPU is measured alone::

    python -m rb_bench.server --port 0

It prints ``PORT <n>`` once listening and exits when its standard input closes (so it never
outlives the benchmark that started it). Every route answers a fixed body:

* ``POST /generate``: an SGLang native answer with 8 output tokens and their logprobs;
* ``GET /model_info``, ``/server_info``, ``/openapi.json``, ``/health``: enough for ``connect()``;
* ``GET /_cpu``: this process's CPU seconds (``time.process_time()``), for the benchmark's report;
* anything else: 404.

A raw ``asyncio.Protocol`` (not aiohttp.web) keeps the server's own CPU per request small: on a
2-core machine the server and the client share the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

__all__ = ["GENERATE_BODY", "OUTPUT_TOKENS", "main", "serve"]

OUTPUT_TOKENS = 8

GENERATE_BODY: dict[str, object] = {
    "text": " the quick brown fox jumps over the",
    "output_ids": [279, 4062, 14198, 39935, 35308, 927, 279, 16053][:OUTPUT_TOKENS],
    "meta_info": {
        "id": "bench",
        "finish_reason": {"type": "length", "length": OUTPUT_TOKENS},
        "prompt_tokens": 128,
        "weight_version": "default",
        "completion_tokens": OUTPUT_TOKENS,
        "cached_tokens": 0,
        "output_token_logprobs": [
            [-0.0123 - i / 100, t, None]
            for i, t in enumerate([279, 4062, 14198, 39935, 35308, 927, 279, 16053][:OUTPUT_TOKENS])
        ],
        "e2e_latency": 0.0123,
    },
}

_JSON_ROUTES: dict[bytes, object] = {
    b"/model_info": {"model_path": "bench/fake", "is_generation": True, "weight_version": "default"},
    b"/server_info": {"context_length": 32768, "enable_memory_saver": False},
    b"/openapi.json": {"paths": {"/generate": {}, "/health": {}, "/model_info": {}, "/server_info": {}}},
}


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 "
        + status.encode()
        + b"\r\nContent-Type: "
        + content_type
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


_GENERATE = _response("200 OK", json.dumps(GENERATE_BODY, separators=(",", ":")).encode())
_FIXED = {path: _response("200 OK", json.dumps(v).encode()) for path, v in _JSON_ROUTES.items()}
_FIXED[b"/health"] = _response("200 OK", b"", b"text/plain")
_NOT_FOUND = _response("404 Not Found", b'{"detail":"Not Found"}')


class _Http(asyncio.Protocol):
    __slots__ = ("buf", "transport")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        out = []
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = bytes(buf[:end])
            length = 0
            i = head.lower().find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17 : j if j >= 0 else len(head)])
            total = end + 4 + length
            if len(buf) < total:
                break
            del buf[:total]
            sp = head.find(b" ")
            path = head[sp + 1 : head.find(b" ", sp + 1)]
            if path == b"/generate":
                out.append(_GENERATE)
            elif path == b"/_cpu":
                out.append(_response("200 OK", json.dumps({"cpu_s": time.process_time()}).encode()))
            else:
                out.append(_FIXED.get(path, _NOT_FOUND))
        if out and self.transport is not None:
            self.transport.write(b"".join(out))


async def serve(host: str = "127.0.0.1", port: int = 0) -> asyncio.base_events.Server:
    loop = asyncio.get_running_loop()
    return await loop.create_server(_Http, host, port, backlog=2048, reuse_address=True)


async def _main(port: int) -> None:
    server = await serve("127.0.0.1", port)
    bound = server.sockets[0].getsockname()[1]
    print(f"PORT {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def watch_stdin() -> None:  # the parent closes our stdin (or dies): stop
        try:
            sys.stdin.buffer.read()
        finally:
            loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=watch_stdin, daemon=True).start()
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--uvloop", action="store_true", help="serve on uvloop if it is installed")
    args = p.parse_args(argv)
    if args.uvloop:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
    asyncio.run(_main(args.port))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
