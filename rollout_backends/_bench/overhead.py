"""Client overhead: what our SGLang adapter costs per ``/generate`` next to raw HTTP clients.

All clients run in this process, one after another, against one loopback server in its own
process (``rollout_backends._bench.server``), with the same request body, at each concurrency:

* ``raw aiohttp`` (the baseline): one ``ClientSession`` (``TCPConnector(limit=0)``, as ours), ``session.post(json=...)``
  then ``await resp.json()``;
* ``raw httpx``: one ``httpx.AsyncClient(timeout=None)`` with httpx's default limits;
* ``miles httpx``: Miles' pattern (``miles/utils/http_utils.py``): one shared
  ``httpx.AsyncClient(limits=httpx.Limits(max_connections=512), timeout=httpx.Timeout(None))``
  (512 = ``sglang_server_concurrency`` x one engine), ``post(json=...)``, ``raise_for_status()``,
  ``response.json()`` inside its retry loop;
* ``ours``: ``backend.generate(GenerateRequest(...))`` through ``rollout_backends.adapters.sglang.connect``
  (request validation, the wire, ``HttpClient``, response parsing into a ``Generation``);
* ``ours: HttpClient`` (diagnostic, not a target): a prebuilt ``HttpRequest`` through
  ``HttpClient.send`` and ``HttpResponse.json()``: the core's transport cost alone.

Measured per cell: requests/s (wall), client CPU microseconds per request (``time.process_time()``
of this process) and the server's CPU per request (its own ``process_time()``, read over HTTP).

Run: ``rollout-backends bench overhead`` or ``python -m benchmarks.client_overhead``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs

__all__ = ["CLIENTS", "Cell", "main", "run_benchmark"]

PROMPT_TOKENS = 128
BASELINE = "raw aiohttp"
OURS = "ours"
#: Clients in table order; the diagnostic core-only row is last.
CLIENTS = ("raw aiohttp", "raw httpx", "miles httpx", "ours", "ours: HttpClient")
TARGET_CPU_RATIO = 1.05
TIMES = "\N{MULTIPLICATION SIGN}"
TARGET_RPS_AT_64 = 5000.0


@attrs.define
class Cell:
    client: str
    concurrency: int
    requests: int
    wall_s: float
    cpu_s: float
    server_cpu_s: float
    errors: int = 0
    capped: bool = False

    @property
    def rps(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_us(self) -> float:
        return 1e6 * self.cpu_s / self.requests if self.requests else float("nan")

    @property
    def server_cpu_us(self) -> float:
        return 1e6 * self.server_cpu_s / self.requests if self.requests else float("nan")


# -- the payload ---------------------------------------------------------------------------------


def _prompt() -> tuple[int, ...]:
    return tuple((i * 7919) % 32000 for i in range(PROMPT_TOKENS))


def _sampling() -> Any:
    from rollout_backends import SamplingParams

    return SamplingParams(max_new_tokens=8, temperature=1.0)


def _payload() -> dict[str, Any]:
    """The body every raw client sends: exactly what our wire builds for the same request, as the
    plain JSON value (lists and dicts) a raw client holds (our wire keeps the ids as a tuple)."""
    from rollout_backends import GenerateRequest
    from rollout_backends.adapters.sglang import SGLangWire

    req = GenerateRequest(input_ids=_prompt(), sampling=_sampling(), request_id="0" * 32)
    body = json.loads(json.dumps(SGLangWire(entry_url="http://x").generate(req, None).json))
    assert isinstance(body, dict) and isinstance(body["input_ids"], list)
    return body


# -- clients ---------------------------------------------------------------------------------------


class _Client:
    name = ""

    async def open(self, base: str) -> None:
        raise NotImplementedError

    async def one(self) -> bool:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class RawAiohttp(_Client):
    name = "raw aiohttp"

    async def open(self, base: str) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.url = f"{base}/generate"
        self.payload = _payload()

    async def one(self) -> bool:
        async with self.session.post(self.url, json=self.payload) as resp:
            data = await resp.json()
            return resp.status == 200 and len(data["output_ids"]) == 8

    async def close(self) -> None:
        await self.session.close()


class RawHttpx(_Client):
    name = "raw httpx"

    async def open(self, base: str) -> None:
        import httpx

        self.client = httpx.AsyncClient(timeout=None)
        self.url = f"{base}/generate"
        self.payload = _payload()

    async def one(self) -> bool:
        resp = await self.client.post(self.url, json=self.payload)
        data = resp.json()
        return resp.status_code == 200 and len(data["output_ids"]) == 8

    async def close(self) -> None:
        await self.client.aclose()


class MilesHttpx(_Client):
    """``miles.utils.http_utils``: ``init_http_client`` + ``post`` -> ``_post`` (no failures here)."""

    name = "miles httpx"

    async def open(self, base: str) -> None:
        import httpx

        concurrency = 512 * 1 // 1  # sglang_server_concurrency * rollout_num_gpus // gpus_per_engine
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency), timeout=httpx.Timeout(None))
        self.url = f"{base}/generate"
        self.payload = _payload()

    async def _post(self, url: str, payload: Any, max_retries: int = 60, headers: Any = None) -> Any:
        retry_count = 0
        while retry_count < max_retries:
            try:
                response = await self.client.post(url, json=payload or {}, headers=headers)
                response.raise_for_status()
                try:
                    output = response.json()
                except json.JSONDecodeError:
                    output = response.text
            except Exception:
                retry_count += 1
                if retry_count >= max_retries:
                    raise
                await asyncio.sleep(1)
                continue
            break
        return output

    async def one(self) -> bool:
        data = await self._post(self.url, self.payload)
        return len(data["output_ids"]) == 8

    async def close(self) -> None:
        await self.client.aclose()


class Ours(_Client):
    name = "ours"

    async def open(self, base: str) -> None:
        from rollout_backends import GenerateRequest
        from rollout_backends.adapters.sglang import connect

        self.backend = await connect(base)
        self.request_type = GenerateRequest
        self.prompt = _prompt()
        self.sampling = _sampling()

    async def one(self) -> bool:
        gen = await self.backend.generate(self.request_type(input_ids=self.prompt, sampling=self.sampling))
        return len(gen.output_ids) == 8

    async def close(self) -> None:
        await self.backend.aclose()


class OursCore(_Client):
    name = "ours: HttpClient"

    async def open(self, base: str) -> None:
        from rollout_backends.kit import HttpClient, HttpRequest

        self.client = HttpClient()
        self.request = HttpRequest("POST", f"{base}/generate", json=_payload())

    async def one(self) -> bool:
        resp = await self.client.send(self.request)
        data = resp.json()
        return resp.status == 200 and len(data["output_ids"]) == 8

    async def close(self) -> None:
        await self.client.aclose()


_CLASSES: dict[str, type[_Client]] = {c.name: c for c in (RawAiohttp, RawHttpx, MilesHttpx, Ours, OursCore)}


# -- the server process ----------------------------------------------------------------------------


class ServerProcess:
    """The fake SGLang server in a child process; it exits when we close its stdin."""

    def __init__(self, *, uvloop: bool = False) -> None:
        cmd = [sys.executable, "-m", "rollout_backends._bench.server", "--port", "0"]
        if uvloop:
            cmd.append("--uvloop")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().strip()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"benchmark server did not start (said {line!r})")
        self.port = int(line.split()[1])
        self.base = f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/_cpu")
            return float(json.loads(conn.getresponse().read())["cpu_s"])
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- running ---------------------------------------------------------------------------------------


async def _drive(client: _Client, concurrency: int, count: int, deadline: float) -> tuple[int, int]:
    """``count`` requests, ``concurrency`` at a time; no new request starts after ``deadline``."""
    tickets = iter(range(count))
    done = errors = 0

    async def worker() -> None:
        nonlocal done, errors
        for _ in tickets:  # shared: the loop is bounded by ``count`` in all
            if not await client.one():
                errors += 1
            done += 1
            if time.perf_counter() > deadline:
                return

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, errors


async def _run_cells(
    server: ServerProcess,
    clients: Sequence[str],
    concurrencies: Sequence[int],
    requests: int,
    warmup: int,
    cell_timeout: float,
    repeat: int,
    progress: Any,
) -> list[Cell]:
    opened: dict[str, _Client] = {}
    cells: list[Cell] = []
    slow: set[tuple[str, int]] = set()
    try:
        for name in clients:
            c = _CLASSES[name]()
            await c.open(server.base)
            opened[name] = c
        for rep, conc in ((r, c) for r in range(repeat) for c in concurrencies):
            # Rotate the order each pass so no client always runs first (or last) after a change.
            for name in [*clients[rep % len(clients) :], *clients[: rep % len(clients)]]:
                if (name, conc) in slow:
                    continue  # did not finish half its requests in time: one pass says enough
                c = opened[name]
                # Warm-up opens the pool for this concurrency; a slow client gets a shorter one.
                n_warm = max(warmup, min(conc, 512)) if warmup else 0
                await _drive(c, conc, n_warm, time.perf_counter() + min(cell_timeout, 1.0))
                gc.collect()
                s0 = server.cpu_s()
                c0, t0 = time.process_time(), time.perf_counter()
                done, errors = await _drive(c, conc, requests, t0 + cell_timeout)
                t1, c1 = time.perf_counter(), time.process_time()
                s1 = server.cpu_s()
                cell = Cell(name, conc, done, t1 - t0, c1 - c0, s1 - s0, errors, capped=done < requests)
                cells.append(cell)
                progress(cell)
                if done < requests // 2:  # far too slow to be worth more passes
                    slow.add((name, conc))
    finally:
        for c in opened.values():
            await c.close()
    return cells


def run_benchmark(
    *,
    clients: Sequence[str] = CLIENTS,
    concurrencies: Sequence[int] = (1, 64, 512),
    requests: int = 2000,
    warmup: int = 200,
    cell_timeout: float = 4.0,
    repeat: int = 3,
    uvloop: bool = False,
    progress: Any = None,
) -> list[Cell]:
    """Start the server, measure every (concurrency, client) cell ``repeat`` times, stop the server.

    Returns every measurement; ``summarise`` takes the median per cell."""
    progress = progress or (lambda cell: None)
    runner: Any = asyncio.run
    if uvloop:
        import uvloop as _uvloop

        runner = _uvloop.run
    with ServerProcess(uvloop=uvloop) as server:
        result: list[Cell] = runner(
            _run_cells(server, clients, concurrencies, requests, warmup, cell_timeout, repeat, progress)
        )
        return result


# -- reporting -------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    import aiohttp
    import httpx

    out = {"python": platform.python_version(), "aiohttp": aiohttp.__version__, "httpx": httpx.__version__}
    for mod in ("orjson", "uvloop"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = "not installed"
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def machine() -> str:
    return f"{os.cpu_count()} CPUs ({_cpu_model()}), {platform.system()} {platform.release()}"


def summarise(cells: Sequence[Cell]) -> list[Cell]:
    """One cell per (concurrency, client) in table order: the medians of its repeats' req/s, client
    CPU/request and server CPU/request (each taken separately), over the repeats' summed requests."""
    groups: dict[tuple[int, str], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.concurrency, c.client), []).append(c)
    out = []
    for conc in sorted({k[0] for k in groups}):
        for name in CLIENTS:
            g = groups.get((conc, name))
            if not g:
                continue
            n = sum(c.requests for c in g)
            rps, cpu_us, srv_us = (
                statistics.median(getattr(c, m) for c in g) for m in ("rps", "cpu_us", "server_cpu_us")
            )
            out.append(
                Cell(
                    name,
                    conc,
                    n,
                    n / rps if rps else 0.0,
                    cpu_us * n / 1e6,
                    srv_us * n / 1e6,
                    errors=sum(c.errors for c in g),
                    capped=any(c.capped for c in g),
                )
            )
    return out


def table(cells: Sequence[Cell]) -> str:
    """A Markdown table; ratios are against ``raw aiohttp`` at the same concurrency."""
    base = {c.concurrency: c for c in cells if c.client == BASELINE}
    lines = [
        "| concurrency | client | requests | req/s | client CPU µs/req | CPU vs raw aiohttp | req/s vs raw aiohttp "
        "| server CPU µs/req | client-bound req/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        b = base.get(c.concurrency)
        cpu_ratio = f"{c.cpu_us / b.cpu_us:.2f}{TIMES}" if b else "—"
        rps_ratio = f"{c.rps / b.rps:.2f}{TIMES}" if b else "—"
        note = " (time-capped)" if c.capped else ""
        note += f" ({c.errors} errors)" if c.errors else ""
        lines.append(
            f"| {c.concurrency} | {c.client}{note} | {c.requests} | {c.rps:,.0f} | {c.cpu_us:,.0f} | {cpu_ratio} "
            f"| {rps_ratio} | {c.server_cpu_us:,.0f} | {1e6 / c.cpu_us:,.0f} |"
        )
    return "\n".join(lines)


def targets(cells: Sequence[Cell]) -> list[tuple[str, bool, str]]:
    """(target, met, detail) for the issue's two targets."""
    base = {c.concurrency: c for c in cells if c.client == BASELINE}
    ours = {c.concurrency: c for c in cells if c.client == OURS}
    out = []
    for conc in sorted(set(base) & set(ours)):
        r = ours[conc].cpu_us / base[conc].cpu_us
        out.append(
            (
                f"ours ≤ {TARGET_CPU_RATIO:.2f}{TIMES} raw aiohttp CPU/request at {conc}",
                r <= TARGET_CPU_RATIO,
                f"{r:.2f}{TIMES} ({ours[conc].cpu_us:,.0f} vs {base[conc].cpu_us:,.0f} µs)",
            )
        )
    if 64 in ours:
        rps = ours[64].rps
        bound = 1e6 / ours[64].cpu_us
        out.append(
            (
                f"ours ≥ {TARGET_RPS_AT_64:,.0f} req/s at 64",
                rps >= TARGET_RPS_AT_64,
                f"{rps:,.0f} req/s measured (client and server share the CPUs); "
                f"{bound:,.0f} req/s if the client had a core to itself (1e6 / client CPU µs per request)",
            )
        )
    return out


def plot(cells: Sequence[Cell], path: str, title: str = "") -> None:
    import matplotlib  # type: ignore[import-not-found,unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    clients = [c for c in CLIENTS if any(x.client == c for x in cells)]
    concs = sorted({c.concurrency for c in cells})
    by = {(c.client, c.concurrency): c for c in cells}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(clients)
    for k, (ax, metric, label) in enumerate(
        [
            (axes[0], "cpu_us", "client CPU µs per request (lower is better)"),
            (axes[1], "rps", "requests/s, wall (higher is better)"),
        ]
    ):
        for i, name in enumerate(clients):
            xs = [j + (i - (len(clients) - 1) / 2) * width for j in range(len(concs))]
            ys = [getattr(by[(name, c)], metric) if (name, c) in by else 0 for c in concs]
            ax.bar(xs, ys, width, label=name)
        ax.set_xticks(range(len(concs)))
        ax.set_xticklabels([str(c) for c in concs])
        ax.set_xlabel("concurrent requests")
        ax.set_title(label)
        if k == 0:
            ax.set_yscale("log")
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _row(c: Cell) -> dict[str, Any]:
    return {**attrs.asdict(c), "rps": c.rps, "cpu_us": c.cpu_us, "server_cpu_us": c.server_cpu_us}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rollout-backends bench overhead",
        description="Client CPU per /generate: raw aiohttp, raw httpx, Miles' httpx pattern and ours, on loopback.",
    )
    p.add_argument("--requests", type=int, default=2000, help="requests per cell and pass (default 2000)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 512])
    p.add_argument("--warmup", type=int, default=200, help="unmeasured requests before each cell")
    p.add_argument("--cell-timeout", type=float, default=4.0, help="stop a slow cell early after this many seconds")
    p.add_argument("--repeat", type=int, default=3, help="passes over all cells; the table shows medians")
    p.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS), metavar="CLIENT")
    p.add_argument("--uvloop", action="store_true", help="run client and server on uvloop (must be installed)")
    p.add_argument("--json", dest="json_path", help="write the cells and metadata as JSON here")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--smoke", action="store_true", help="seconds-long run with tiny counts (checks wiring only)")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.concurrency, args.warmup, args.cell_timeout, args.repeat = 40, [1, 8], 8, 5.0, 1
    if BASELINE not in args.clients:
        args.clients.insert(0, BASELINE)
    clients = [c for c in CLIENTS if c in args.clients]

    def progress(c: Cell) -> None:
        print(
            f"  c={c.concurrency:<4} {c.client:<17} {c.requests:>6} req  {c.rps:>8,.0f} req/s  "
            f"{c.cpu_us:>7,.0f} µs CPU/req  server {c.server_cpu_us:>5,.0f} µs/req",
            file=sys.stderr,
            flush=True,
        )

    started = time.time()
    load_at_start = _load()
    cells = run_benchmark(
        clients=clients,
        concurrencies=args.concurrency,
        requests=args.requests,
        warmup=args.warmup,
        cell_timeout=args.cell_timeout,
        repeat=args.repeat,
        uvloop=args.uvloop,
        progress=progress,
    )
    raw, cells = cells, summarise(cells)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "machine": machine(),
        "versions": _versions(),
        "loop": "uvloop" if args.uvloop else "asyncio",
        "command": "rollout-backends bench overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
        "duration_s": round(time.time() - started, 1),
        "load_avg_1m_at_start": load_at_start,
        "load_avg_1m_at_end": _load(),
        "repeat": args.repeat,
        "prompt_tokens": PROMPT_TOKENS,
        "output_tokens": 8,
    }
    print(f"\nClient overhead, {meta['date']}, {meta['machine']}")
    print(", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + f", loop {meta['loop']}")
    print(
        f"{PROMPT_TOKENS}-token prompt, 8 output tokens with logprobs; baseline: {BASELINE}; "
        f"medians of {args.repeat} passes; 1-min load average {meta['load_avg_1m_at_start']} at start, "
        f"{meta['load_avg_1m_at_end']} at end\n"
    )
    print(table(cells))
    print()
    results = targets(cells)
    for name, met, detail in results:
        print(f"- {'MET' if met else 'NOT MET'}: {name}: {detail}")
    print(f"\n({meta['duration_s']} s)")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(
                {"meta": meta, "cells": [_row(c) for c in cells], "passes": [_row(c) for c in raw]},
                f,
                indent=1,
            )
    if args.plot:
        try:
            plot(cells, args.plot, f"{meta['machine']}; {meta['date']}; 1-min load average {load_at_start}")
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)
    if args.check and not all(met for _, met, _ in results):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
