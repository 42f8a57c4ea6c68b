"""Weight sync: a model's weights pushed into a running engine through the adapter, three ways.

* ``nccl`` (GPU) / ``gloo`` (CPU): the trainer is rank 0 of a fresh ``torch.distributed`` group
  built without a default process group (the engine joins through ``init_weight_group``), and
  broadcasts buckets of at most ``--bucket-mib`` MiB (512, as Miles does), each while the
  adapter's ``update_weights_from_distributed(bucket)`` is in flight. On GPU the sender is on the
  second of ``--gpus`` and the engine (a real SGLang worker) on the first.
* ``tensors``: ``update_weights_from_tensors`` per bucket with tensors on the engine's own device
  (CUDA IPC on GPU; shared memory on CPU); the payload is our ``serialize_named_tensors``.
* ``disk``: ``update_weights_from_disk`` of the model folder (the file is in the page cache).

Each is timed over ``--repeats`` rounds after one warm-up round, against a raw
``torch.distributed`` broadcast of the same tensors in the same buckets, in the same run, from the
same sender to a bare receiver process on the engine's device (same backend, same visibility):
what moving the bytes costs without an engine.

Run: ``python -m rollout_backends._bench.weightsync --engine sglang --model-size qwen2.5-0.5b
--gpus 0,1 --out DIR`` (GPU) or ``--smoke`` (CPU: reference engine, gloo, tiny model).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from rollout_backends._bench import report
from rollout_backends._types import GenerateRequest, SamplingParams, WeightBucket, WeightGroup

__all__ = ["TRANSPORTS", "Measurement", "buckets", "main", "open_group"]

KEY = "weightsync"
TRANSPORTS = ("nccl", "gloo", "tensors", "disk")
TARGET_RATIO = 3.0
TIMES = "\N{MULTIPLICATION SIGN}"
PACKAGES = ("torch", "sglang", "transformers", "safetensors", "aiohttp")
_GROUP_TIMEOUT_S = 120.0
#: Table order (the run order differs: the group transport runs last).
_ORDER = ("raw broadcast", "nccl", "gloo", "tensors", "disk")


# -- the group and the tensors -----------------------------------------------------------------


def open_group(
    backend: str, master_address: str, master_port: int, rank: int, world_size: int, group_name: str, timeout_s: float
) -> Any:
    """Join a ``torch.distributed`` group the way SGLang's engine does (``init_custom_process_group``).

    ``tcp://`` rendezvous (rank 0 hosts the store), the store prefixed with ``group_name``, and
    ``_new_process_group_helper`` with no default process group: the same store keys and the same
    communicator the engine builds on its side, so this works as the trainer's end of the
    engine's ``init_weights_update_group``.
    """
    import torch.distributed.distributed_c10d as c10d

    c: Any = c10d  # private helpers, untyped
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        c.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = c.PrefixStore(group_name, store)
    pg, _ = c._new_process_group_helper(
        world_size, rank, [], c.Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
    )
    c._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def close_group(pg: Any) -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):  # the peer may be gone already
        dist.destroy_process_group(pg)


def broadcast(pg: Any, tensors: Sequence[Any], device: Any) -> None:
    """Broadcast from rank 0 (in place on the receivers), in order; return once done on this side."""
    import torch
    import torch.distributed as dist

    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # per thread
    works = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
    for w in works:
        w.wait()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def buckets(named: Sequence[tuple[str, Any]], limit_bytes: int) -> list[list[tuple[str, Any]]]:
    """Consecutive buckets of at most ``limit_bytes`` (a larger tensor gets a bucket of its own)."""
    out: list[list[tuple[str, Any]]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if not out or (size + n > limit_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out


def nbytes(named: Sequence[tuple[str, Any]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


# -- the bare receiver (its own process) -----------------------------------------------------------


def _receive(spec_path: str) -> int:
    """``--receive SPEC``: join the raw group as rank 1 and receive ``rounds`` x the tensors."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pg = open_group(spec["backend"], spec["address"], spec["port"], 1, 2, spec["group"], _GROUP_TIMEOUT_S)
    bufs = [torch.empty(shape, dtype=getattr(torch, dtype), device=device) for dtype, shape in spec["tensors"]]
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    for r in range(spec["rounds"]):
        broadcast(pg, [flag], device)  # in step with the sender before each timed round
        for bucket in spec["buckets"]:
            broadcast(pg, [bufs[i] for i in bucket], device)
        print(f"round {r} received", flush=True)
    close_group(pg)
    print("done", flush=True)
    return 0


# -- measuring -------------------------------------------------------------------------------------


@attrs.define
class Measurement:
    transport: str
    path: str
    nbytes: int
    buckets: int
    rounds_s: list[float] = attrs.field(factory=list)
    warmup_s: float | None = None
    status: str = "ok"

    @property
    def median_s(self) -> float:
        return statistics.median(self.rounds_s) if self.rounds_s else float("nan")

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / 1e9 / self.median_s if self.rounds_s else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "median_s": self.median_s if self.rounds_s else None}


class _Run:
    """Everything one benchmark run holds: the engine, the tensors, the sender's device."""

    def __init__(self, args: argparse.Namespace, model_path: str, run_dir: Path, progress: report.Progress) -> None:
        self.args = args
        self.gpu = args.engine == "sglang"
        self.model_path = model_path
        self.run_dir = run_dir
        self.progress = progress
        self.fleet: Any = None
        self.named_cpu: list[tuple[str, Any]] = []
        self.sender_device: Any = None
        self.engine_device: Any = None
        self.hung = False
        # Collectives block their thread; a pool of our own is never joined by asyncio.run, so a
        # collective stuck past the budget cannot keep this process alive (see main).
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="weightsync")
        self.deadline: float = time.monotonic() + float(args.budget_s) - (20.0 if self.gpu else 4.0)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def thread(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    # -- set-up

    def load_tensors(self) -> None:
        import torch
        from safetensors.torch import load_file

        self.named_cpu = list(load_file(str(Path(self.model_path) / "model.safetensors")).items())
        if self.gpu:
            gpus = self.args.gpu_list
            self.engine_device = torch.device("cuda", int(gpus[0]))
            self.sender_device = torch.device("cuda", int(gpus[1]))
            torch.cuda.set_device(self.sender_device)
            try:  # CUDA IPC handles name their device by UUID, which SGLang's engine maps back
                from sglang.srt.utils.patch_torch import (  # type: ignore[import-not-found,unused-ignore]
                    monkey_patch_torch_reductions,
                )

                monkey_patch_torch_reductions()
            except Exception:  # without SGLang here the device index travels (right when both see GPU 0 as 0)
                pass
        else:
            self.engine_device = self.sender_device = torch.device("cpu")

    async def start_engine(self) -> None:
        from rollout_backends.adapters.sglang import SGLangFleetConfig, start_sglang_fleet

        cfg = SGLangFleetConfig(
            model_path=self.model_path,
            workers=1,
            worker_kind="sglang" if self.gpu else "reference",
            router="none",
            cuda_visible_devices=(self.args.gpu_list[0],) if self.gpu else None,
            mem_fraction_static=0.5 if self.gpu else None,
            log_dir=str(self.run_dir / "logs"),
            startup_timeout_s=max(10.0, self.left()),
        )
        last = [0.0]

        def show(p: Any) -> None:
            if time.monotonic() - last[0] >= 15.0 or all(p.ready.values()):
                last[0] = time.monotonic()
                self.progress(f"engine: {p}")

        self.fleet = await start_sglang_fleet(cfg, progress=show)

    def start_receiver(self, port: int, bucket_idx: list[list[int]], rounds: int) -> subprocess.Popen[bytes]:
        spec = {
            "backend": "nccl" if self.gpu else "gloo",
            "address": "127.0.0.1",
            "port": port,
            "group": "rb-bench-raw",
            "device": "cuda:0" if self.gpu else "cpu",
            "tensors": [(str(t.dtype).removeprefix("torch."), list(t.shape)) for _, t in self.named_cpu],
            "buckets": bucket_idx,
            "rounds": rounds,
        }
        path = self.run_dir / "receiver.json"
        path.write_text(json.dumps(spec))
        env = dict(os.environ)
        if self.gpu:
            env["CUDA_VISIBLE_DEVICES"] = self.args.gpu_list[0]
        else:
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        log = open(self.run_dir / "logs" / "raw-receiver.log", "wb")  # noqa: SIM115 - closed by the child's exit
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "rollout_backends._bench.weightsync", "--receive", str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        finally:
            log.close()

    # -- the transports

    def _on(self, named: Sequence[tuple[str, Any]], device: Any) -> list[tuple[str, Any]]:
        return [(n, t.to(device).contiguous()) for n, t in named]

    async def raw(self, repeats: int, limit: int) -> Measurement:
        from rollout_backends._supervisor import free_port

        named = self._on(self.named_cpu, self.sender_device)
        groups = buckets(named, limit)
        index = {n: i for i, (n, _) in enumerate(named)}
        bucket_idx = [[index[n] for n, _ in b] for b in groups]
        m = Measurement("raw broadcast", "torch.distributed.broadcast, bare receiver", nbytes(named), len(groups))
        port = free_port()
        proc = self.start_receiver(port, bucket_idx, repeats + 1)
        pg = None
        try:
            joining = self.thread(
                open_group, "nccl" if self.gpu else "gloo", "127.0.0.1", port, 0, 2, "rb-bench-raw", _GROUP_TIMEOUT_S
            )
            while not joining.done():  # a receiver that dies would leave rank 0 waiting for it
                if proc.poll() is not None:
                    self.hung = True
                    tail = (self.run_dir / "logs" / "raw-receiver.log").read_text(errors="replace")[-600:]
                    raise RuntimeError(f"the raw receiver exited with code {proc.returncode}: {tail}")
                await asyncio.wait([joining], timeout=0.5)
            pg = joining.result()
            import torch

            flag = torch.zeros(1, dtype=torch.int32, device=self.sender_device)
            for r in range(repeats + 1):
                await self.thread(broadcast, pg, [flag], self.sender_device)
                t0 = time.perf_counter()
                for b in groups:
                    await self.thread(broadcast, pg, [t for _, t in b], self.sender_device)
                dt = time.perf_counter() - t0
                if r == 0:
                    m.warmup_s = dt
                else:
                    m.rounds_s.append(dt)
            await self.thread(proc.wait, 60)
        finally:
            if pg is not None:
                close_group(pg)
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        return m

    async def distributed(self, repeats: int, limit: int) -> Measurement:
        from rollout_backends._supervisor import free_port

        backend = self.fleet.backend
        named = self._on(self.named_cpu, self.sender_device)
        groups = buckets(named, limit)
        kind = "nccl" if self.gpu else "gloo"
        m = Measurement(
            kind,
            "init_weight_group + update_weights_from_distributed per bucket",
            nbytes(named),
            len(groups),
        )
        group = WeightGroup(
            master_address="127.0.0.1",
            master_port=free_port(),
            world_size=2,
            group_name="rb-bench",
            backend=kind,
        )
        sender: Any = None
        if self.gpu:

            def connect() -> Any:
                return open_group(kind, "127.0.0.1", group.master_port, 0, 2, group.group_name, _GROUP_TIMEOUT_S)

            def send(tensors: list[Any]) -> None:
                broadcast(sender, tensors, self.sender_device)

        else:
            from rollout_backends.adapters.reference import WeightSender

            ws = WeightSender("127.0.0.1", group.master_port, world_size=2, group_name=group.group_name)

            def connect() -> Any:
                ws.connect()
                return ws

            def send(tensors: list[Any]) -> None:
                ws.broadcast([(str(i), t) for i, t in enumerate(tensors)])

        try:
            sender, _ = await asyncio.wait_for(
                asyncio.gather(self.thread(connect), backend.init_weight_group(group)), max(1.0, self.left())
            )
            for r in range(repeats + 1):
                t0 = time.perf_counter()
                for b in groups:
                    bucket = WeightBucket.from_named_tensors(b)
                    await asyncio.gather(
                        backend.update_weights_from_distributed(bucket, group_name=group.group_name, flush_cache=False),
                        self.thread(send, [t for _, t in b]),
                    )
                dt = time.perf_counter() - t0
                if r == 0:
                    m.warmup_s = dt
                else:
                    m.rounds_s.append(dt)
            # Both ends leave together: a communicator's teardown may wait for its peer.
            close = self.thread(close_group if self.gpu else lambda ws: ws.close(), sender)
            sender = None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(backend.destroy_weight_group(group.group_name), close), 30.0)
        finally:
            if sender is not None:  # failed half-way: leave without waiting for the engine
                self.thread(close_group if self.gpu else lambda ws: ws.close(), sender)
        return m

    async def tensors(self, repeats: int, limit: int) -> Measurement:
        backend = self.fleet.backend
        named = self._on(self.named_cpu, self.engine_device)
        groups = buckets(named, limit)
        path = "update_weights_from_tensors per bucket, " + ("CUDA IPC, same GPU" if self.gpu else "shared memory")
        m = Measurement("tensors", path, nbytes(named), len(groups))
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            for b in groups:
                await backend.update_weights_from_tensors(b, flush_cache=False)
            dt = time.perf_counter() - t0
            if r == 0:
                m.warmup_s = dt
            else:
                m.rounds_s.append(dt)
        return m

    async def disk(self, repeats: int) -> Measurement:
        backend = self.fleet.backend
        size = sum(p.stat().st_size for p in Path(self.model_path).glob("*.safetensors"))
        m = Measurement("disk", "update_weights_from_disk (page cache warm)", size, 1)
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            await backend.update_weights_from_disk(self.model_path, flush_cache=False)
            dt = time.perf_counter() - t0
            if r == 0:
                m.warmup_s = dt
            else:
                m.rounds_s.append(dt)
        return m

    async def check_engine(self) -> str:
        gen = await self.fleet.backend.generate(
            GenerateRequest(input_ids=(1, 2, 3, 4), sampling=SamplingParams(max_new_tokens=4, temperature=0.0))
        )
        return f"the engine generated {len(gen.output_ids)} tokens after the updates"


async def _measure(r: _Run, transports: Sequence[str]) -> tuple[list[Measurement], list[str]]:
    args = r.args
    limit = int(args.bucket_mib * 2**20)
    notes: list[str] = []
    results: list[Measurement] = []
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.gather(r.start_engine(), r.thread(r.load_tensors)), max(1.0, r.left()))
    except Exception as exc:
        msg = report.summarise_error(exc)
        r.progress(f"engine did not start: {msg}")
        notes.append(f"the engine did not start: {msg}")
        return [Measurement(t, "", 0, 0, status="failed: no engine") for t in ("raw broadcast", *transports)], notes
    notes.append(f"engine start-up (and loading the tensors) {time.monotonic() - t0:.1f} s")
    r.progress(
        f"engine ready at {r.fleet.worker_urls[0]}; {nbytes(r.named_cpu) / 1e9:.3f} GB in {len(r.named_cpu)} tensors"
    )
    if r.gpu:
        # Set after the engine started (it keeps its own): a collective of ours that times out
        # must not abort this process before the report is written; a stuck thread is handled.
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    jobs: list[tuple[str, Callable[[], Awaitable[Measurement]]]] = [
        ("raw broadcast", lambda: r.raw(args.repeats, limit))
    ]
    # The group transport last: a collective that hangs can block the engine's other calls.
    for t in sorted(transports, key=lambda t: t in ("nccl", "gloo")):
        if t in ("nccl", "gloo"):
            jobs.append((t, lambda: r.distributed(args.repeats, limit)))
        elif t == "tensors":
            jobs.append((t, lambda: r.tensors(args.repeats, limit)))
        elif t == "disk":
            jobs.append((t, lambda: r.disk(args.repeats)))
    for name, job in jobs:
        if r.left() <= 1.0:
            results.append(Measurement(name, "", 0, 0, status="skipped: time budget"))
            r.progress(f"{name}: skipped (time budget)")
            continue
        cap = min(r.left(), args.transport_timeout_s)
        try:
            m = await asyncio.wait_for(job(), cap)
        except asyncio.TimeoutError:
            r.hung = True  # a thread may still sit in a collective: the process ends with os._exit
            results.append(Measurement(name, "", 0, 0, status=f"cut: no result in {cap:.0f} s"))
            r.progress(f"{name}: cut after {cap:.0f} s")
            continue
        except Exception as exc:
            msg = report.summarise_error(exc)
            results.append(Measurement(name, "", 0, 0, status=f"failed: {msg}"))
            r.progress(f"{name}: failed: {msg}")
            continue
        results.append(m)
        r.progress(
            f"{name}: {m.buckets} bucket(s), {m.nbytes / 1e9:.3f} GB, warm-up {m.warmup_s:.3f} s, "
            f"median {m.median_s:.3f} s over {len(m.rounds_s)}, {m.gb_per_s:.2f} GB/s"
        )
    if not r.hung:
        try:
            notes.append(await asyncio.wait_for(r.check_engine(), 60.0))
        except Exception as exc:
            notes.append(f"the engine did NOT answer after the updates: {type(exc).__name__}: {exc}")
    return results, notes


# -- reporting -------------------------------------------------------------------------------------


def _ordered(results: Sequence[Measurement]) -> list[Measurement]:
    return sorted(results, key=lambda m: _ORDER.index(m.transport) if m.transport in _ORDER else len(_ORDER))


def table(results: Sequence[Measurement]) -> str:
    base = next((m for m in results if m.transport == "raw broadcast" and m.rounds_s), None)
    rows = []
    for m in _ordered(results):
        if not m.rounds_s:
            rows.append([m.transport, m.path or "—", "—", "—", "—", "—", "—", "—", m.status])
            continue
        ratio = f"{m.median_s / base.median_s:.2f}{TIMES}" if base else "—"
        rows.append(
            [
                m.transport if m.transport == "raw broadcast" else f"adapter: {m.transport}",
                m.path,
                f"{m.nbytes / 1e9:.3f}",
                str(m.buckets),
                f"{m.warmup_s:.3f}" if m.warmup_s is not None else "—",
                f"{m.median_s:.4f} ({len(m.rounds_s)})",
                f"{m.gb_per_s:.2f}",
                ratio,
                "" if m.status == "ok" else m.status,
            ]
        )
    return report.md_table(
        ["transport", "what is timed", "GB", "buckets", "warm-up s", "median s (rounds)", "GB/s", "vs raw", "note"],
        rows,
        "llrrrrrrl",
    )


def targets(results: Sequence[Measurement]) -> list[tuple[str, bool, str]]:
    base = next((m for m in results if m.transport == "raw broadcast" and m.rounds_s), None)
    out: list[tuple[str, bool, str]] = []
    if base is None:
        return out
    for m in _ordered(results):
        if m.transport == "raw broadcast" or not m.rounds_s:
            continue
        ratio = m.median_s / base.median_s
        out.append(
            (
                f"adapter {m.transport} ≤ {TARGET_RATIO:.0f}{TIMES} raw broadcast",
                ratio <= TARGET_RATIO,
                f"{ratio:.2f}{TIMES} ({m.median_s:.3f} s vs {base.median_s:.3f} s)",
            )
        )
    return out


def plot(results: Sequence[Measurement], path: str, title: str) -> bool:
    """Write the PNG; False (and no file) when nothing was measured."""
    import matplotlib  # type: ignore[import-not-found,unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    shown = [m for m in _ordered(results) if m.rounds_s]
    if not shown:
        return False
    labels = [m.transport for m in shown]
    colors = ["#777777" if m.transport == "raw broadcast" else "#3b75af" for m in shown]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(labels, [m.median_s for m in shown], color=colors)
    axes[0].set_yscale("log")
    axes[0].set_title("seconds per full push, median (lower is better)", fontsize=9)
    axes[1].bar(labels, [m.gb_per_s for m in shown], color=colors)
    axes[1].set_title("GB/s (higher is better)", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def markdown(
    m: dict[str, Any], info: dict[str, Any], results: Sequence[Measurement], notes: Sequence[str], png: str | None
) -> str:
    lines = ["## Weight sync", ""]
    lines += report.meta_lines(m)
    lines += [
        f"- **Setup:** {info['setup']}",
        f"- **Model:** {info['model']}: {info['gb']:.3f} GB in {info['tensors']} tensors; "
        f"buckets ≤ {info['bucket_mib']:g} MiB; {info['repeats']} timed rounds after one warm-up round",
        f"- **Notes:** {'; '.join(notes)}",
        "",
        table(results),
        "",
    ]
    for name, met, detail in targets(results):
        lines.append(f"- {'MET' if met else 'NOT MET'}: {name}: {detail}")
    lines += [
        "",
        "*raw broadcast*: the same tensors, buckets and sender, to a bare receiver process on the engine's device "
        "that only receives into preallocated tensors (no engine, no HTTP, no loading). The adapter rows include "
        "the HTTP control call, the engine's receive and `load_weights`.",
        "",
    ]
    if png:
        lines += [f"![weight sync]({png})", ""]
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    raw_argv = list(argv) if argv is not None else sys.argv[1:]
    if raw_argv[:1] == ["--receive"]:
        return _receive(raw_argv[1])
    p = argparse.ArgumentParser(
        prog="rollout-backends bench weightsync",
        description="Weight sync through the adapter (distributed, tensors, disk) against a raw broadcast.",
    )
    p.add_argument("--engine", choices=("sglang", "reference"), default="reference")
    p.add_argument("--model-size", default=None, help="qwen2.5-0.5b (GPU default) or tiny (CPU default)")
    p.add_argument("--model-path", help="an existing model folder (default: make one)")
    p.add_argument("--gpus", default="0,1", help="engine GPU, sender GPU")
    p.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=None)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per transport (after one warm-up round)")
    p.add_argument("--bucket-mib", type=float, default=512.0)
    p.add_argument("--budget-s", type=float, default=150.0, help="the whole run, engine start-up included")
    p.add_argument("--transport-timeout-s", type=float, default=90.0, help="give up on one transport after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output folder (benchmarks.md, results.json, weightsync.png, weightsync-logs.tar.gz)")
    p.add_argument("--smoke", action="store_true", help="CPU: reference engine, gloo, tiny model, 2 rounds")
    args = p.parse_args(raw_argv)
    gpu = args.engine == "sglang"
    if args.smoke:
        if gpu:
            p.error("--smoke is for --engine reference")
        args.repeats = min(args.repeats, 2)
        args.budget_s = min(args.budget_s, 60.0)
    args.gpu_list = [x.strip() for x in args.gpus.split(",") if x.strip()]
    if gpu and len(args.gpu_list) != 2:
        p.error("--gpus takes two GPUs: the engine's and the sender's")
    transports = args.transports or (["nccl", "tensors", "disk"] if gpu else ["gloo", "tensors", "disk"])
    if ("nccl" in transports and not gpu) or ("gloo" in transports and gpu):
        p.error("nccl needs --engine sglang (GPUs); gloo is the CPU transport")
    size = args.model_size or ("qwen2.5-0.5b" if gpu else "tiny")
    if gpu:
        report.safe_multicast_env()
    progress = report.Progress("weightsync: ")
    started = time.time()
    code = 1
    r: _Run | None = None
    with tempfile.TemporaryDirectory(prefix="rb-weightsync-") as tmp:
        run_dir = Path(tmp)
        (run_dir / "logs").mkdir()
        model_path = args.model_path
        if model_path is None:
            from rollout_backends.adapters.reference import make_tiny_model

            progress(f"making the {size} model")
            model_path = str(make_tiny_model(run_dir / "model", seed=args.seed, size=size))
        r = _Run(args, model_path, run_dir, progress)

        async def go() -> tuple[list[Measurement], list[str]]:
            try:
                return await _measure(r, transports)
            finally:
                if r.fleet is not None:
                    await r.fleet.aclose()

        results, notes = asyncio.run(go())
        m = report.meta("python -m rollout_backends._bench.weightsync", argv, PACKAGES, started)
        m["duration_s"] = round(time.time() - started, 1)
        total = nbytes(r.named_cpu)
        setup = (
            f"engine: one SGLang worker on GPU {args.gpu_list[0]}; sender (this process) on GPU {args.gpu_list[1]} "
            "for nccl, on the engine's GPU for tensors"
            if gpu
            else "engine: one reference worker (CPU) behind no router; sender: this process"
        )
        info = {
            "setup": setup,
            "model": f"{size} bf16" + (f" ({model_path})" if args.model_path else ""),
            "gb": total / 1e9,
            "tensors": len(r.named_cpu),
            "bucket_mib": args.bucket_mib,
            "repeats": args.repeats,
        }
        print(f"\nWeight sync, {m['date']}, {m['machine']}, GPU: {m['gpu']}")
        print(f"{info['model']}: {total / 1e9:.3f} GB in {len(r.named_cpu)} tensors; {setup}\n")
        print(table(results))
        for name, met, detail in targets(results):
            print(f"- {'MET' if met else 'NOT MET'}: {name}: {detail}")
        print("; ".join(notes))
        print(f"\n({m['duration_s']} s)")
        if args.out:
            title = f"{m['gpu'] if gpu else m['machine']}; {m['date']}; {info['model']}, {total / 1e9:.2f} GB"
            report.write_outputs(
                args.out,
                KEY,
                plot=lambda path: plot(results, path, title),
                markdown=lambda png: markdown(m, info, results, notes, png),
                data={"meta": m, "info": info, "notes": notes, "results": [x.as_dict() for x in results]},
                log_dirs=[run_dir / "logs"],
            )
            out = Path(args.out)
            progress(f"wrote {', '.join(sorted(x.name for x in out.iterdir()))} in {out}")
        code = 0 if any(x.rounds_s for x in results if x.transport != "raw broadcast") else 1
    if r is not None and _stuck(r.pool):
        r.progress("a thread is still inside a collective: exiting without waiting for it")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # the engine and the receiver are stopped already
    return code


def _stuck(pool: ThreadPoolExecutor, wait_s: float = 5.0) -> bool:
    """Shut the pool down; True if one of its threads is still busy after ``wait_s``."""
    import threading

    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + wait_s
    for t in threading.enumerate():
        if t.name.startswith("weightsync"):
            t.join(max(0.0, deadline - time.monotonic()))
    return any(t.name.startswith("weightsync") and t.is_alive() for t in threading.enumerate())


if __name__ == "__main__":
    sys.exit(main())
