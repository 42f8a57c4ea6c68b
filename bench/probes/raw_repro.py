"""Dynamo's own per-chunk CPU, reproduced without rollout-backends (only ai-dynamo + aiohttp).

    python bench/probes/raw_repro.py --worker mocker                  # dynamo.mocker
    python bench/probes/raw_repro.py --worker python --chunk 1        # a stock 30-line Python worker, 1 token per chunk
    python bench/probes/raw_repro.py --worker python --chunk 50       # the same worker, 50 tokens per chunk
    python bench/probes/raw_repro.py --worker python --chunk 1 --push # 1.6.x: the same worker on Dynamo's push egress

Starts ``python -m dynamo.frontend`` (round-robin, file discovery, TCP request plane, ZMQ event
plane: stock flags, none of ours) and one worker, then POSTs a plain OpenAI ``/v1/completions``
body (token-id prompt, ``max_tokens``, ``ignore_eos``, ``stream: false``: no nvext, no logprobs)
``--requests`` times, ``--concurrency`` at a time, and prints CPU µs per request and per token of
the frontend and the worker from ``/proc/<pid>/stat`` (utime+stime). ``--model-path`` is any
folder with ``config.json`` and ``tokenizer.json`` (default: rollout-backends' cached tiny model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    v = s[s.rfind(")") + 2 :].split()
    return (int(v[11]) + int(v[12]) + int(v[13]) + int(v[14])) / TICK


def free_port(below: int | None = None) -> int:
    if below is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for port in range(20000 + os.getpid() % 5000, below):  # ephemeral ports start above 32767
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


async def serve_worker(a: argparse.Namespace) -> None:
    """A minimal token-in/token-out Dynamo worker: ``--chunk`` tokens per yielded chunk."""
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    ep = rt.endpoint(f"{a.namespace}.backend.generate")
    k = a.chunk

    async def chunks(request: dict) -> object:
        n = int(request["stop_conditions"]["max_tokens"])
        for i in range(0, n, k):
            c = {"token_ids": [(1000 + 7 * j) % 512 for j in range(i, min(n, i + k))], "index": 0}
            if i + k >= n:
                c["finish_reason"] = "length"
                c["completion_usage"] = {
                    "prompt_tokens": len(request["token_ids"]),
                    "completion_tokens": n,
                    "total_tokens": len(request["token_ids"]) + n,
                }
            yield c

    async def generate(request: dict, context: object = None) -> object:  # pull egress: Dynamo polls each chunk
        async for c in chunks(request):
            yield c

    def generate_push(request: dict, context: object = None, response_sender: object = None) -> object:
        if response_sender is None:
            return generate(request, context)

        async def drive() -> object:
            async for c in chunks(request):
                response_sender.send(c)  # type: ignore[attr-defined]
            response_sender.close()  # type: ignore[attr-defined]
            if False:
                yield

        return drive()

    await asyncio.gather(
        ep.serve_endpoint(generate_push if a.push else generate),
        register_model(
            ModelInput.Tokens,
            ModelType.Completions,
            ep,
            a.model_path,
            Path(a.model_path).name,
            worker_type=WorkerType.Aggregated,
            kv_cache_block_size=16,
        ),
    )


async def bench(a: argparse.Namespace) -> None:
    import aiohttp

    run = Path(tempfile.mkdtemp(prefix="dyn-repro-"))
    (run / "kv").mkdir()
    env = {
        **os.environ,
        "DYN_FILE_KV": str(run / "kv"),
        "DYN_NAMESPACE": a.namespace,
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "lo",
        "DYN_SYSTEM_HOST": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("DYN_SYSTEM_PORT", None)
    planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    port = free_port()
    if a.worker == "mocker":
        wargv = [
            sys.executable,
            "-m",
            "dynamo.mocker",
            "--engine-type",
            "sglang",
            "--model-path",
            a.model_path,
            "--model-name",
            Path(a.model_path).name,
            "--endpoint",
            f"dyn://{a.namespace}.backend.generate",
            "--speedup-ratio",
            "1e6",
            *planes,
        ]
    else:
        wargv = [
            sys.executable,
            __file__,
            "--serve-worker",
            "--chunk",
            str(a.chunk),
            "--namespace",
            a.namespace,
            "--model-path",
            a.model_path,
        ] + (["--push"] if a.push else [])
    fargv = [
        sys.executable,
        "-m",
        "dynamo.frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(port),
        "--namespace",
        a.namespace,
        "--router-mode",
        "round-robin",
        *planes,
    ]
    log = open(run / "log.txt", "wb")  # noqa: SIM115 - the children's log, open while they run
    # The worker's system port (below 32768: 1.4.2 reads it as an i16); without it the mocker's
    # model card is not self-hosted and the frontend looks the model up on the HF hub instead.
    wenv = {**env, "DYN_SYSTEM_PORT": str(free_port(below=32768))}
    procs = [
        subprocess.Popen(argv, env=e, stdout=log, stderr=log, start_new_session=True)
        for argv, e in ((wargv, wenv), (fargv, env))
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            for _ in range(240):
                if any(p.poll() is not None for p in procs):
                    raise SystemExit(f"a process exited; see {run / 'log.txt'}")
                try:
                    async with s.get(f"{url}/v1/models") as r:
                        if r.status == 200 and (await r.json()).get("data"):
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.5)
            else:
                raise SystemExit(f"not ready; see {run / 'log.txt'}")
            body = {
                "model": Path(a.model_path).name,
                "prompt": [(17 + 31 * i) % 512 for i in range(128)],
                "max_tokens": a.tokens,
                "ignore_eos": True,
                "stream": False,
            }

            async def drive(n: int) -> None:
                it = iter(range(n))

                async def w() -> None:
                    for _ in it:
                        async with s.post(f"{url}/v1/completions", json=body) as r:
                            data = await r.json()
                            assert r.status == 200, data

                await asyncio.gather(*(w() for _ in range(a.concurrency)))

            await drive(a.concurrency)  # warm-up
            for rnd in range(a.rounds):
                c0 = [cpu(p.pid) for p in procs]
                t0 = time.perf_counter()
                await drive(a.requests)
                wall = time.perf_counter() - t0
                c1 = [cpu(p.pid) for p in procs]
                w, f = ((c1[i] - c0[i]) * 1e6 / a.requests for i in (0, 1))
                print(
                    json.dumps(
                        {
                            "round": rnd,
                            "worker": a.worker,
                            "chunk": a.chunk,
                            "push": a.push,
                            "tokens": a.tokens,
                            "wall_s": round(wall, 3),
                            "frontend_us_per_req": round(f),
                            "worker_us_per_req": round(w),
                            "frontend_us_per_token": round(f / a.tokens, 2),
                            "worker_us_per_token": round(w / a.tokens, 2),
                        }
                    )
                )
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["mocker", "python"], default="python")
    p.add_argument("--chunk", type=int, default=1)
    p.add_argument("--push", action="store_true", help="ai-dynamo 1.6.x push egress (response_sender)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model-path", default=str(Path.home() / ".cache/rollout-backends/models/tiny-seed0"))
    p.add_argument("--namespace", default=f"repro{os.getpid()}")
    p.add_argument("--serve-worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    asyncio.run(serve_worker(a) if a.serve_worker else bench(a))


if __name__ == "__main__":
    main()
