"""Client overhead: what our adapters cost per generation next to raw HTTP clients, on fast servers.

All clients run in this process, one after another, against one server at a time (each in its own
processes), with the same request body, at each concurrency. Servers (``--servers``):

* ``loopback``: a trivial SGLang-shaped ``asyncio.Protocol`` server (``rb_bench.server``);
* ``reference``: the real reference HTTP server (``adapters/reference/_server.py``, SGLang's native
  ``/generate``) over its ``NoComputeEngine`` (``serve-reference --no-compute 8``: fixed tokens with
  logprobs at once, no model);
* ``dynamo``: a real ``python -m dynamo.frontend`` and one ``dynamo.mocker`` worker (our launcher,
  ``worker_kind="mocker"``, a huge ``--speedup-ratio``), ``/v1/completions`` (needs ai-dynamo).

Clients, the same on every server (ours = the adapter for that server: SGLang on loopback and
reference, Dynamo on dynamo); every raw client posts the body our adapter's wire builds, to the
URL it builds:

* ``raw aiohttp`` (the baseline): one ``ClientSession`` (``TCPConnector(limit=0)``, as ours), ``session.post(json=...)``
  then ``await resp.json()``;
* ``raw httpx``: one ``httpx.AsyncClient(timeout=None)`` with httpx's default limits;
* ``miles httpx``: Miles' pattern (``miles/utils/http_utils.py``): one shared
  ``httpx.AsyncClient(limits=httpx.Limits(max_connections=512), timeout=httpx.Timeout(None))``
  (512 = ``sglang_server_concurrency`` x one engine), ``post(json=...)``, ``raise_for_status()``,
  ``response.json()`` inside its retry loop;
* ``ours``: ``backend.generate(GenerateRequest(...))`` through the adapter's ``connect``
  (request validation, the wire, ``HttpClient``, response parsing into a ``Generation``);
* ``ours: HttpClient`` (diagnostic, not a target): a prebuilt ``HttpRequest`` through
  ``HttpClient.send`` and ``HttpResponse.json()``: the core's transport cost alone.

Measured per cell: requests/s (wall), client CPU microseconds per request (``time.process_time()``
of this process) and the server's CPU per request (loopback: its own ``process_time()``, read over
HTTP; the others: user + system time of every process of the server, from ``/proc``).

Run (from a checkout): ``PYTHONPATH=bench python -m rb_bench.overhead``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import http.client
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs

from . import with_bench_path

__all__ = ["CLIENTS", "SERVERS", "Cell", "Target", "available_servers", "main", "run_benchmark"]

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 8
BASELINE = "raw aiohttp"
OURS = "ours"
#: Clients in table order; the diagnostic core-only row is last.
CLIENTS = ("raw aiohttp", "raw httpx", "miles httpx", "ours", "ours: HttpClient")
#: Servers in table order.
SERVERS = ("loopback", "reference", "dynamo")
#: The server the req/s target is judged on: the others' own CPU per request bounds req/s on a
#: small machine (client and server share its cores), whatever the client does.
RPS_TARGET_SERVER = "loopback"
TARGET_CPU_RATIO = 1.05
TIMES = "\N{MULTIPLICATION SIGN}"
TARGET_RPS_AT_64 = 5000.0
#: ``dynamo.mocker --speedup-ratio``: simulated step times divided by this. Not 0: ai-dynamo 1.4.2's
#: help says 0 means "infinite speedup (no simulation delays)", but measured here a request then
#: took ~50 ms at concurrency 1 (20 req/s); at 1e6 it takes ~1.4 ms (the frontend's own cost).
MOCKER_SPEEDUP_RATIO = 1e6


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
    server: str = "loopback"

    @property
    def rps(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_us(self) -> float:
        return 1e6 * self.cpu_s / self.requests if self.requests else float("nan")

    @property
    def server_cpu_us(self) -> float:
        return 1e6 * self.server_cpu_s / self.requests if self.requests else float("nan")


# -- what the clients send, per server -------------------------------------------------------------


def _prompt(vocab_size: int = 32000) -> tuple[int, ...]:
    return tuple((i * 7919) % 32000 % vocab_size for i in range(PROMPT_TOKENS))


def _sampling() -> Any:
    from rollout_backends import SamplingParams

    return SamplingParams(max_new_tokens=OUTPUT_TOKENS, temperature=1.0)


@attrs.frozen(slots=True, kw_only=True)
class Target:
    """One running server as every client sees it.

    ``url`` and ``payload`` are what our adapter's wire builds for the benchmark's request (made by
    the adapter's own wire at start-up, see :func:`_target`), as the plain JSON value a raw client
    holds; ``output_ids`` finds the output token ids in a raw answer; ``connect`` opens our adapter.
    """

    server: str
    url: str
    payload: dict[str, Any]
    output_ids: Callable[[Any], Any]
    connect: Callable[[], Awaitable[Any]]
    prompt: tuple[int, ...]
    sampling: Any
    server_cpu_s: Callable[[], float]
    note: str = ""


async def _target(
    server: str,
    connect: Callable[[], Awaitable[Any]],
    output_ids: Callable[[Any], Any],
    server_cpu_s: Callable[[], float],
    *,
    prompt: tuple[int, ...],
    note: str = "",
) -> Target:
    """The raw clients' URL and body, from the wire of a backend opened by ``connect`` itself: the
    identical request our ``generate`` sends (only the request id is fixed)."""
    from rollout_backends import GenerateRequest

    backend = await connect()
    try:
        req = GenerateRequest(input_ids=prompt, sampling=_sampling(), request_id="0" * 32)
        http_req = backend.wire.generate(req, None)
    finally:
        await backend.aclose()
    # Our wire may keep the ids as a tuple: a raw client holds plain JSON lists.
    body = json.loads(json.dumps(http_req.json))
    assert isinstance(body, dict), body
    return Target(server=server, url=http_req.url, payload=body, output_ids=output_ids, connect=connect,
                  prompt=prompt, sampling=_sampling(), server_cpu_s=server_cpu_s, note=note)  # fmt: skip


def _sglang_ids(data: Any) -> Any:
    return data["output_ids"]


def _dynamo_ids(data: Any) -> Any:
    return data["nvext"]["completion_token_ids"]


# -- clients ---------------------------------------------------------------------------------------


class _Client:
    """One client pattern; ``open`` takes everything server-specific from the ``Target``."""

    name = ""

    async def open(self, target: Target) -> None:
        raise NotImplementedError

    async def one(self) -> bool:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class _Raw(_Client):
    def _take(self, target: Target) -> None:
        self.url = target.url
        self.payload = target.payload
        self.ids = target.output_ids


class RawAiohttp(_Raw):
    name = "raw aiohttp"

    async def open(self, target: Target) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._take(target)

    async def one(self) -> bool:
        async with self.session.post(self.url, json=self.payload) as resp:
            data = await resp.json()
            return resp.status == 200 and len(self.ids(data)) == OUTPUT_TOKENS

    async def close(self) -> None:
        await self.session.close()


class RawHttpx(_Raw):
    name = "raw httpx"

    async def open(self, target: Target) -> None:
        import httpx

        self.client = httpx.AsyncClient(timeout=None)
        self._take(target)

    async def one(self) -> bool:
        resp = await self.client.post(self.url, json=self.payload)
        data = resp.json()
        return resp.status_code == 200 and len(self.ids(data)) == OUTPUT_TOKENS

    async def close(self) -> None:
        await self.client.aclose()


class MilesHttpx(_Raw):
    """``miles.utils.http_utils``: ``init_http_client`` + ``post`` -> ``_post`` (no failures here)."""

    name = "miles httpx"

    async def open(self, target: Target) -> None:
        import httpx

        concurrency = 512 * 1 // 1  # sglang_server_concurrency * rollout_num_gpus // gpus_per_engine
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency), timeout=httpx.Timeout(None))
        self._take(target)

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
        return len(self.ids(data)) == OUTPUT_TOKENS

    async def close(self) -> None:
        await self.client.aclose()


class Ours(_Client):
    name = "ours"

    async def open(self, target: Target) -> None:
        from rollout_backends import GenerateRequest

        self.backend = await target.connect()
        self.request_type = GenerateRequest
        self.prompt = target.prompt
        self.sampling = target.sampling

    async def one(self) -> bool:
        gen = await self.backend.generate(self.request_type(input_ids=self.prompt, sampling=self.sampling))
        return len(gen.output_ids) == OUTPUT_TOKENS

    async def close(self) -> None:
        await self.backend.aclose()


class OursCore(_Raw):
    name = "ours: HttpClient"

    async def open(self, target: Target) -> None:
        from rollout_backends.kit import HttpClient, HttpRequest

        self.client = HttpClient()
        self._take(target)
        self.request = HttpRequest("POST", self.url, json=self.payload)

    async def one(self) -> bool:
        resp = await self.client.send(self.request)
        data = resp.json()
        return resp.status == 200 and len(self.ids(data)) == OUTPUT_TOKENS

    async def close(self) -> None:
        await self.client.aclose()


_CLASSES: dict[str, type[_Client]] = {c.name: c for c in (RawAiohttp, RawHttpx, MilesHttpx, Ours, OursCore)}


# -- the servers -----------------------------------------------------------------------------------


class ServerProcess:
    """The fake SGLang server in a child process; it exits when we close its stdin."""

    def __init__(self, *, uvloop: bool = False) -> None:
        cmd = [sys.executable, "-m", "rb_bench.server", "--port", "0"]
        if uvloop:
            cmd.append("--uvloop")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=with_bench_path(os.environ)
        )
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


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _processes_cpu_s(pgids: Iterable[int]) -> float:
    """User + system CPU seconds of every live process in the process groups ``pgids`` (``/proc``;
    the supervisor starts each server process as its own group, so its children count too)."""
    from rollout_backends.launch import group_members

    total = 0
    for pgid in pgids:
        for pid in group_members(pgid):
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read().decode(errors="replace")
            except OSError:
                continue  # exited in between
            fields = stat[stat.rfind(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / _TICK


@asynccontextmanager
async def loopback_server(*, uvloop: bool = False, **_: Any) -> AsyncIterator[Target]:
    from rollout_backends.adapters.sglang import connect

    with ServerProcess(uvloop=uvloop) as server:
        yield await _target("loopback", lambda: connect(server.base), _sglang_ids, server.cpu_s, prompt=_prompt())


@asynccontextmanager
async def reference_server(*, log_dir: Path, **_: Any) -> AsyncIterator[Target]:
    from rollout_backends.adapters.reference import ReferenceServerCommand
    from rollout_backends.adapters.sglang import connect
    from rollout_backends.launch import NodeContext, Supervisor

    cmd = ReferenceServerCommand(
        model_path="no-compute", no_compute=OUTPUT_TOKENS, extra_args=["--log-level", "warning"]
    )
    launch = cmd.build(NodeContext.on(0, "127.0.0.1", str(log_dir))).named("reference")
    url = launch.control_url  # the reference server serves /generate and control on one port
    async with Supervisor(log_dir, grace=5.0) as sup:
        await sup.start(launch.spec)
        await sup.wait_ready(timeout=60)
        yield await _target(
            "reference",
            lambda: connect(url),
            _sglang_ids,
            lambda: _processes_cpu_s(sup.pids().values()),
            prompt=_prompt(),
            note=f"serve-reference --no-compute {OUTPUT_TOKENS}",
        )


@asynccontextmanager
async def dynamo_server(
    *, log_dir: Path, mocker_speedup_ratio: float = MOCKER_SPEEDUP_RATIO, **_: Any
) -> AsyncIterator[Target]:
    from rollout_backends.adapters.dynamo import DynamoFleetConfig, launch_dynamo_fleet
    from rollout_backends.adapters.reference import cached_tiny_model

    # The mocker needs a model directory for its tokenizer and config (made locally, no download).
    model = cached_tiny_model()
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    cfg = DynamoFleetConfig(model_path=model, workers=1, worker_kind="mocker", router_mode="round-robin",
                      mocker_speedup_ratio=mocker_speedup_ratio)  # fmt: skip
    async with launch_dynamo_fleet(cfg, log_dir=log_dir) as fleet:
        yield await _target(
            "dynamo",
            fleet.connect,
            _dynamo_ids,
            lambda: _processes_cpu_s(fleet.supervisor.pids().values()),
            prompt=_prompt(vocab),
            note=f"dynamo.frontend + 1 dynamo.mocker --speedup-ratio {mocker_speedup_ratio:g}",
        )


_SERVER_CONTEXTS: dict[str, Callable[..., Any]] = {
    "loopback": loopback_server,
    "reference": reference_server,
    "dynamo": dynamo_server,
}


def available_servers() -> tuple[str, ...]:
    """The servers this environment can run: ``dynamo`` needs ai-dynamo (the frontend and mocker)."""
    try:
        has_dynamo = all(importlib.util.find_spec(m) is not None for m in ("dynamo.frontend", "dynamo.mocker"))
    except (ImportError, ValueError):
        has_dynamo = False
    return tuple(s for s in SERVERS if s != "dynamo" or has_dynamo)


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
    target: Target,
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
            await c.open(target)
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
                s0 = target.server_cpu_s()
                c0, t0 = time.process_time(), time.perf_counter()
                done, errors = await _drive(c, conc, requests, t0 + cell_timeout)
                t1, c1 = time.perf_counter(), time.process_time()
                s1 = target.server_cpu_s()
                cell = Cell(name, conc, done, t1 - t0, c1 - c0, s1 - s0, errors, capped=done < requests,
                            server=target.server)  # fmt: skip
                cells.append(cell)
                progress(cell)
                if done < requests // 2:  # far too slow to be worth more passes
                    slow.add((name, conc))
    finally:
        for c in opened.values():
            await c.close()
    return cells


async def _run_server(server: str, server_args: dict[str, Any], *args: Any) -> tuple[list[Cell], str]:
    async with _SERVER_CONTEXTS[server](**server_args) as target:
        return await _run_cells(target, *args), target.note


def run_benchmark(
    *,
    servers: Sequence[str] = ("loopback",),
    clients: Sequence[str] = CLIENTS,
    concurrencies: Sequence[int] = (1, 64, 512),
    requests: int = 2000,
    warmup: int = 200,
    cell_timeout: float = 4.0,
    repeat: int = 3,
    uvloop: bool = False,
    mocker_speedup_ratio: float = MOCKER_SPEEDUP_RATIO,
    log_dir: str | os.PathLike[str] | None = None,
    progress: Any = None,
    notes: dict[str, str] | None = None,
) -> list[Cell]:
    """For each server in turn: start it, measure every (concurrency, client) cell ``repeat``
    times, stop it. Each server gets its own event loop (``asyncio.run``, or uvloop's).

    Returns every measurement; ``summarise`` takes the median per cell. ``notes`` (if given) gets
    each server's one-line description."""
    progress = progress or (lambda cell: None)
    runner: Any = asyncio.run
    if uvloop:
        import uvloop as _uvloop

        runner = _uvloop.run
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="rb-overhead-"))
    cells: list[Cell] = []
    for server in servers:
        server_args = {"uvloop": uvloop, "log_dir": logs / server, "mocker_speedup_ratio": mocker_speedup_ratio}
        got, note = runner(
            _run_server(server, server_args, clients, concurrencies, requests, warmup, cell_timeout, repeat, progress)
        )
        cells += got
        if notes is not None:
            notes[server] = note
    return cells


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
    try:
        from importlib.metadata import PackageNotFoundError, version

        out["ai-dynamo"] = version("ai-dynamo")
    except PackageNotFoundError:
        out["ai-dynamo"] = "not installed"
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
    """One cell per (server, concurrency, client) in table order: the medians of its repeats' req/s,
    client CPU/request and server CPU/request (each taken separately), over the repeats' summed
    requests."""
    groups: dict[tuple[str, int, str], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.server, c.concurrency, c.client), []).append(c)
    out = []
    for server in [s for s in SERVERS if any(k[0] == s for k in groups)]:
        for conc in sorted({k[1] for k in groups if k[0] == server}):
            for name in CLIENTS:
                g = groups.get((server, conc, name))
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
                        server=server,
                    )
                )
    return out


def table(cells: Sequence[Cell]) -> str:
    """A Markdown table, one row per cell (a server column); ratios are against ``raw aiohttp`` on
    the same server at the same concurrency."""
    base = {(c.server, c.concurrency): c for c in cells if c.client == BASELINE}
    lines = [
        "| server | concurrency | client | requests | req/s | client CPU µs/req | CPU vs raw aiohttp "
        "| req/s vs raw aiohttp | server CPU µs/req | client-bound req/s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        b = base.get((c.server, c.concurrency))
        cpu_ratio = f"{c.cpu_us / b.cpu_us:.2f}{TIMES}" if b else "—"
        rps_ratio = f"{c.rps / b.rps:.2f}{TIMES}" if b else "—"
        note = " (time-capped)" if c.capped else ""
        note += f" ({c.errors} errors)" if c.errors else ""
        lines.append(
            f"| {c.server} | {c.concurrency} | {c.client}{note} | {c.requests} | {c.rps:,.0f} | {c.cpu_us:,.0f} "
            f"| {cpu_ratio} | {rps_ratio} | {c.server_cpu_us:,.0f} | {1e6 / c.cpu_us:,.0f} |"
        )
    return "\n".join(lines)


def ratios(cells: Sequence[Cell], client: str = OURS) -> dict[tuple[str, int], float]:
    """``client``'s CPU per request over raw aiohttp's, by (server, concurrency)."""
    base = {(c.server, c.concurrency): c.cpu_us for c in cells if c.client == BASELINE}
    return {
        (c.server, c.concurrency): c.cpu_us / base[(c.server, c.concurrency)]
        for c in cells
        if c.client == client and (c.server, c.concurrency) in base
    }


def pass_ratios(passes: Sequence[Cell], client: str = OURS) -> dict[tuple[str, int], list[float]]:
    """``client``'s CPU per request over raw aiohttp's in each pass (the k-th measurement of each
    cell is pass k): the spread behind the medians."""
    by: dict[tuple[str, int, str], list[Cell]] = {}
    for c in passes:
        by.setdefault((c.server, c.concurrency, c.client), []).append(c)
    out: dict[tuple[str, int], list[float]] = {}
    for (server, conc, name), mine in by.items():
        base = by.get((server, conc, BASELINE))
        if name == client and base:
            out[(server, conc)] = [a.cpu_us / b.cpu_us for a, b in zip(mine, base, strict=False)]
    return out


def targets(cells: Sequence[Cell]) -> list[tuple[str, bool | None, str]]:
    """(target, met, detail) for the issue's two targets; ``met`` is None where a number is
    reported but not judged (req/s on the servers that bound it themselves)."""
    base = {(c.server, c.concurrency): c for c in cells if c.client == BASELINE}
    ours = {(c.server, c.concurrency): c for c in cells if c.client == OURS}
    out: list[tuple[str, bool | None, str]] = []
    for key in [k for k in ours if k in base]:
        server, conc = key
        r = ours[key].cpu_us / base[key].cpu_us
        out.append(
            (
                f"{server}: ours ≤ {TARGET_CPU_RATIO:.2f}{TIMES} raw aiohttp CPU/request at {conc}",
                r <= TARGET_CPU_RATIO,
                f"{r:.2f}{TIMES} ({ours[key].cpu_us:,.0f} vs {base[key].cpu_us:,.0f} µs)",
            )
        )
    for (server, conc), c in ours.items():
        if conc != 64:
            continue
        bound = 1e6 / c.cpu_us
        judged = server == RPS_TARGET_SERVER
        detail = (
            f"{c.rps:,.0f} req/s measured (client and server share the CPUs); "
            f"{bound:,.0f} req/s if the client had a core to itself (1e6 / client CPU µs per request)"
        )
        if not judged:
            detail += f"; not judged here: the server's own {c.server_cpu_us:,.0f} µs CPU per request bounds it"
        out.append(
            (
                f"{server}: ours ≥ {TARGET_RPS_AT_64:,.0f} req/s at 64",
                c.rps >= TARGET_RPS_AT_64 if judged else None,
                detail,
            )
        )
    return out


def plot(cells: Sequence[Cell], path: str, title: str = "") -> None:
    """One row per server: client CPU per request (log scale) and requests/s, by client and concurrency."""
    import matplotlib  # type: ignore[import-not-found,unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    servers = [s for s in SERVERS if any(c.server == s for c in cells)]
    fig, grid = plt.subplots(len(servers), 2, figsize=(12, 4.2 * len(servers)), squeeze=False)
    for row, server in zip(grid, servers, strict=True):
        mine = [c for c in cells if c.server == server]
        clients = [c for c in CLIENTS if any(x.client == c for x in mine)]
        concs = sorted({c.concurrency for c in mine})
        by = {(c.client, c.concurrency): c for c in mine}
        width = 0.8 / len(clients)
        for k, (ax, metric, label) in enumerate(
            [
                (row[0], "cpu_us", "client CPU µs per request (lower is better)"),
                (row[1], "rps", "requests/s, wall (higher is better)"),
            ]
        ):
            for i, name in enumerate(clients):
                xs = [j + (i - (len(clients) - 1) / 2) * width for j in range(len(concs))]
                ys = [getattr(by[(name, c)], metric) if (name, c) in by else 0 for c in concs]
                ax.bar(xs, ys, width, label=name)
            ax.set_xticks(range(len(concs)))
            ax.set_xticklabels([str(c) for c in concs])
            ax.set_xlabel("concurrent requests")
            ax.set_title(f"{server}: {label}", fontsize=10)
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


def _progress(c: Cell) -> None:
    print(
        f"  {c.server:<9} c={c.concurrency:<4} {c.client:<17} {c.requests:>6} req  {c.rps:>8,.0f} req/s  "
        f"{c.cpu_us:>7,.0f} µs CPU/req  server {c.server_cpu_us:>5,.0f} µs/req",
        file=sys.stderr,
        flush=True,
    )


def _print_report(
    meta: dict[str, Any],
    servers: Sequence[str],
    notes: Mapping[str, str],
    cells: Sequence[Cell],
    results: Sequence[tuple[str, bool | None, str]],
    spread: Mapping[tuple[str, int], Sequence[float]],
) -> None:
    """The table, the judged targets and the per-pass ratios on stdout."""
    print(f"\nClient overhead, {meta['date']}, {meta['machine']}")
    print(", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + f", loop {meta['loop']}")
    print(
        f"{PROMPT_TOKENS}-token prompt, {OUTPUT_TOKENS} output tokens (with logprobs where the server has them); "
        f"baseline: {BASELINE}; medians of {meta['repeat']} passes; 1-min load average "
        f"{meta['load_avg_1m_at_start']} at start, {meta['load_avg_1m_at_end']} at end"
    )
    for s in servers:
        print(f"- {s}: {notes.get(s) or s}")
    print()
    print(table(cells))
    print()
    for name, met, detail in results:
        verdict = "REPORTED" if met is None else "MET" if met else "NOT MET"
        print(f"- {verdict}: {name}: {detail}")
    print(f"\n{OURS} / {BASELINE} CPU per request in each pass:")
    for (server, conc), rs in spread.items():
        print(f"- {server} at {conc}: " + ", ".join(f"{r:.2f}{TIMES}" for r in rs))
    print(f"\n({meta['duration_s']} s)")


def _parser(available: Sequence[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rb_bench.overhead",
        description="Client CPU per generation: raw aiohttp, raw httpx, Miles' httpx pattern and ours, "
        "on a loopback server, the reference server (no compute) and a Dynamo frontend + mocker.",
    )
    p.add_argument(
        "--servers",
        nargs="+",
        choices=SERVERS,
        default=None,
        metavar="SERVER",
        help=f"any of {', '.join(SERVERS)} (default: every one available here: {', '.join(available)})",
    )
    p.add_argument("--requests", type=int, default=2000, help="requests per cell and pass (default 2000)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 512])
    p.add_argument("--warmup", type=int, default=200, help="unmeasured requests before each cell")
    p.add_argument("--cell-timeout", type=float, default=4.0, help="stop a slow cell early after this many seconds")
    p.add_argument("--repeat", type=int, default=3, help="passes over all cells; the table shows medians")
    p.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS), metavar="CLIENT")
    p.add_argument("--uvloop", action="store_true", help="run the clients (and the loopback server) on uvloop")
    p.add_argument("--mocker-speedup-ratio", type=float, default=MOCKER_SPEEDUP_RATIO,
                   help=f"dynamo.mocker --speedup-ratio (default {MOCKER_SPEEDUP_RATIO:g})")  # fmt: skip
    p.add_argument("--log-dir", default=None, help="the servers' logs (default: a temporary directory)")
    p.add_argument("--json", dest="json_path", help="write the cells and metadata as JSON here")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--smoke", action="store_true", help="seconds-long run with tiny counts (checks wiring only)")
    p.add_argument("--check", action="store_true", help="exit 1 when a judged target is missed")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    available = available_servers()
    p = _parser(available)
    args = p.parse_args(argv)
    servers = [s for s in SERVERS if s in (args.servers or available)]
    missing = [s for s in servers if s not in available]
    if missing:
        p.error(f"--servers {' '.join(missing)}: needs ai-dynamo (pip install 'rollout-backends[dynamo]')")
    if args.smoke:
        args.requests, args.concurrency, args.warmup, args.cell_timeout, args.repeat = 40, [1, 8], 8, 5.0, 1
    if BASELINE not in args.clients:
        args.clients.insert(0, BASELINE)
    clients = [c for c in CLIENTS if c in args.clients]

    started = time.time()
    load_at_start = _load()
    notes: dict[str, str] = {}
    cells = run_benchmark(
        servers=servers,
        clients=clients,
        concurrencies=args.concurrency,
        requests=args.requests,
        warmup=args.warmup,
        cell_timeout=args.cell_timeout,
        repeat=args.repeat,
        uvloop=args.uvloop,
        mocker_speedup_ratio=args.mocker_speedup_ratio,
        log_dir=args.log_dir,
        progress=_progress,
        notes=notes,
    )
    raw, cells = cells, summarise(cells)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "machine": machine(),
        "versions": _versions(),
        "loop": "uvloop" if args.uvloop else "asyncio",
        "command": "python -m rb_bench.overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
        "duration_s": round(time.time() - started, 1),
        "load_avg_1m_at_start": load_at_start,
        "load_avg_1m_at_end": _load(),
        "repeat": args.repeat,
        "prompt_tokens": PROMPT_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
        "servers": {s: notes.get(s, "") for s in servers},
    }
    results = targets(cells)
    spread = pass_ratios(raw)
    _print_report(meta, servers, notes, cells, results, spread)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(
                {
                    "meta": meta,
                    "cells": [_row(c) for c in cells],
                    "passes": [_row(c) for c in raw],
                    "pass_ratios": [
                        {"server": s, "concurrency": c, "ours_vs_raw_aiohttp_cpu": r} for (s, c), r in spread.items()
                    ],
                },
                f,
                indent=1,
            )
    if args.plot:
        try:
            plot(cells, args.plot, f"{meta['machine']}; {meta['date']}; 1-min load average {load_at_start}")
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)
    if args.check and any(met is False for _, met, _ in results):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
