"""Weight sync: a model's weights pushed into a running engine through the adapter, each way
against a raw baseline of the same bytes measured in the same run, the rows interleaved.

* ``tensors`` (colocated, one family of five rows; CUDA IPC on GPU, shared memory on CPU):

  - ``tensors flat``: the library's path. ``rb.TensorBuckets`` copies the tensors into flat
    buffers it keeps from push to push, and ``update_weights_from_tensors(bucket)`` sends each
    bucket as SGLang's ``load_format="flattened_bucket"`` (one CUDA-IPC handle per bucket).
    Baseline ``sglang api flat``: SGLang's HTTP API directly, no library, as Miles' colocated
    update does it: per bucket ``FlattenedTensorBucket(named_tensors=...)`` (a fresh buffer, as
    Miles makes one) serialised by SGLang's ``MultiprocessingSerializer`` and posted with aiohttp.
  - ``tensors``: the per-tensor path (a handle per tensor), kept where an engine does not declare
    ``flattened_buckets``: the "before" of the flat buckets. Baseline ``raw tensors``: the same
    payload over a local socket to a bare receiver process with the engine's visibility, which
    rebuilds the tensors as SGLang's worker does (``monkey_patch_torch_reductions`` +
    ``MultiprocessingSerializer``; our decoder on CPU), copies them into preallocated tensors,
    synchronises and answers.
  - ``raw flat``: a flat bucket to that bare receiver, rebuilt as SGLang's weight updater does
    (``FlattenedTensorBucket(...).reconstruct_tensors()``) and copied: the floor of the flat path.

* ``disk``: ``update_weights_from_disk`` of the model folder (the file is in the page cache).
  Baseline ``raw disk``: the bare receiver loads the folder's safetensors files onto the engine's
  device (``safetensors.torch.load_file(..., device=...)``) and synchronises.
* ``nccl`` (GPU) / ``gloo`` (CPU): the trainer is rank 0 of a fresh ``torch.distributed`` group
  built without a default process group (the engine joins through ``init_weight_group``), and
  broadcasts each bucket while the adapter's ``update_weights_from_distributed(bucket)`` is in
  flight. On GPU the sender is on the second of ``--gpus``; with one GPU this transport is not run
  (NCCL refuses two ranks on one device). Baseline ``raw broadcast``: the same tensors, buckets
  and sender to a bare receiver process on the engine's device.

Buckets hold at most ``--bucket-mib`` MiB (512, as Miles). Each family runs in blocks: a block
pushes the whole model once per row, in a seeded random order; block 0 is a warm-up and is
discarded; ``--repeats`` blocks are timed. A row's ratio to its baseline is the ratio of its
total time over the blocks to the baseline's, with a 95 % t interval over blocks
(``stats.paired_ratio``); effective GB/s = the model's bytes / a push's wall time. Targets:
each adapter row ≤ 3 times its baseline (issue 7), ``disk`` ≤ 1.1 times ``raw disk`` and, on GPU,
``tensors flat`` ≥ 100 GB/s (issue 28), each judged only when the interval lies on one side.

Run: ``python -m rb_bench.weightsync --engine sglang --model-size qwen2.5-0.5b
--gpus 0 --out DIR`` (one GPU: tensors and disk), ``--gpus 0,1`` (two GPUs: nccl as well),
``--smoke`` (CPU: reference engine, gloo, tiny model), ``--dry-run`` (print the plan only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from rollout_backends import GenerateRequest, SamplingParams, WeightBucket, WeightGroup

from . import report, with_bench_path
from .fanout import _ready_printer
from .stats import Interval, judge, paired_ratio

__all__ = [
    "BASELINE",
    "FAMILIES",
    "TRANSPORTS",
    "Measurement",
    "Placement",
    "Pusher",
    "Row",
    "buckets",
    "comparisons",
    "interval",
    "main",
    "open_group",
    "placement",
    "plan",
    "ratio",
    "run_family",
    "sglang_flat_payload",
    "table",
    "targets",
]

KEY = "weightsync"
TRANSPORTS = ("nccl", "gloo", "tensors", "disk")
RAW_BROADCAST = "raw broadcast"
RAW_TENSORS = "raw tensors"
RAW_FLAT = "raw flat"
SGLANG_FLAT = "sglang api flat"
FLAT = "tensors flat"
FLAT_ONE = "tensors flat, one bucket"
RAW_DISK = "raw disk"
#: The rows of each ``--transports`` family, in table order (raw rows have no adapter in them).
FAMILIES: Mapping[str, tuple[str, ...]] = {
    "tensors": (RAW_TENSORS, "tensors", RAW_FLAT, SGLANG_FLAT, FLAT, FLAT_ONE),
    "disk": (RAW_DISK, "disk"),
    "nccl": (RAW_BROADCAST, "nccl"),
    "gloo": (RAW_BROADCAST, "gloo"),
}
RAW_ROWS = frozenset({RAW_BROADCAST, RAW_TENSORS, RAW_FLAT, SGLANG_FLAT, RAW_DISK})
#: The raw measurement each adapter row's ratio is against.
BASELINE: Mapping[str, str] = {
    "nccl": RAW_BROADCAST,
    "gloo": RAW_BROADCAST,
    "tensors": RAW_TENSORS,
    FLAT: SGLANG_FLAT,
    "disk": RAW_DISK,
}
NEEDS_SECOND_GPU = "not run: needs a second GPU"
NOT_SELECTED = "not run: not selected (--transports)"
#: Each adapter row against its own baseline (issue 7's goal), disk against a bare load (issue 28).
TARGET_RATIO: Mapping[str, float] = {"nccl": 3.0, "gloo": 3.0, "tensors": 3.0, FLAT: 3.0, "disk": 1.1}
#: Issue 28: colocated tensor updates through the library at this many GB/s or more (GPU only).
TARGET_GB_S = 100.0
TIMES = "\N{MULTIPLICATION SIGN}"
PACKAGES = ("torch", "sglang", "transformers", "safetensors", "aiohttp")
_GROUP_TIMEOUT_S = 120.0
#: Table order: each baseline above the adapter row measured against it (the run order differs).
_ORDER = (
    RAW_BROADCAST,
    "nccl",
    "gloo",
    RAW_TENSORS,
    "tensors",
    RAW_FLAT,
    SGLANG_FLAT,
    FLAT,
    FLAT_ONE,
    RAW_DISK,
    "disk",
)


# -- the plan: which rows run where (no torch needed; --dry-run prints it) --------------------------


@attrs.frozen
class Row:
    """One row of the table: a raw baseline (``baseline`` None) or an adapter row."""

    name: str
    baseline: str | None
    skip: str | None = None  # why it does not run; None: it runs


def group_transport(gpu: bool) -> str:
    return "nccl" if gpu else "gloo"


def plan(gpu: bool, n_gpus: int, transports: Sequence[str]) -> list[Row]:
    """Every row, in run order: the tensor family, disk, then the group transport.

    Rows that cannot or need not run stay in the table with the reason (never dropped). The group
    transport runs last: a collective that hangs can block the engine's other calls.
    """
    rows: list[Row] = []
    for t in ("tensors", "disk", group_transport(gpu)):
        skip = None
        if t not in transports:
            skip = NOT_SELECTED
        elif t == "nccl" and n_gpus < 2:
            skip = NEEDS_SECOND_GPU
        rows += [Row(name, BASELINE.get(name), skip) for name in FAMILIES[t]]
    return rows


def family_of(name: str) -> str:
    return next(f for f, names in FAMILIES.items() if name in names)


@attrs.frozen
class Placement:
    """Where each process's tensors live, by device index.

    This process sees every GPU (``run-bench.sh`` unsets ``CUDA_VISIBLE_DEVICES``); the engine and
    the bare receivers see only the engine's GPU, which is then their ``cuda:0``.
    """

    engine_gpu: str | None  # physical index: CUDA_VISIBLE_DEVICES of the engine and the receivers
    engine_device: str  # the engine's GPU as this process sees it
    sender_device: str  # the broadcast sender's device in this process (the engine's with one GPU)
    receiver_device: str  # the engine's GPU as the engine and the receivers see it


def placement(gpu: bool, gpu_list: Sequence[str]) -> Placement:
    if not gpu:
        return Placement(None, "cpu", "cpu", "cpu")
    engine = gpu_list[0]
    sender = gpu_list[1] if len(gpu_list) > 1 else engine
    return Placement(engine, f"cuda:{int(engine)}", f"cuda:{int(sender)}", "cuda:0")


def receiver_env(p: Placement, base: Mapping[str, str]) -> dict[str, str]:
    """A bare receiver's environment: the engine's GPU visibility (so device indices match it)."""
    env = dict(base)
    if p.engine_gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = p.engine_gpu
    else:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def receiver_command(flag: str, spec_path: str) -> list[str]:
    return [sys.executable, "-m", "rb_bench.weightsync", flag, spec_path]


def bare_spec(p: Placement, model_path: str, port_file: str, timeout_s: float) -> dict[str, Any]:
    """The bare receiver's job (``--serve``): the raw baselines of ``tensors`` and ``disk``."""
    return {
        "device": p.receiver_device,
        # As the engine decodes: SGLang's serializer with its torch patch on GPU (the CUDA-IPC
        # handles name their device by UUID), our decoder with the reference engine.
        "decoder": "sglang" if p.engine_gpu is not None else "ours",
        "model_path": model_path,
        "port_file": port_file,
        "timeout_s": timeout_s,
    }


def broadcast_spec(
    p: Placement, port: int, tensors: Sequence[tuple[str, Sequence[int]]], bucket_idx: list[list[int]], rounds: int
) -> dict[str, Any]:
    """The raw broadcast receiver's job (``--receive``): rank 1 of a two-rank group."""
    return {
        "backend": "nccl" if p.engine_gpu is not None else "gloo",
        "address": "127.0.0.1",
        "port": port,
        "group": "rb-bench-raw",
        "device": p.receiver_device,
        "tensors": [[dtype, list(shape)] for dtype, shape in tensors],
        "buckets": bucket_idx,
        "rounds": rounds,
    }


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


# -- the bare receivers (their own processes) ------------------------------------------------------


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


def send_msg(sock: socket.socket, obj: Any) -> None:
    """One message: 8 bytes of length, then JSON."""
    data = json.dumps(obj).encode()
    sock.sendall(len(data).to_bytes(8, "big") + data)


def recv_msg(sock: socket.socket) -> Any:
    """The next message; None when the peer closed the connection."""
    head = _recv_exact(sock, 8)
    if head is None:
        return None
    data = _recv_exact(sock, int.from_bytes(head, "big"))
    if data is None:
        return None
    return json.loads(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks: list[bytes] = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


#: A payload and its load format -> the (name, tensor) pairs the engine would load.
Decoder = Callable[[str, "str | None"], "list[tuple[str, Any]]"]


def _decoder(kind: str) -> Decoder:
    """How the engine rebuilds tensors from a payload: SGLang's ``TpModelWorker.update_weights_from_tensor``
    (``MultiprocessingSerializer.deserialize``, then for a flat bucket its weight updater's
    ``FlattenedTensorBucket(...).reconstruct_tensors()``), or our decoder (the reference engine's)."""
    if kind == "sglang":
        try:
            from sglang.srt.utils import MultiprocessingSerializer  # type: ignore[import-not-found,unused-ignore]
            from sglang.srt.utils.patch_torch import (  # type: ignore[import-not-found,unused-ignore]
                monkey_patch_torch_reductions,
            )
            from sglang.srt.weight_sync.tensor_bucket import (  # type: ignore[import-not-found,unused-ignore]
                FlattenedTensorBucket,
                FlattenedTensorMetadata,
            )
        except Exception as exc:  # as the sender: without SGLang no UUID patch on either side
            print(f"no SGLang here ({type(exc).__name__}: {exc}); our decoder", flush=True)
        else:
            monkey_patch_torch_reductions()

            def sglang_decode(payload: str, load_format: str | None) -> list[tuple[str, Any]]:
                obj = MultiprocessingSerializer.deserialize(payload)
                if load_format != "flattened_bucket":
                    return list(obj)
                meta = [
                    FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel)
                    for m in obj["metadata"]
                ]
                bucket = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=meta)
                return list(bucket.reconstruct_tensors())

            return sglang_decode
    from rollout_backends.kit import decode_tensor_payload

    return decode_tensor_payload


class BareReceiver:
    """What ``--serve`` does with each message: the raw ``tensors``, ``flat`` and ``disk`` baselines.

    No engine, no HTTP: tensors are rebuilt from the payload and copied into tensors allocated
    once, files are loaded onto the device; each answer is sent after the device is synchronised.
    """

    def __init__(self, device: Any, model_path: str, decode: Decoder) -> None:
        import torch
        from safetensors.torch import load_file

        self.device = device
        self.decode = decode
        self.bufs: dict[str, Any] = {}
        for f in sorted(Path(model_path).glob("*.safetensors")):
            for name, t in load_file(str(f)).items():
                self.bufs[name] = torch.empty(t.shape, dtype=t.dtype, device=device)
        self.sync()

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def handle(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op in ("tensors", "flat"):
            named = self.decode(msg["payload"], "flattened_bucket" if op == "flat" else None)
            n = 0
            for name, t in named:
                buf = self.bufs[name]
                if tuple(buf.shape) != tuple(t.shape) or buf.dtype != t.dtype:
                    raise ValueError(f"{name}: got {t.dtype} {tuple(t.shape)}, expected {buf.dtype} {tuple(buf.shape)}")
                buf.copy_(t, non_blocking=True)
                n += t.numel() * t.element_size()
            self.sync()  # the copies are done before the answer; then the sender's memory is free
            count = len(named)
            del named  # as the engine: the rebuilt tensors go once loaded
            return {"ok": True, "tensors": count, "bytes": n}
        if op == "disk":
            from safetensors.torch import load_file

            loaded = [
                load_file(str(f), device=str(self.device)) for f in sorted(Path(msg["path"]).glob("*.safetensors"))
            ]
            self.sync()
            n = sum(t.numel() * t.element_size() for d in loaded for t in d.values())
            return {"ok": True, "tensors": sum(len(d) for d in loaded), "bytes": n}
        if op == "checksum":
            return {"ok": True, "sums": {name: checksum(t) for name, t in self.bufs.items()}}
        raise ValueError(f"unknown op {op!r}")


def checksum(t: Any) -> list[float]:
    """Sum and sum of magnitudes (float32): the receiver's copy against the sender's tensor."""
    x = t.float()
    return [float(x.sum()), float(x.abs().sum())]


def checksums_match(a: Sequence[float], b: Sequence[float]) -> bool:
    return abs(a[0] - b[0]) <= 1e-3 * (a[1] + b[1] + 1.0) and abs(a[1] - b[1]) <= 1e-3 * (a[1] + b[1] + 1.0)


def _serve(spec_path: str) -> int:
    """``--serve SPEC``: the bare receiver of the raw ``tensors`` and ``disk`` baselines.

    Listens on a port of its own choosing (written to ``port_file``, so no port race), takes one
    connection and answers one message at a time until ``bye`` or the sender goes; every socket
    wait has the spec's timeout, so a lost sender cannot keep it alive.
    """
    import torch

    spec = json.loads(Path(spec_path).read_text())
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    receiver = BareReceiver(device, spec["model_path"], _decoder(spec["decoder"]))
    print(f"ready on {device}: {len(receiver.bufs)} tensors allocated", flush=True)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.settimeout(spec["timeout_s"])
        port_file = Path(spec["port_file"])
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(srv.getsockname()[1]))
        tmp.replace(port_file)  # whole, or not there
        conn, _ = srv.accept()
    with conn:
        conn.settimeout(spec["timeout_s"])
        served = 0
        while True:
            msg = recv_msg(conn)
            if msg is None or msg.get("op") == "bye":
                break
            try:
                reply = receiver.handle(msg)
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                print(f"error: {reply['error']}", flush=True)
            send_msg(conn, reply)
            served += 1
    print(f"done: {served} messages", flush=True)
    return 0


class BareClient:
    """This process's end of the ``--serve`` receiver: blocking calls, each with a timeout (run in threads)."""

    def __init__(self, proc: subprocess.Popen[bytes], port_file: Path, log: Path) -> None:
        self.proc = proc
        self.port_file = port_file
        self.log = log
        self.sock: socket.socket | None = None

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-600:]
        return ""

    def _alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the bare receiver exited with code {self.proc.returncode}: {self.tail()}")

    def connect(self, timeout_s: float) -> None:
        if self.sock is not None:
            return
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            self._alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the bare receiver was not ready in {timeout_s:.0f} s: {self.tail()}")
            time.sleep(0.05)
        port = int(self.port_file.read_text())
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=max(1.0, deadline - time.monotonic()))

    def request(self, msg: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        if self.sock is None:
            raise RuntimeError("not connected to the bare receiver")
        self.sock.settimeout(timeout_s)  # a receiver that hangs frees this thread after timeout_s
        send_msg(self.sock, msg)
        reply = recv_msg(self.sock)
        if reply is None:
            self._alive()
            raise RuntimeError(f"the bare receiver closed the connection: {self.tail()}")
        if not reply.get("ok"):
            raise RuntimeError(f"the bare receiver failed: {reply.get('error')}")
        return dict(reply)

    def stop(self) -> None:
        """``bye`` and a short wait for its exit when connected; else (or then) kill it."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.settimeout(5.0)
                send_msg(self.sock, {"op": "bye"})
            self.sock.close()
            self.sock = None
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)


def spawn(flag: str, spec: Mapping[str, Any], p: Placement, run_dir: Path, name: str) -> subprocess.Popen[bytes]:
    """Start a receiver process (``--receive`` or ``--serve``) with its spec file and its log."""
    path = run_dir / f"{name}.json"
    path.write_text(json.dumps(spec))
    log = open(run_dir / "logs" / f"{name}.log", "wb")  # noqa: SIM115 - closed by the child's exit
    try:
        return subprocess.Popen(
            receiver_command(flag, str(path)),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=with_bench_path(receiver_env(p, os.environ)),
            start_new_session=True,
        )
    finally:
        log.close()


# -- measuring -------------------------------------------------------------------------------------


@attrs.frozen
class Measurement:
    transport: str  # the row: an adapter transport or a raw baseline
    path: str
    nbytes: int
    buckets: int
    rounds_s: tuple[float, ...] = ()
    warmup_s: float | None = None
    status: str = "ok"
    baseline: str | None = None  # the raw row this row's ratio is against (None: it is a baseline)

    @property
    def median_s(self) -> float:
        return statistics.median(self.rounds_s) if self.rounds_s else float("nan")

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / 1e9 / self.median_s if self.rounds_s else float("nan")

    def as_dict(self) -> dict[str, Any]:
        ok = bool(self.rounds_s)
        return {
            **attrs.asdict(self),
            "median_s": self.median_s if ok else None,
            "gb_per_s": self.gb_per_s if ok else None,
        }


@attrs.define
class Pusher:
    """One row, ready to run: ``push`` moves the whole model once (timed); ``before`` (untimed)
    runs ahead of each push; ``close`` and ``check`` (a note) run after the blocks."""

    what: str
    nbytes: int
    buckets: int
    push: Callable[[], Awaitable[None]]
    before: Callable[[], Awaitable[None]] | None = None
    close: Callable[[], Awaitable[None]] | None = None
    check: Callable[[], Awaitable[str]] | None = None


class _Run:
    """Everything one benchmark run holds: the engine, the tensors, the devices, the bare receiver."""

    def __init__(self, args: argparse.Namespace, model_path: str, run_dir: Path, progress: report.Progress) -> None:
        self.args = args
        self.gpu = args.engine == "sglang"
        self.place = placement(self.gpu, args.gpu_list)
        self.model_path = model_path
        self.run_dir = run_dir
        self.progress = progress
        self.fleet: Any = None
        self.bare: BareClient | None = None
        self.named_cpu: list[tuple[str, Any]] = []
        self.named_engine: list[tuple[str, Any]] = []  # on the engine's device: what the tensor rows send
        self.sender_device: Any = None
        self.engine_device: Any = None
        self.hung = False
        self.limit = int(args.bucket_mib * 2**20)
        # Blocking calls (collectives, sockets) run in a pool of our own, never joined by
        # asyncio.run: one stuck past the budget cannot keep this process alive (see main).
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="weightsync")
        self.deadline: float = time.monotonic() + float(args.budget_s) - (20.0 if self.gpu else 4.0)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def call_timeout(self) -> float:
        """A blocking call's own limit: a thread never outlives its transport's cap by much."""
        return max(1.0, min(self.left(), float(self.args.transport_timeout_s)))

    def thread(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    def sync(self, device: Any) -> None:
        import torch

        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    # -- set-up

    def load_tensors(self) -> None:
        import torch
        from safetensors.torch import load_file

        self.named_cpu = list(load_file(str(Path(self.model_path) / "model.safetensors")).items())
        self.engine_device = torch.device(self.place.engine_device)
        self.sender_device = torch.device(self.place.sender_device)
        if self.gpu:
            torch.cuda.set_device(self.sender_device)
            try:  # CUDA IPC handles name their device by UUID, which SGLang's engine maps back
                from sglang.srt.utils.patch_torch import (  # type: ignore[import-not-found,unused-ignore]
                    monkey_patch_torch_reductions,
                )

                monkey_patch_torch_reductions()
            except Exception:  # without SGLang here the device index travels (right when both see GPU 0 as 0)
                pass
        # One copy on the engine's device, the trainer's tensors of a colocated step: every tensor
        # row sends (or packs) these.
        self.named_engine = self._on(self.named_cpu, self.engine_device)
        self.sync(self.engine_device)

    async def start_engine(self) -> None:
        from rollout_backends.adapters.sglang import SGLangFleetConfig, start_sglang_fleet

        cfg = SGLangFleetConfig(
            model_path=self.model_path,
            workers=1,
            worker_kind="sglang" if self.gpu else "reference",
            router="none",
            cuda_visible_devices=(self.place.engine_gpu,) if self.place.engine_gpu is not None else None,
            mem_fraction_static=0.5 if self.gpu else None,
            log_dir=str(self.run_dir / "logs"),
            startup_timeout_s=max(10.0, self.left()),
        )
        self.fleet = await start_sglang_fleet(cfg, progress=_ready_printer(self.progress, "engine"))

    def start_bare(self) -> None:
        """Start the bare receiver now (it imports torch and allocates while the engine starts)."""
        port_file = self.run_dir / "bare-receiver.port"
        spec = bare_spec(self.place, self.model_path, str(port_file), float(self.args.budget_s) + 60.0)
        proc = spawn("--serve", spec, self.place, self.run_dir, "bare-receiver")
        self.bare = BareClient(proc, port_file, self.run_dir / "logs" / "bare-receiver.log")

    async def bare_ready(self) -> BareClient:
        if self.bare is None:
            raise RuntimeError("no bare receiver")
        await self.thread(self.bare.connect, self.call_timeout())
        return self.bare

    def _on(self, named: Sequence[tuple[str, Any]], device: Any) -> list[tuple[str, Any]]:
        return [(n, t.to(device).contiguous()) for n, t in named]

    def prepare(self, name: str, blocks: int) -> Awaitable[Pusher]:
        jobs: dict[str, Callable[[], Awaitable[Pusher]]] = {
            RAW_BROADCAST: lambda: self.prep_raw_broadcast(blocks),
            "nccl": self.prep_group,
            "gloo": self.prep_group,
            RAW_TENSORS: lambda: self.prep_bare("tensors"),
            RAW_FLAT: lambda: self.prep_bare("flat"),
            SGLANG_FLAT: self.prep_sglang_flat,
            "tensors": self.prep_tensors,
            FLAT: lambda: self.prep_flat(self.limit),
            FLAT_ONE: lambda: self.prep_flat(nbytes(self.named_engine) + 256 * len(self.named_engine)),
            RAW_DISK: self.prep_raw_disk,
            "disk": self.prep_disk,
        }
        return jobs[name]()

    # -- the tensor rows (colocated: the sender's tensors are on the engine's GPU)

    async def prep_bare(self, op: str) -> Pusher:
        """``raw tensors`` / ``raw flat``: the payload to the bare receiver, rebuilt and copied there."""
        from rollout_backends import TensorBuckets
        from rollout_backends.kit import serialize_flat_bucket, serialize_named_tensors

        bare = await self.bare_ready()
        timeout = self.call_timeout()
        groups = buckets(self.named_engine, self.limit)
        packer = TensorBuckets(self.limit)

        def payloads() -> list[tuple[str, int]]:
            if op == "flat":
                return [(serialize_flat_bucket(b), len(b.slots)) for b in packer.pack(self.named_engine)]
            return [(serialize_named_tensors(b), len(b)) for b in groups]

        def send() -> None:
            for payload, n in payloads():
                reply = bare.request({"op": op, "payload": payload}, timeout)
                if reply.get("tensors") != n:
                    raise RuntimeError(f"the bare receiver copied {reply.get('tensors')} tensors of {n}")

        async def push() -> None:
            await self.thread(send)

        async def check() -> str:
            note: str = await self.thread(self.check_copies, bare, timeout)
            return f"{op}: {note}"

        how = "CUDA IPC, same GPU" if self.gpu else "shared memory"
        what = (
            f"a flat bucket per bucket ({how}) to a bare receiver: SGLang's reconstruct, copy, synchronise"
            if op == "flat"
            else f"serialize_named_tensors per bucket ({how}) to a bare receiver: rebuild, copy, synchronise"
        )
        return Pusher(what, nbytes(self.named_engine), len(groups), push, check=check)

    def check_copies(self, bare: BareClient, timeout: float) -> str:
        """Untimed: the receiver's tensors hold what was sent (it really copied the bytes)."""
        sums = bare.request({"op": "checksum"}, timeout)["sums"]
        bad = [n for n, t in self.named_engine if n not in sums or not checksums_match(checksum(t), sums[n])]
        if bad:
            raise RuntimeError(f"the bare receiver's copies differ from what was sent: {bad[:3]}")
        return f"the bare receiver's copies of all {len(sums)} tensors match what was sent"

    async def prep_sglang_flat(self) -> Pusher:
        """SGLang's HTTP API directly, as Miles' colocated update: a FlattenedTensorBucket per bucket."""
        import aiohttp

        url = f"{self.fleet.worker_urls[0]}/update_weights_from_tensor"
        groups = buckets(self.named_engine, self.limit)
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.call_timeout()))

        async def push() -> None:
            for b in groups:
                payload, keep = sglang_flat_payload(b)
                body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket", "flush_cache": False}
                async with session.post(url, json=body) as resp:
                    answer = await resp.json(content_type=None)
                del keep  # the bucket lives until the engine answered
                if resp.status != 200 or not answer.get("success"):
                    raise RuntimeError(f"HTTP {resp.status}: {answer}")

        what = "SGLang API directly: FlattenedTensorBucket + MultiprocessingSerializer per bucket, aiohttp POST"
        return Pusher(what, nbytes(self.named_engine), len(groups), push, close=session.close)

    async def prep_tensors(self) -> Pusher:
        backend = self.fleet.backend
        groups = buckets(self.named_engine, self.limit)

        async def push() -> None:
            for b in groups:
                await backend.update_weights_from_tensors(b, flush_cache=False)

        what = "update_weights_from_tensors per bucket, per tensor, " + ("CUDA IPC" if self.gpu else "shared memory")
        return Pusher(what, nbytes(self.named_engine), len(groups), push)

    async def prep_flat(self, limit: int) -> Pusher:
        """The library's flat path with buckets of at most ``limit`` bytes (FLAT_ONE: the whole
        model in one bucket, one call, one handle, a model-sized buffer)."""
        from rollout_backends import TensorBuckets

        backend = self.fleet.backend
        if not backend.capabilities.flattened_buckets:
            raise RuntimeError("the engine does not declare flattened_buckets")
        packer = TensorBuckets(limit)

        async def push() -> None:
            for b in packer.pack(self.named_engine):
                await backend.update_weights_from_tensors(b, flush_cache=False)

        what = "TensorBuckets.pack (reused buffers) + update_weights_from_tensors(FlatBucket) per bucket"
        n = len(packer.pack(self.named_engine))
        return Pusher(what, nbytes(self.named_engine), n, push, close=_async(packer.release))

    # -- disk

    async def prep_raw_disk(self) -> Pusher:
        bare = await self.bare_ready()
        size = sum(p.stat().st_size for p in Path(self.model_path).glob("*.safetensors"))
        timeout = self.call_timeout()

        async def push() -> None:
            reply = await self.thread(bare.request, {"op": "disk", "path": self.model_path}, timeout)
            if not reply.get("bytes"):
                raise RuntimeError("the bare receiver loaded nothing")

        what = f"safetensors load_file(device={self.place.receiver_device}) of the folder + synchronise, bare process"
        return Pusher(what + " (page cache warm)", size, 1, push)

    async def prep_disk(self) -> Pusher:
        backend = self.fleet.backend
        size = sum(p.stat().st_size for p in Path(self.model_path).glob("*.safetensors"))

        async def push() -> None:
            await backend.update_weights_from_disk(self.model_path, flush_cache=False)

        return Pusher("update_weights_from_disk (page cache warm)", size, 1, push)

    # -- the group transport

    async def prep_raw_broadcast(self, blocks: int) -> Pusher:
        import torch

        from rollout_backends.launch import free_port

        named = self._on(self.named_cpu, self.sender_device)
        self.sync(self.sender_device)
        groups = buckets(named, self.limit)
        index = {n: i for i, (n, _) in enumerate(named)}
        shapes = [(str(t.dtype).removeprefix("torch."), list(t.shape)) for _, t in named]
        port = free_port()
        spec = broadcast_spec(self.place, port, shapes, [[index[n] for n, _ in b] for b in groups], blocks + 1)
        proc = spawn("--receive", spec, self.place, self.run_dir, "raw-receiver")
        try:
            joining = self.thread(
                open_group, spec["backend"], "127.0.0.1", port, 0, 2, "rb-bench-raw", _GROUP_TIMEOUT_S
            )
            while not joining.done():  # a receiver that dies would leave rank 0 waiting for it
                if proc.poll() is not None:
                    self.hung = True
                    tail = (self.run_dir / "logs" / "raw-receiver.log").read_text(errors="replace")[-600:]
                    raise RuntimeError(f"the raw receiver exited with code {proc.returncode}: {tail}")
                await asyncio.wait([joining], timeout=0.5)
            pg = joining.result()
        except BaseException:
            _kill(proc)
            raise
        flag = torch.zeros(1, dtype=torch.int32, device=self.sender_device)

        async def in_step() -> None:  # untimed: both sides in step before each timed round
            await self.thread(broadcast, pg, [flag], self.sender_device)

        async def push() -> None:
            for b in groups:
                await self.thread(broadcast, pg, [t for _, t in b], self.sender_device)

        async def close() -> None:
            close_group(pg)
            _kill(proc)

        where = f"{self.place.sender_device} to a bare receiver on {self.place.engine_device}"
        what = f"torch.distributed.broadcast ({spec['backend']}), {where}"
        return Pusher(what, nbytes(named), len(groups), push, before=in_step, close=close)

    async def prep_group(self) -> Pusher:
        from rollout_backends.launch import free_port

        backend = self.fleet.backend
        named = self._on(self.named_cpu, self.sender_device)
        self.sync(self.sender_device)
        groups = buckets(named, self.limit)
        kind = group_transport(self.gpu)
        group = WeightGroup(
            master_address="127.0.0.1", master_port=free_port(), world_size=2, group_name="rb-bench", backend=kind
        )
        connect, send, leave = self._sender(group)
        sender, _ = await asyncio.wait_for(
            asyncio.gather(self.thread(connect), backend.init_weight_group(group)), max(1.0, self.left())
        )

        async def push() -> None:
            for b in groups:
                bucket = WeightBucket.from_named_tensors(b)
                await asyncio.gather(
                    backend.update_weights_from_distributed(bucket, group_name=group.group_name, flush_cache=False),
                    self.thread(send, sender, [t for _, t in b]),
                )

        async def close() -> None:
            # Both ends leave together: a communicator's teardown may wait for its peer.
            with contextlib.suppress(Exception):
                leaving = self.thread(leave, sender)
                await asyncio.wait_for(asyncio.gather(backend.destroy_weight_group(group.group_name), leaving), 30.0)

        what = "init_weight_group + update_weights_from_distributed per bucket"
        return Pusher(what, nbytes(named), len(groups), push, close=close)

    def _sender(
        self, group: WeightGroup
    ) -> tuple[Callable[[], Any], Callable[[Any, list[Any]], None], Callable[[Any], None]]:
        """The trainer's end of ``group``: (connect, send a bucket, leave)."""
        if self.gpu:
            return (
                lambda: open_group("nccl", "127.0.0.1", group.master_port, 0, 2, group.group_name, _GROUP_TIMEOUT_S),
                lambda pg, tensors: broadcast(pg, tensors, self.sender_device),
                close_group,
            )
        from rollout_backends.adapters.reference import WeightSender

        def connect() -> Any:
            ws = WeightSender("127.0.0.1", group.master_port, world_size=2, group_name=group.group_name)
            ws.connect()
            return ws

        return (
            connect,
            lambda ws, tensors: ws.broadcast([(str(i), t) for i, t in enumerate(tensors)]),
            lambda ws: ws.close(),
        )

    async def check_engine(self) -> str:
        gen = await self.fleet.backend.generate(
            GenerateRequest(input_ids=(1, 2, 3, 4), sampling=SamplingParams(max_new_tokens=4, temperature=0.0))
        )
        return f"the engine generated {len(gen.output_ids)} tokens after the updates"


def sglang_flat_payload(named: Sequence[tuple[str, Any]]) -> tuple[str, Any]:
    """Miles' colocated payload built with SGLang's own classes (``FlattenedTensorBucket``,
    ``MultiprocessingSerializer``): (the string, what must stay alive until the engine answers).
    Without SGLang (the CPU smoke) the same thing by hand: a ``torch.cat`` of the tensors' bytes and
    SGLang's metadata fields."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer  # type: ignore[import-not-found,unused-ignore]
        from sglang.srt.weight_sync.tensor_bucket import (  # type: ignore[import-not-found,unused-ignore]
            FlattenedTensorBucket,
        )
    except (ImportError, KeyError):
        # SGLang's wheel without its CUDA stack (the CPU venv's sglang-parsers extra): the first import
        # fails on triton, a later one on the half-initialised package (KeyError: 'sglang').
        import base64
        import io
        import types
        from multiprocessing.reduction import ForkingPickler

        import torch
        import torch.multiprocessing as tmp

        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named])
        meta, start = [], 0
        for name, t in named:
            n = t.numel() * t.element_size()
            meta.append(
                types.SimpleNamespace(
                    name=name, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=start + n, numel=n
                )
            )
            start += n
        data: Any = {"flattened_tensor": flat, "metadata": meta}
        tmp.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
        buf = io.BytesIO()
        ForkingPickler(buf).dump(data)  # MultiprocessingSerializer.serialize(data, output_str=True)
        return base64.b64encode(buf.getvalue()).decode("ascii"), data
    bucket = FlattenedTensorBucket(named_tensors=list(named))
    data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    return MultiprocessingSerializer.serialize(data, output_str=True), data


def _async(fn: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    async def call() -> None:
        fn()

    return call


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


async def run_family(r: _Run, rows: Sequence[Row]) -> tuple[list[Measurement], list[str]]:
    """Prepare each row, then blocks of one push per row in a seeded random order; block 0 is a
    warm-up. A row that fails or hangs leaves the blocks (its status says why); the others go on."""
    blocks = int(r.args.repeats)
    results: dict[str, Measurement] = {}
    notes: list[str] = []
    pushers: dict[str, Pusher] = {}
    for row in rows:
        try:
            pushers[row.name] = await asyncio.wait_for(
                r.prepare(row.name, blocks), min(r.left(), r.args.transport_timeout_s)
            )
        except Exception as exc:
            results[row.name] = _failed(row, f"failed: {report.summarise_error(exc)}", r)
    times: dict[str, list[float]] = {n: [] for n in pushers}
    rng = random.Random(f"{r.args.seed}-{family_of(rows[0].name)}")
    for block in range(blocks + 1):
        if r.left() <= 1.0 or not pushers:
            notes.append(f"{family_of(rows[0].name)}: stopped after {block} block(s) (time budget)")
            break
        order = sorted(pushers)
        rng.shuffle(order)
        for name in order:
            try:
                times[name].append(await _timed(pushers[name], min(r.left(), r.args.transport_timeout_s)))
            except Exception as exc:
                hung = isinstance(exc, asyncio.TimeoutError)
                r.hung = r.hung or hung
                if hung and name in (RAW_TENSORS, RAW_FLAT, RAW_DISK) and r.bare is not None:
                    r.bare.kill()  # its socket call then fails at once; the other bare rows fail fast
                why = "cut: no result in time" if hung else f"failed: {report.summarise_error(exc)}"
                results[name] = _failed(next(x for x in rows if x.name == name), why, r)
                r.progress(f"{name}: {why}")
                await _finish(pushers.pop(name), notes)
    for name, p in pushers.items():
        got = times[name]
        results[name] = Measurement(
            name, p.what, p.nbytes, p.buckets, tuple(got[1:]), got[0] if got else None,
            status="ok" if len(got) > 1 else "skipped: time budget", baseline=BASELINE.get(name),
        )  # fmt: skip
        r.progress(
            f"{name}: {len(got) - 1} block(s), median {results[name].median_s:.4f} s, {results[name].gb_per_s:.2f} GB/s"
        )
        await _finish(p, notes)
    return [results[x.name] for x in rows], notes


async def _timed(p: Pusher, cap: float) -> float:
    if p.before is not None:
        await asyncio.wait_for(p.before(), cap)
    t0 = time.perf_counter()
    await asyncio.wait_for(p.push(), cap)
    return time.perf_counter() - t0


async def _finish(p: Pusher, notes: list[str]) -> None:
    """After the blocks (untimed): the row's check, then its teardown; failures become notes."""
    try:
        if p.check is not None:
            notes.append(await asyncio.wait_for(p.check(), 60.0))
    except Exception as exc:
        notes.append(f"check failed: {report.summarise_error(exc)}")
    if p.close is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(p.close(), 60.0)


def _failed(row: Row, status: str, r: _Run) -> Measurement:
    return Measurement(row.name, "", 0, 0, status=status, baseline=row.baseline)


async def _measure(r: _Run, rows: Sequence[Row]) -> tuple[list[Measurement], list[str]]:
    notes: list[str] = []
    results: list[Measurement] = []
    runs = [x for x in rows if x.skip is None]
    t0 = time.monotonic()
    if any(x.name in (RAW_TENSORS, RAW_FLAT, RAW_DISK) for x in runs):
        try:
            r.start_bare()
        except Exception as exc:  # its rows fail ("no bare receiver"); the adapter rows still run
            notes.append(f"the bare receiver did not start: {report.summarise_error(exc)}")
    try:
        await asyncio.wait_for(asyncio.gather(r.start_engine(), r.thread(r.load_tensors)), max(1.0, r.left()))
    except Exception as exc:
        msg = report.summarise_error(exc)
        r.progress(f"engine did not start: {msg}")
        notes.append(f"the engine did not start: {msg}")
        return [
            Measurement(x.name, "", 0, 0, status=x.skip or "failed: no engine", baseline=x.baseline) for x in rows
        ], notes
    notes.append(f"engine start-up (and loading the tensors) {time.monotonic() - t0:.1f} s")
    r.progress(
        f"engine ready at {r.fleet.worker_urls[0]}; {nbytes(r.named_cpu) / 1e9:.3f} GB in {len(r.named_cpu)} tensors"
    )
    if r.gpu:
        # Set after the engine started (it keeps its own): a collective of ours that times out
        # must not abort this process before the report is written; a stuck thread is handled.
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    for fam in ("tensors", "disk", group_transport(r.gpu)):
        family = [x for x in rows if x.name in FAMILIES[fam]]
        todo = [x for x in family if x.skip is None]
        done: dict[str, Measurement] = {}
        if todo and r.left() > 1.0:
            measured, more = await run_family(r, todo)
            done = {m.transport: m for m in measured}
            notes += more
        for x in family:
            status = x.skip or "skipped: time budget"
            results.append(done.get(x.name) or Measurement(x.name, "", 0, 0, status=status, baseline=x.baseline))
    if not r.hung:
        try:
            notes.append(await asyncio.wait_for(r.check_engine(), 60.0))
        except Exception as exc:
            notes.append(f"the engine did NOT answer after the updates: {type(exc).__name__}: {exc}")
    return results, notes


# -- reporting -------------------------------------------------------------------------------------


def _ordered(results: Sequence[Measurement]) -> list[Measurement]:
    return sorted(results, key=lambda m: _ORDER.index(m.transport) if m.transport in _ORDER else len(_ORDER))


def _label(m: Measurement) -> str:
    return m.transport if m.transport in RAW_ROWS else f"adapter: {m.transport}"


def _measured(name: str | None, results: Sequence[Measurement]) -> Measurement | None:
    return next((b for b in results if b.transport == name and b.rounds_s), None)


def interval(m: Measurement, results: Sequence[Measurement]) -> Interval | None:
    """``m`` over its baseline, paired by block (both rows ran in the same blocks), with its 95 %
    t interval; None for a baseline or where either was not measured."""
    base = _measured(m.baseline, results)
    if base is None or not m.rounds_s:
        return None
    n = min(len(m.rounds_s), len(base.rounds_s))  # equal unless one row left the blocks
    return paired_ratio(m.rounds_s[:n], base.rounds_s[:n])


def ratio(m: Measurement, results: Sequence[Measurement]) -> float | None:
    """The point estimate of :func:`interval` (total time over total time)."""
    iv = interval(m, results)
    return None if iv is None else iv.estimate


def table(results: Sequence[Measurement]) -> str:
    rows = []
    for m in _ordered(results):
        base = m.baseline or "—"
        if not m.rounds_s:
            rows.append([_label(m), m.path or "—", "—", "—", "—", "—", "—", base, "—", m.status])
            continue
        iv = interval(m, results)
        rows.append(
            [
                _label(m),
                m.path,
                f"{m.nbytes / 1e9:.3f}",
                str(m.buckets),
                f"{m.warmup_s:.4f}" if m.warmup_s is not None else "—",
                f"{m.median_s:.4f} ({len(m.rounds_s)})",
                f"{m.gb_per_s:.2f}",
                base,
                iv.format(2) if iv is not None else "—",
                ("" if m.status == "ok" else m.status)
                + ("" if iv is not None or m.baseline is None else f"baseline {m.baseline} not measured"),
            ]
        )
    return report.md_table(
        [
            "row",
            "what is timed",
            "GB",
            "buckets",
            "warm-up s",
            "median s (blocks)",
            "GB/s",
            "baseline",
            "vs baseline [95 % CI]",
            "note",
        ],
        rows,
        "llrrrrrlrl",
    )


def targets(results: Sequence[Measurement], gpu: bool = False) -> list[tuple[str, bool | None, str]]:
    """Each goal: (goal, met / missed / None if not decided or not run, detail). Each adapter row
    against its own baseline (``TARGET_RATIO``), and on GPU ``tensors flat`` ≥ ``TARGET_GB_S``."""
    out: list[tuple[str, bool | None, str]] = []
    for m in _ordered(results):
        if m.baseline is None:
            continue
        bound = TARGET_RATIO[m.transport]
        goal = f"adapter {m.transport} ≤ {bound:g}{TIMES} {m.baseline}"
        iv = interval(m, results)
        if iv is None:
            base = next((b for b in results if b.transport == m.baseline), None)
            why = m.status if not m.rounds_s else f"{m.baseline}: {base.status if base else 'absent'}"
            out.append((goal, None, f"not judged ({why})"))
            continue
        out.append((goal, *_judged(goal, iv, bound)))
    flat = _measured(FLAT, results)
    if gpu:
        goal = f"adapter {FLAT} ≥ {TARGET_GB_S:g} GB/s effective"
        if flat is None:
            out.append((goal, None, "not judged (not measured)"))
        else:  # time per push against the time 100 GB/s allows: ≤ 1 is the goal
            allowed = flat.nbytes / (TARGET_GB_S * 1e9)
            iv = paired_ratio(flat.rounds_s, [allowed] * len(flat.rounds_s))
            met, detail = _judged(goal, iv, 1.0)
            gb = [flat.nbytes / 1e9 / (x * allowed) for x in (iv.high, iv.estimate, iv.low)]
            out.append((goal, met, f"{gb[1]:.1f} GB/s [{gb[0]:.1f}, {gb[2]:.1f}] (mean over blocks); {detail}"))
    return out


def _judged(goal: str, iv: Interval, bound: float) -> tuple[bool | None, str]:
    v = judge(goal, iv, bound)
    met = {"met": True, "missed": False}.get(v.state)
    more = ""
    if v.state == "not decided":
        more = f"; about {v.more_blocks} more blocks needed" if v.more_blocks is not None else "; on the bound"
    return met, iv.format(2) + more


def _verdict(met: bool | None) -> str:
    return "NOT DECIDED" if met is None else "MET" if met else "MISSED"


def comparisons(results: Sequence[Measurement]) -> list[str]:
    """What the rows say beside the targets: the flat path against the per-tensor one (before and
    after), and each path against the bare receiver's floor."""
    out = []
    for a, b, what in (
        (FLAT, "tensors", "flat buckets vs per-tensor, both through the library"),
        (FLAT_ONE, FLAT, "the whole model in one flat bucket vs buckets of --bucket-mib"),
        (FLAT, RAW_FLAT, "library flat vs a bare process rebuilding the same buckets"),
        (SGLANG_FLAT, RAW_FLAT, "SGLang API flat vs a bare process rebuilding the same buckets"),
    ):
        ma, mb = _measured(a, results), _measured(b, results)
        if ma is not None and mb is not None:
            n = min(len(ma.rounds_s), len(mb.rounds_s))
            out.append(f"{a} / {b} ({what}): {paired_ratio(ma.rounds_s[:n], mb.rounds_s[:n]).format(3)}")
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
    colors = ["#777777" if m.transport in RAW_ROWS else "#3b75af" for m in shown]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    axes[0].bar(labels, [m.median_s for m in shown], color=colors)
    axes[0].set_yscale("log")
    axes[0].set_title("seconds per full push, median (lower is better; grey: raw baselines)", fontsize=9)
    axes[1].bar(labels, [m.gb_per_s for m in shown], color=colors)
    axes[1].set_title("GB/s (higher is better)", fontsize=9)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8, rotation=20)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


_BASELINES_MD = (
    "Each adapter row's ratio is against the baseline named in its row, measured in the same blocks with "
    "the same bytes and buckets (ratio of total times, 95 % t interval over blocks). *sglang api flat*: "
    "SGLang's HTTP API directly, no library: per bucket SGLang's `FlattenedTensorBucket` (a fresh buffer, as "
    "Miles makes one) serialised by its `MultiprocessingSerializer` and posted with aiohttp. *raw tensors* / "
    "*raw flat*: the per-tensor / flat payload sent over a local socket to a bare receiver process with the "
    "engine's GPU visibility that rebuilds the tensors as SGLang's worker does, copies them into preallocated "
    "tensors, synchronises and answers (timed from the send to the answer). *raw disk*: that bare process loads "
    "the folder's safetensors files onto the engine's device and synchronises (page cache warm). *raw broadcast*: "
    "the same tensors, buckets and sender, broadcast to a bare receiver process on the engine's device. The "
    "adapter rows include the HTTP control call, the engine's receive and `load_weights`; *tensors flat* also "
    "the copy into its reused buffers, as a colocated trainer pays it."
)


def markdown(
    m: dict[str, Any],
    info: dict[str, Any],
    results: Sequence[Measurement],
    notes: Sequence[str],
    png: str | None,
    gpu: bool = False,
) -> str:
    lines = ["## Weight sync", ""]
    lines += report.meta_lines(m)
    lines += [
        f"- **Setup:** {info['setup']}",
        f"- **Model:** {info['model']}: {info['gb']:.3f} GB in {info['tensors']} tensors; "
        f"buckets ≤ {info['bucket_mib']:g} MiB; {info['repeats']} timed blocks after one warm-up block, "
        "each row once per block in a seeded random order",
        f"- **Notes:** {'; '.join(notes)}",
        "",
        table(results),
        "",
    ]
    for name, met, detail in targets(results, gpu):
        lines.append(f"- {_verdict(met)}: {name}: {detail}")
    lines += [f"- {c}" for c in comparisons(results)]
    lines += ["", _BASELINES_MD, ""]
    if png:
        lines += [f"![weight sync]({png})", ""]
    return "\n".join(lines)


def setup_line(gpu: bool, p: Placement, rows: Sequence[Row]) -> str:
    if not gpu:
        return (
            "engine: one reference worker (CPU) behind no router; sender: this process; bare receivers: CPU processes"
        )
    group = next(x for x in rows if x.name == "nccl")
    where = (
        f"sender (this process) on {p.sender_device} for nccl"
        if group.skip != NEEDS_SECOND_GPU
        else "one GPU: nccl not run (needs a second GPU)"
    )
    return (
        f"engine: one SGLang worker on GPU {p.engine_gpu}; {where}; tensors sent from this process on the engine's "
        f"GPU; bare receivers see only GPU {p.engine_gpu}, like the engine"
    )


def dry_run(args: argparse.Namespace, rows: Sequence[Row], model_path: str) -> dict[str, Any]:
    """What a run would start, built by the same functions the run uses (nothing is started)."""
    p = placement(args.engine == "sglang", args.gpu_list)
    runs = {x.name for x in rows if x.skip is None}
    env = receiver_env(p, {})
    out: dict[str, Any] = {
        "placement": attrs.asdict(p),
        "rows": [{**attrs.asdict(x), "status": x.skip or "planned"} for x in rows],
        "setup": setup_line(args.engine == "sglang", p, rows),
    }
    if runs & {RAW_TENSORS, RAW_FLAT, RAW_DISK}:
        out["bare_receiver"] = {
            "command": receiver_command("--serve", "SPEC"),
            "env": env,
            "spec": bare_spec(p, model_path, "PORT_FILE", float(args.budget_s) + 60.0),
        }
    if RAW_BROADCAST in runs:
        out["broadcast_receiver"] = {
            "command": receiver_command("--receive", "SPEC"),
            "env": env,
            "spec": broadcast_spec(p, 0, [], [], args.repeats + 1),
        }
    return out


# -- main ------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rb_bench.weightsync",
        description="Weight sync through the adapter (distributed, tensors, disk), each against a raw baseline.",
    )
    p.add_argument("--engine", choices=("sglang", "reference"), default="reference")
    p.add_argument("--model-size", default=None, help="qwen2.5-0.5b (GPU default) or tiny (CPU default)")
    p.add_argument("--model-path", help="an existing model folder (default: make one)")
    p.add_argument(
        "--gpus", default="0,1", help="engine GPU[,sender GPU]; with one GPU, nccl is not run (it needs a second)"
    )
    p.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=None)
    p.add_argument("--repeats", type=int, default=20, help="timed blocks (after one warm-up block)")
    p.add_argument("--bucket-mib", type=float, default=None, help="bucket limit (default 512; 1 with --smoke)")
    p.add_argument("--budget-s", type=float, default=150.0, help="the whole run, engine start-up included")
    p.add_argument("--transport-timeout-s", type=float, default=90.0, help="give up on one row after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output folder (benchmarks.md, results.json, weightsync.png, weightsync-logs.tar.gz)")
    p.add_argument("--smoke", action="store_true", help="CPU: reference engine, gloo, tiny model, 2 blocks")
    p.add_argument(
        "--dry-run", action="store_true", help="print the plan (rows, devices, receivers) as JSON; run nothing"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    raw_argv = list(argv) if argv is not None else sys.argv[1:]
    if raw_argv[:1] == ["--receive"]:
        return _receive(raw_argv[1])
    if raw_argv[:1] == ["--serve"]:
        return _serve(raw_argv[1])
    p = _parser()
    args = p.parse_args(raw_argv)
    gpu = args.engine == "sglang"
    if args.smoke:
        if gpu:
            p.error("--smoke is for --engine reference")
        args.repeats = min(args.repeats, 2)
        args.budget_s = min(args.budget_s, 60.0)
    if args.bucket_mib is None:
        # Several buckets even for the tiny model, so the smoke runs the per-bucket paths.
        args.bucket_mib = 1.0 if args.smoke else 512.0
    args.gpu_list = [x.strip() for x in args.gpus.split(",") if x.strip()]
    if gpu:
        if len(args.gpu_list) not in (1, 2) or not all(x.isdigit() for x in args.gpu_list):
            p.error("--gpus takes one or two GPU indices: the engine's[, the sender's]")
        if len(set(args.gpu_list)) != len(args.gpu_list):
            p.error("--gpus: the sender needs a GPU other than the engine's (give one GPU to run without nccl)")
    transports = args.transports or [group_transport(gpu), "tensors", "disk"]
    if ("nccl" in transports and not gpu) or ("gloo" in transports and gpu):
        p.error("nccl needs --engine sglang (GPUs); gloo is the CPU transport")
    rows = plan(gpu, len(args.gpu_list) if gpu else 0, transports)
    size = args.model_size or ("qwen2.5-0.5b" if gpu else "tiny")
    if args.dry_run:
        print(json.dumps(dry_run(args, rows, args.model_path or "MODEL"), indent=1))
        return 0
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
                return await _measure(r, rows)
            finally:
                if r.bare is not None:
                    await asyncio.get_running_loop().run_in_executor(None, r.bare.stop)
                if r.fleet is not None:
                    await r.fleet.aclose()

        results, notes = asyncio.run(go())
        m = report.meta("python -m rb_bench.weightsync", argv, PACKAGES, started)
        m["duration_s"] = round(time.time() - started, 1)
        _report(args, r, rows, size, model_path, m, results, notes)
        code = 0 if any(x.rounds_s for x in results if x.baseline is not None) else 1
    if r is not None and _stuck(r.pool):
        r.progress("a thread is still inside a collective: exiting without waiting for it")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # the engine and the receivers are stopped already
    return code


def _interval_dict(iv: Interval | None) -> dict[str, Any]:
    if iv is None:
        return {"ratio": None, "ratio_low": None, "ratio_high": None}
    return {"ratio": iv.estimate, "ratio_low": iv.low, "ratio_high": iv.high}


def _report(
    args: argparse.Namespace,
    r: _Run,
    rows: list[Row],
    size: str,
    model_path: str,
    m: dict[str, Any],
    results: list[Measurement],
    notes: list[str],
) -> None:
    """The table, verdicts and comparisons on stdout, and with ``--out`` the report files and the logs."""
    gpu = args.engine == "sglang"
    total = nbytes(r.named_cpu)
    setup = setup_line(gpu, r.place, rows)
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
    for name, met, detail in targets(results, gpu):
        print(f"- {_verdict(met)}: {name}: {detail}")
    for line in comparisons(results):
        print(f"- {line}")
    print("; ".join(notes))
    print(f"\n({m['duration_s']} s)")
    if args.out:
        title = f"{m['gpu'] if gpu else m['machine']}; {m['date']}; {info['model']}, {total / 1e9:.2f} GB"
        data = {
            "meta": m,
            "info": info,
            "notes": notes,
            "results": [{**x.as_dict(), **_interval_dict(interval(x, results))} for x in results],
            "targets": [{"goal": g, "met": met, "detail": d} for g, met, d in targets(results, gpu)],
            "comparisons": comparisons(results),
        }
        report.write_outputs(
            args.out,
            KEY,
            plot=lambda path: plot(results, path, title),
            markdown=lambda png: markdown(m, info, results, notes, png, gpu),
            data=data,
            log_dirs=[r.run_dir / "logs"],
        )
        out = Path(args.out)
        r.progress(f"wrote {', '.join(sorted(x.name for x in out.iterdir()))} in {out}")


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
