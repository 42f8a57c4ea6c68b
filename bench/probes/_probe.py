"""Shared plumbing of the Dynamo CPU probes: fleets, per-process CPU, clients, interleaved runs.

* :class:`Fleet` starts N workers (``dynamo.mocker`` or our Python worker over the no-compute
  engine, ``nocompute_worker.py``) in one namespace and one or more ``dynamo.frontend`` processes
  in front of them (file discovery, TCP request plane, ZMQ event plane), all built by the
  library's own launch commands (``DynamoWorkerCommand`` / ``DynamoFrontend``) and started by its
  ``Supervisor``. Several frontends in one namespace see the same workers, so frontend variants
  (env, flags) are compared on the same workers, interleaved, without restarts.
* :func:`cpu_s` reads utime+stime (+ cutime/cstime of reaped children) of a process and all its
  live descendants from ``/proc/<pid>/stat`` (10 ms ticks).
* Clients: :class:`RawClient` (aiohttp posting a fixed JSON body: what a library-free caller
  does) and :class:`AdapterClient` (``backend.generate``).
* :func:`run_cells` runs every cell once per round, in rotated order (A B C, B C A, ...), for
  ``rounds`` rounds, and :func:`summarise` reports medians with min-max over the rounds.
"""

# ruff: noqa: RUF001, RUF002
from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parents[2]
_TICK = os.sysconf("SC_CLK_TCK")


# -- CPU accounting -------------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            s = f.read().decode(errors="replace")
    except OSError:
        return None
    return s[s.rfind(")") + 2 :].split()


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            f = _stat(int(e))
            if f is not None:
                kids.setdefault(int(f[1]), []).append(int(e))
    return kids


def cpu_s(pid: int, kids: dict[int, list[int]] | None = None) -> float:
    """CPU seconds of ``pid`` and every live descendant (utime+stime+cutime+cstime)."""
    kids = kids if kids is not None else _children_map()
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        f = _stat(p)
        if f is None:
            continue
        total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
        todo.extend(kids.get(p, ()))
    return total / _TICK


def cpu_many(groups: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """CPU seconds per named group of processes (each with its descendants)."""
    kids = _children_map()
    return {name: sum(cpu_s(pid, kids) for pid in pids) for name, pids in groups.items()}


def threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (``comm``) of one process (e.g. tokio workers vs Python)."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                s = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = s[s.rfind(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK
    return out


def machine() -> dict[str, Any]:
    import aiohttp

    def ver(mod: str) -> str | None:
        try:
            from importlib.metadata import version

            return version(mod)
        except Exception:
            return None

    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "orjson": ver("orjson"),
        "ai-dynamo (client env)": ver("ai-dynamo"),
        "loadavg": os.getloadavg(),
    }


# -- fleets ---------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FrontendVariant:
    """One ``dynamo.frontend`` in front of the fleet's workers."""

    name: str
    env: Mapping[str, str | None] = attrs.field(factory=dict)
    #: Drop ``--migration-limit 0`` from the command line (1.4.2's default is 0 anyway).
    stock_migration: bool = False
    extra_args: tuple[str, ...] = ()
    #: False: the launcher's env (DYN_ENABLE_RL, DYN_RL_PORT, DYN_SGLANG_ENABLE_GENERATE) is removed.
    ours_env: bool = True


OURS = FrontendVariant(name="ours")
STOCK = FrontendVariant(name="stock", ours_env=False, stock_migration=True)


@attrs.define
class Fleet:
    """Workers of one kind in one namespace, and frontends in front of them."""

    kind: str = "mocker"  #: "mocker" | "nocompute"
    workers: int = 2
    frontends: Sequence[FrontendVariant] = (OURS,)
    output_tokens: int = 128  #: nocompute: tokens per answer (the request's max_tokens cuts it)
    tokens_per_chunk: int = 1  #: nocompute: PROBE_TOKENS_PER_CHUNK
    worker_text: bool = True  #: nocompute: ROLLOUT_DYN_WORKER_TEXT
    speedup_ratio: float = 1e6  #: mocker
    python: str = sys.executable
    worker_env: Mapping[str, str] = attrs.field(factory=dict)
    router_mode: str = "round-robin"
    log_dir: Path | None = None
    # filled by start()
    namespace: str = ""
    model_path: str = ""
    model_name: str = ""
    frontend_urls: dict[str, str] = attrs.field(factory=dict)
    pids: dict[str, int] = attrs.field(factory=dict)
    worker_urls: list[str] = attrs.field(factory=list)
    rpc_ports: dict[str, int] = attrs.field(factory=dict)
    _sup: Any = None
    _run_dir: Path | None = None

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        from rollout_backends.adapters.dynamo import DynamoFleetConfig, DynamoFrontend, DynamoWorkerCommand
        from rollout_backends.adapters.dynamo._launcher import fleet_planes
        from rollout_backends.adapters.reference import cached_tiny_model
        from rollout_backends.launch import NodeContext, Supervisor

        model = cached_tiny_model()
        self.model_path, self.model_name = str(model), model.name
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        self.namespace = f"pr{uuid.uuid4().hex[:8]}"
        self._run_dir = Path(tempfile.mkdtemp(prefix=f"probe-{self.namespace}-"))
        kv = self._run_dir / "kv"
        kv.mkdir()
        logs = self.log_dir or (self._run_dir / "logs")
        cfg = DynamoFleetConfig(
            model_path=model, workers=self.workers, worker_kind="mocker", router_mode=self.router_mode
        )
        planes = fleet_planes(cfg, kv)
        self._sup = Supervisor(logs, grace=5.0)
        taken: set[int] = set()
        env: dict[str, str] = dict(self.worker_env)
        if self.kind == "mocker":
            cmd = DynamoWorkerCommand(
                kind="mocker",
                model_path=self.model_path,
                served_model_name=self.model_name,
                namespace=self.namespace,
                planes=planes,
                mocker_speedup_ratio=self.speedup_ratio,
                python=self.python,
                env=env,
            )
        elif self.kind == "nocompute":
            env.update(
                PYTHONPATH=str(ROOT),
                PROBE_TOKENS_PER_CHUNK=str(self.tokens_per_chunk),
                ROLLOUT_DYN_WORKER_TEXT="1" if self.worker_text else "0",
            )
            arg = json.dumps({"output_tokens": self.output_tokens, "vocab_size": vocab})
            cmd = DynamoWorkerCommand(
                kind="module",
                module="bench.probes.nocompute_worker",
                model_path=self.model_path,
                served_model_name=self.model_name,
                namespace=self.namespace,
                planes=planes,
                python=self.python,
                env=env,
                extra_args=("--engine", "bench.probes.nocompute_worker:engine", "--engine-arg", arg),
            )
        else:
            raise ValueError(self.kind)
        engines = []
        for i in range(self.workers):
            ctx = NodeContext.on(i, "127.0.0.1", str(logs), picked=taken)
            launch = cmd.build(ctx).named(f"worker-{i}")
            proc = await self._sup.start(launch.spec)
            engines.append(launch.info(ctx, proc.pid))
            self.pids[f"worker-{i}"] = proc.pid
            self.worker_urls.append(launch.control_url)
            self.rpc_ports[launch.control_url] = int(launch.extra["rpc_port"])
        for fv in self.frontends:
            fe = DynamoFrontend(
                namespace=self.namespace,
                planes=planes,
                router_mode=self.router_mode,
                python=self.python,
                env=dict(fv.env),
                extra_args=fv.extra_args,
            )
            ctx = NodeContext.on(-1, "127.0.0.1", str(logs), picked=taken)
            launch = fe.build(ctx, engines).named(f"frontend-{fv.name}")
            spec = launch.spec
            argv = list(spec.argv)
            if fv.stock_migration:
                i = argv.index("--migration-limit")
                del argv[i : i + 2]
            e = dict(spec.env)
            if not fv.ours_env:
                for k in ("DYN_ENABLE_RL", "DYN_RL_PORT", "DYN_SGLANG_ENABLE_GENERATE"):
                    e[k] = None
            for k, v in fv.env.items():  # "@port": a free port of this node
                e[k] = str(ctx.port(k, below=32768)) if v == "@port" else v
            spec = attrs.evolve(spec, argv=argv, env=e)
            proc = await self._sup.start(spec)
            self.pids[f"frontend-{fv.name}"] = proc.pid
            self.frontend_urls[fv.name] = launch.control_url
        await self._sup.wait_ready(timeout=180)

    async def stop(self) -> None:
        if self._sup is not None:
            await self._sup.aclose()
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir / "kv", ignore_errors=True)

    def argv(self, name: str) -> list[str]:
        return list(self._sup.process(name).spec.argv)

    def groups(self, frontend: str) -> dict[str, list[int]]:
        """CPU groups of one frontend's cells: that frontend, and all workers together."""
        return {
            "frontend": [self.pids[f"frontend-{frontend}"]],
            "workers": [p for n, p in self.pids.items() if n.startswith("worker-")],
        }

    async def connect(self, frontend: str, **kw: Any) -> Any:
        from rollout_backends.adapters.dynamo import connect

        kw.setdefault("flavor", "mocker" if self.kind == "mocker" else "rollout")
        return await connect(
            self.frontend_urls[frontend],
            workers=list(self.worker_urls),
            rpc_ports=dict(self.rpc_ports),
            router_mode=self.router_mode,
            model=self.model_name,
            model_path=self.model_path,
            initial_version="default",
            **kw,
        )


# -- requests and clients -------------------------------------------------------------------------

PROMPT_TOKENS = 128


def prompt(vocab: int = 512) -> tuple[int, ...]:
    return tuple((17 + 31 * i) % vocab for i in range(PROMPT_TOKENS))


def gen_request(tokens: int) -> Any:
    from rollout_backends import GenerateRequest, SamplingParams

    return GenerateRequest(
        input_ids=prompt(), sampling=SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True)
    )


def wire_body(fleet: Fleet, tokens: int) -> dict[str, Any]:
    """Exactly the ``/v1/completions`` body our wire builds for this fleet (``completion_body``)."""
    from rollout_backends.adapters.dynamo import completion_body

    body = completion_body(gen_request(tokens), fleet.model_name, logprobs=fleet.kind != "mocker")
    return json.loads(json.dumps(body))


class RawClient:
    """aiohttp, one session, ``post(json=body)`` then ``await resp.json()``; a fresh rid per request."""

    def __init__(self, url: str, body: Mapping[str, Any], *, path: str = "/v1/completions", check: int | None = None):
        import aiohttp

        self.url = url.rstrip("/") + path
        self.body = dict(body)
        self.check = check
        self._aiohttp = aiohttp
        self._session: Any = None
        self._n = 0

    async def one(self) -> bool:
        if self._session is None:
            self._session = self._aiohttp.ClientSession(connector=self._aiohttp.TCPConnector(limit=0))
        self._n += 1
        body = self.body
        nv = body.get("nvext")
        if isinstance(nv, dict) and "annotations" in nv:
            body = {**body, "nvext": {**nv, "annotations": [f"rid:raw-{self._n}"]}}
        async with self._session.post(self.url, json=body) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {str(data)[:300]}")
        if self.check is not None:
            ids = (data.get("nvext") or {}).get("completion_token_ids")
            if ids is None:
                ids = data["choices"][0].get("token_ids")
            n = len(ids) if ids is not None else self.check  # without extra_fields no ids come back
            if n != self.check:
                raise RuntimeError(f"{n} tokens, expected {self.check}")
        return True

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class AdapterClient:
    """``backend.generate(GenerateRequest(...))`` (the library's whole client path)."""

    def __init__(self, backend: Any, tokens: int):
        self.backend = backend
        self.tokens = tokens
        self.req = gen_request(tokens)

    async def one(self) -> bool:
        import attrs as _attrs

        req = _attrs.evolve(self.req, request_id=uuid.uuid4().hex)
        gen = await self.backend.generate(req)
        if len(gen.output_ids) != self.tokens:
            raise RuntimeError(f"{len(gen.output_ids)} tokens, expected {self.tokens}")
        return True

    async def aclose(self) -> None:
        await self.backend.aclose()


async def drive(client: Any, n: int, concurrency: int) -> float:
    tickets = iter(range(n))

    async def w() -> None:
        for _ in tickets:
            await client.one()

    t0 = time.perf_counter()
    await asyncio.gather(*(w() for _ in range(concurrency)))
    return time.perf_counter() - t0


# -- cells and rounds -----------------------------------------------------------------------------


@attrs.define
class Cell:
    """One configuration: a client, a batch shape, and the processes whose CPU is charged to it."""

    label: str
    client: Any
    requests: int
    concurrency: int
    tokens: int
    pids: Mapping[str, Sequence[int]]  #: group name -> pids (measured over the batch)
    extra: dict[str, Any] = attrs.field(factory=dict)
    #: groups whose CPU is also split by thread name (e.g. a worker's Python thread vs tokio)
    thread_groups: Sequence[str] = ("workers", "frontend")


def _threads(groups: Mapping[str, Sequence[int]], names: Sequence[str]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for g in names:
        acc: dict[str, float] = {}
        for pid in groups.get(g, ()):
            for t, v in threads_cpu_s(pid).items():
                key = "python" if t == "python" else ("tokio" if t.startswith("tokio") else "other")
                acc[key] = acc.get(key, 0.0) + v
        out[g] = acc
    return out


async def measure(cell: Cell, *, warmup: int | None = None) -> dict[str, Any]:
    await drive(cell.client, warmup if warmup is not None else cell.concurrency, cell.concurrency)
    c0 = time.process_time()
    p0 = cpu_many(cell.pids)
    t0 = _threads(cell.pids, cell.thread_groups)
    wall = await drive(cell.client, cell.requests, cell.concurrency)
    p1 = cpu_many(cell.pids)
    t1 = _threads(cell.pids, cell.thread_groups)
    c1 = time.process_time()
    out: dict[str, Any] = {
        "label": cell.label,
        "wall_s": wall,
        "requests": cell.requests,
        "tokens": cell.tokens,
        "concurrency": cell.concurrency,
        **cell.extra,
    }
    cpu = {"client": c1 - c0, **{k: p1[k] - p0[k] for k in cell.pids}}
    out["cpu_s"] = cpu
    out["us_per_req"] = {k: v * 1e6 / cell.requests for k, v in cpu.items()}
    out["threads_us_per_req"] = {
        g: {k: (v - t0[g].get(k, 0.0)) * 1e6 / cell.requests for k, v in t1[g].items()} for g in t1
    }
    return out


async def run_cells(
    cells: Sequence[Cell], rounds: int, *, pause_s: float = 0.5, log: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for r in range(rounds):
        order = list(cells[r % len(cells) :]) + list(cells[: r % len(cells)])
        for cell in order:
            await asyncio.sleep(pause_s)  # let the previous batch's tail settle
            res = await measure(cell)
            res["round"] = r
            res["load1"] = os.getloadavg()[0]
            results.append(res)
            us = res["us_per_req"]
            log(
                f"  r{r} {cell.label:<40} wall {res['wall_s']:.2f}s  "
                + "  ".join(f"{k} {v:,.0f}" for k, v in us.items())
            )
    return results


def _fmt(values: Sequence[float]) -> str:
    m = statistics.median(values)
    return f"{m:,.0f} ({min(values):,.0f}–{max(values):,.0f})"


def summarise(results: Sequence[dict[str, Any]], *, per_token: bool = True) -> str:
    """Markdown: per label, median (min–max) CPU µs per request per process, and per token."""
    labels: list[str] = []
    for r in results:
        if r["label"] not in labels:
            labels.append(r["label"])
    procs: list[str] = []
    for r in results:
        for k in r["us_per_req"]:
            if k not in procs:
                procs.append(k)
    head = "| configuration | T | C | n | wall s | " + " | ".join(f"{p} µs/req" for p in procs)
    if per_token:
        head += " | " + " | ".join(f"{p} µs/token" for p in procs if p != "client")
    lines = [head + " |", "|" + "---|" * (head.count("|") - 1)]
    for lab in labels:
        rs = [r for r in results if r["label"] == lab]
        r0 = rs[0]
        wall = statistics.median(r["wall_s"] for r in rs)
        row = f"| {lab} | {r0['tokens']} | {r0['concurrency']} | {len(rs)} | {wall:.2f} | "
        row += " | ".join(_fmt([r["us_per_req"].get(p, 0.0) for r in rs]) for p in procs)
        if per_token:
            row += " | " + " | ".join(
                f"{statistics.median(r['us_per_req'].get(p, 0.0) / r['tokens'] for r in rs):,.1f}"
                for p in procs
                if p != "client"
            )
        lines.append(row + " |")
    return "\n".join(lines)


def save(out: Path, name: str, payload: Any) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    p = out / f"{name}.json"
    p.write_text(json.dumps(payload, indent=1, default=str))
    return p


async def wait_quiet(max_load: float = 1.0, timeout: float = 60.0) -> float:
    """Wait (bounded) for the 1-minute load average to drop below ``max_load``."""
    t0 = time.monotonic()
    while os.getloadavg()[0] > max_load and time.monotonic() - t0 < timeout:
        await asyncio.sleep(2)
    return os.getloadavg()[0]


Thunk = Callable[[], Awaitable[Any]]


def fit_table(results: Sequence[dict[str, Any]]) -> str:
    """Per configuration (``extra["config"]``) measured at two output lengths: CPU per request
    split into a fixed part (intercept, µs/request) and a per-token part (slope, µs/token), per
    process group, from the medians at the shortest and the longest T."""
    configs: list[str] = []
    for r in results:
        if r.get("config") and r["config"] not in configs:
            configs.append(r["config"])
    procs = [p for p in results[0]["us_per_req"]]
    head = "| configuration | " + " | ".join(f"{p} µs/req fixed | {p} µs/token" for p in procs) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in configs:
        rs = [r for r in results if r.get("config") == c]
        ts = sorted({r["tokens"] for r in rs})
        if len(ts) < 2:
            continue
        lo, hi = ts[0], ts[-1]
        cells = []
        for p in procs:
            a = statistics.median(r["us_per_req"][p] for r in rs if r["tokens"] == lo)
            b = statistics.median(r["us_per_req"][p] for r in rs if r["tokens"] == hi)
            slope = (b - a) / (hi - lo)
            cells.append(f"{a - slope * lo:,.0f} | {slope:,.2f}")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def args_common(description: str) -> Any:
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--python", default=sys.executable, help="interpreter of the Dynamo processes (its ai-dynamo)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "probes" / "out")
    p.add_argument("--tag", default="", help="suffix of the output file name")
    return p


def dynamo_version(python: str) -> str:
    import subprocess

    return subprocess.run(
        [python, "-c", "from importlib.metadata import version; print(version('ai-dynamo'))"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()


def threads_table(results: Sequence[dict[str, Any]]) -> str:
    """Median CPU µs per request by thread kind (Python thread vs tokio threads) per group."""
    labels: list[str] = []
    for r in results:
        if r["label"] not in labels:
            labels.append(r["label"])
    cols = [(g, k) for g in ("frontend", "workers") for k in ("python", "tokio", "other")]
    head = "| configuration | " + " | ".join(f"{g} {k} µs/req" for g, k in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for lab in labels:
        rs = [r for r in results if r["label"] == lab and "threads_us_per_req" in r]
        if not rs:
            continue
        vals = [statistics.median(r["threads_us_per_req"].get(g, {}).get(k, 0.0) for r in rs) for g, k in cols]
        lines.append(f"| {lab} | " + " | ".join(f"{v:,.0f}" for v in vals) + " |")
    return "\n".join(lines)


def paired(results: Sequence[dict[str, Any]], a: str, b: str, group: str) -> tuple[float, float, float, int]:
    """Per-round ratio ``a / b`` of one group's CPU per request (same round: same machine state):
    median, min, max, rounds."""
    ra = {r["round"]: r["us_per_req"][group] for r in results if r["label"] == a}
    rb = {r["round"]: r["us_per_req"][group] for r in results if r["label"] == b}
    xs = [ra[k] / rb[k] for k in ra if k in rb and rb[k] > 0]
    if not xs:
        return (float("nan"),) * 3 + (0,)  # type: ignore[return-value]
    return statistics.median(xs), min(xs), max(xs), len(xs)
