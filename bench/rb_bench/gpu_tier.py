"""The GPU tier of the conformance suite as one command (``docs/gpu-tier.md``).

::

    python -m rb_bench.gpu_tier --out DIR [--engine sglang|reference]
        [--gpus 0,1] [--budget-s 540] [--check PATTERN ...] [--exclude PATTERN ...]

What it does, within ``--budget-s`` seconds from start to the last process stopped:

1. makes the tiny Qwen2 model twice with ``make_tiny_model``: seed 0 (the served weights) and
   seed 1 (the *alt* weights of the weight-update checks), in a temporary work directory;
2. starts, concurrently: **sglang-direct** (one SGLang server), **sglang-smg-rr** (two SGLang
   workers behind ``smg``, round robin), **dynamo-rr** and **dynamo-kv** (a Dynamo 1.4.2 frontend,
   round robin or the kv router (``launch dynamo``'s default), each with one ``dynamo.sglang``
   worker through our shim) and an **oracle** SGLang server on the alt weights
   (radix cache off): the "fresh engine on the new weights" of every backend's harness. With
   ``--engine reference`` the same orchestration runs reference workers (SGLang-protocol reference
   servers, Dynamo reference workers) on CPU, so the whole command is tested in CI;
3. measures parity across the four backends (cold caches, ``check_parity``, with a float32
   transformers forward pass on CPU) and the cache-hit drift of each (the same prompts twice,
   no flush in between);
4. runs the conformance checks on each backend (the four suites concurrently; a check is started
   only while enough of the budget is left, and the rest are reported "not run");
5. writes ``DIR/conformance-results.md``, ``DIR/conformance-results.json`` and ``DIR/logs-tail.txt``
   (log tails of what failed; small), prints a short summary, and stops every process it started,
   also on failure, cancellation (SIGTERM) or an exhausted budget.

SGLang workers run with ``--attention-backend triton --sampling-backend pytorch
--disable-cuda-graph --page-size 16 --mem-fraction-static F --max-total-tokens N`` (F = 0.12 by
default). ``--max-total-tokens`` keeps each KV pool small: SGLang 0.5.16 sizes its pool from the
free memory it sees, so engines starting at the same time on one GPU would otherwise count each
other's pools against their own and may refuse to start.

With two GPUs or more (``--gpus 0,1``) the engines run on the first GPUs and the last one holds the
trainer side of an NCCL weight-update group (``NcclWeightSender``), so the distributed-update
check runs where every rank of the group has a GPU of its own; otherwise that check is skipped
with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollout_backends import (
    ControlFailed,
    GenerateRequest,
    Generation,
    RolloutBackend,
    SamplingParams,
    WeightBucket,
    WeightGroup,
    WorkerFailure,
)
from rollout_backends.conformance import (
    BackendFactory,
    Check,
    CheckResult,
    Harness,
    HarnessError,
    Outcome,
    ParityReport,
    WeightSender,
    check_parity,
    default_parity_prompts,
    pair_parity,
    run_check,
    select_checks,
)
from rollout_backends.kit import Command, HttpFleetBackend, UpdateFromDisk, UpdateFromDistributed, UpdateFromTensors

__all__ = [
    "BACKENDS",
    "DEFAULT_TOLERANCES",
    "NcclWeightSender",
    "Tolerances",
    "TierConfig",
    "TierResult",
    "inject_http_failure",
    "main",
    "run_gpu_tier",
]

ENGINES = ("sglang", "reference")
#: The backends under test, by name, and their CLI short names. ``vllm`` and ``dynamo_vllm`` (vLLM 0.26
#: direct and behind Dynamo) are started by ``rb_bench.vllm_tier``, which runs this tier for them.
BACKENDS: Mapping[str, str] = {
    "direct": "sglang-direct",
    "smg": "sglang-smg-rr",
    "dynamo": "dynamo-rr",
    "dynamo_kv": "dynamo-kv",
    "vllm": "vllm-direct",
    "dynamo_vllm": "dynamo-vllm-rr",
    "dynamo16": "dynamo16-rr",  # a second Dynamo install (--dynamo16-python), stock dynamo.sglang
}
#: What ``--backends`` runs unless told: the SGLang engines (and ``dynamo16`` with --dynamo16-python).
DEFAULT_BACKENDS = ("direct", "smg", "dynamo", "dynamo_kv")
#: What this runner starts itself (``DEFAULT_BACKENDS`` and the second Dynamo fleet).
OWN_BACKENDS = (*DEFAULT_BACKENDS, "dynamo16")
#: The Dynamo backends' router modes: round robin, and the kv router ``launch dynamo`` starts by
#: default (where ``abort_all`` failed 3 of 7 runs on CPU before the check waited for late requests).
DYNAMO_ROUTERS: Mapping[str, str] = {"dynamo": "round-robin", "dynamo_kv": "kv", "dynamo16": "round-robin"}
ORACLE = "oracle"
DIST_CHECK = "distributed_update_matches_fresh"
#: SGLang flags that work on the H200 image (see the GPU notes): FA3 is not carried, flashinfer's
#: sampler is not compiled, CUDA graphs would lengthen start-up.
SGLANG_FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph")
RESULTS_MD = "conformance-results.md"
RESULTS_JSON = "conformance-results.json"
LOGS_TAIL = "logs-tail.txt"
#: Seconds kept at the end of the budget for stopping every process and writing the results.
TEARDOWN_RESERVE_S = 35.0
#: Largest logs-tail.txt written (bytes).
LOGS_TAIL_LIMIT = 256 * 1024


@attrs.frozen(kw_only=True)
class Tolerances:
    """|Δlogprob| accepted where the same weights should give the same numbers."""

    #: Same engine, two runs (prefix-cache hits, batching, retract-and-recompute): ``Harness.logprob_tolerance``.
    logprob: float
    #: Against a float32 transformers forward pass: ``Harness.hf_logprob_tolerance`` and parity's.
    hf: float
    #: Across backends on cold caches (same engine build and weights).
    parity: float
    why: str = ""


#: Per engine. bf16 SGLang: the same server, asked the same prompts twice, moved logprobs by up to
#: 0.055 once prefix-cache hits changed the arithmetic (H200, 2026-11-30); a pure-bf16 transformers
#: forward of the tiny model differs from float32 by up to 0.31 (mean 0.05) over the 128 parity
#: tokens (CPU). Cold-cache runs of one engine build agree to ~1e-7 (SGLang vs Dynamo, measured).
DEFAULT_TOLERANCES: Mapping[str, Tolerances] = {
    "sglang": Tolerances(
        logprob=0.1,
        hf=0.5,
        parity=1e-2,
        why="bf16 engine: cache-hit drift measured 0.055 (H200); pure-bf16 vs fp32 forward of this model up to 0.31",
    ),
    "reference": Tolerances(
        logprob=1e-3, hf=2e-2, parity=1e-3, why="float32 CPU reference engine (the suite's default tolerances)"
    ),
}


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


@attrs.frozen(kw_only=True)
class TierConfig:
    """Everything the command line sets."""

    out: Path = attrs.field(converter=Path)
    engine: str = "sglang"
    gpus: tuple[str, ...] = ("0",)
    budget_s: float = 540.0
    select: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    #: The interpreter of the ``dynamo16`` fleet's processes (frontend and workers): one that imports
    #: another ai-dynamo (1.6.1), e.g. a script that puts its site first on PYTHONPATH (GPU), or
    #: ``.venv-dynamo16/bin/python`` (CPU). Its workers run stock ``dynamo.sglang`` unless ``dynamo16_shim``.
    dynamo16_python: str | None = None
    dynamo16_shim: bool = False
    #: Run the suites at once (each backend has its own servers; only the oracle is shared).
    parallel: bool = True
    mem_fraction: float = 0.12
    max_total_tokens: int = 65536
    concurrency: int | None = None
    tolerances: Tolerances | None = None
    parity_prompts: int = 8
    parity_max_new_tokens: int = 16
    startup_timeout_s: float = 420.0
    check_timeout_s: float | None = None
    #: A check is started only while at least this many seconds of the budget are left.
    min_check_s: float | None = None
    work_dir: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    keep_work: bool = False
    quiet: bool = False

    def __attrs_post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {ENGINES}, got {self.engine!r}")
        if not self.gpus:
            raise ValueError("--gpus needs at least one GPU index")
        unknown = [b for b in self.backends if b not in BACKENDS]
        if unknown or not self.backends:
            raise ValueError(f"--backends takes {sorted(BACKENDS)}, got {list(self.backends)}")
        if "dynamo16" in self.backends and not self.dynamo16_python:
            raise ValueError("the dynamo16 backend needs --dynamo16-python")
        if not 0 < self.mem_fraction < 1:
            raise ValueError(f"--mem-fraction must be in (0, 1), got {self.mem_fraction}")
        if self.budget_s < TEARDOWN_RESERVE_S + 10:
            raise ValueError(f"--budget-s must be at least {TEARDOWN_RESERVE_S + 10:.0f}")

    @property
    def sglang(self) -> bool:
        return self.engine == "sglang"

    @property
    def tol(self) -> Tolerances:
        return self.tolerances or DEFAULT_TOLERANCES[self.engine]

    @property
    def trainer_gpu(self) -> str | None:
        """The GPU of the NCCL trainer rank: the last one, when there are two or more."""
        return self.gpus[-1] if len(self.gpus) >= 2 else None

    @property
    def engine_gpus(self) -> tuple[str, ...]:
        return self.gpus[:-1] if len(self.gpus) >= 2 else self.gpus

    def gpus_of(self, key: str) -> tuple[str, ...]:
        """``CUDA_VISIBLE_DEVICES`` of each worker of a backend (or of the oracle)."""
        eg = self.engine_gpus
        if key == "smg":
            return (eg[0], eg[1 % len(eg)])
        return (eg[0],)

    def sender_unavailable(self, key: str) -> str | None:
        """Why the distributed-update check cannot run on this backend (``None``: it can)."""
        if not self.sglang:
            return None  # gloo on CPU: any placement works
        if self.trainer_gpu is None:
            return "NCCL needs trainer and engine on different GPUs (one GPU given; --gpus 0,1 runs this check)"
        mine = self.gpus_of(key)
        if len(set(mine)) != len(mine):
            return (
                f"NCCL needs every rank on a GPU of its own: {len(mine)} engine ranks share GPU {mine[0]} "
                f"(needs {len(mine) + 1} GPUs)"
            )
        return None


# -- the trainer side of a distributed update over NCCL -------------------------------------------


class NcclWeightSender:
    """Rank 0 of an NCCL weight-update group on one GPU, built without a default process group.

    The group is made the way SGLang's engines make theirs (``init_custom_process_group``:
    ``tcp://`` rendezvous, ``PrefixStore(group_name)``, ``_new_process_group_helper``), so both
    sides agree on every store key. The trainer and each engine rank must be on different GPUs.
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        *,
        device: str = "cuda:1",
        timeout_s: float = 60.0,
        backend: str = "nccl",
    ) -> None:
        if world_size < 2:
            raise ValueError(f"world_size must be >= 2, got {world_size}")
        self.master_address = master_address
        self.master_port = int(master_port)
        self.world_size = world_size
        self.group_name = group_name
        self.device = device
        self.timeout_s = timeout_s
        #: "nccl"; "gloo" with ``device="cpu"`` only to test the group's construction on CPU.
        self.backend = backend
        self._pg: Any = None
        self._closed = False
        self._lock = threading.Lock()

    def connect(self) -> None:
        for key, value in _NO_MULTICAST.items():  # shared hosts: NVLink multicast stays off
            os.environ.setdefault(key, value)
        from torch.distributed import distributed_c10d

        c10d: Any = distributed_c10d  # private helpers, untyped
        with self._lock:
            if self._closed:
                raise RuntimeError("NcclWeightSender is closed")
            if self._pg is not None:
                return
            timeout = datetime.timedelta(seconds=self.timeout_s)
            with self._on_device():
                url = f"tcp://{self.master_address}:{self.master_port}"
                store, _, _ = next(c10d.rendezvous(url, 0, self.world_size, timeout=timeout))
                store.set_timeout(timeout)
                store = c10d.PrefixStore(self.group_name, store)
                pg, _ = c10d._new_process_group_helper(
                    self.world_size,
                    0,
                    [],
                    c10d.Backend(self.backend),
                    store,
                    group_name=self.group_name,
                    backend_options=None,
                    timeout=timeout,
                    device_id=None,
                )
                c10d._world.pg_group_ranks[pg] = {i: i for i in range(self.world_size)}
                if self._closed:  # closed while we waited for the peers
                    _destroy(pg)
                    raise RuntimeError("NcclWeightSender was closed while connecting")
                self._pg = pg

    def broadcast(self, named_tensors: Sequence[tuple[str, Any]]) -> WeightBucket:
        import torch
        import torch.distributed

        with self._lock:
            if self._pg is None:
                raise RuntimeError("NcclWeightSender.connect() first")
            bucket = WeightBucket.from_named_tensors(named_tensors)
            with self._on_device():
                for _, t in named_tensors:
                    x = t.detach().to(self.device).contiguous()
                    torch.distributed.broadcast(x, src=0, group=self._pg)
                if self.device.startswith("cuda"):
                    torch.cuda.synchronize(self.device)
            return bucket

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """The CUDA device as current device (per thread: the checks call from worker threads)."""
        if not self.device.startswith("cuda"):
            return contextlib.nullcontext()
        import torch

        return torch.cuda.device(self.device)

    def close(self) -> None:
        """Leave the group. Does not wait for a ``connect`` still blocked on absent peers (it
        gives up after ``timeout_s`` and then finds the sender closed)."""
        self._closed = True
        pg, self._pg = self._pg, None
        _destroy(pg)


def _destroy(pg: Any) -> None:
    if pg is None:
        return
    import torch.distributed

    with contextlib.suppress(Exception):  # a peer already gone: nothing left to release
        torch.distributed.destroy_process_group(pg)


_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _cuda_index(gpu: str) -> str:
    """The ``cuda:N`` of physical GPU ``gpu`` as this process sees it (``CUDA_VISIBLE_DEVICES``)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return f"cuda:{visible.index(gpu)}" if gpu in visible else f"cuda:{gpu}"


# -- failure injection for any HTTP fleet ---------------------------------------------------------

_LOAD_OPS = (UpdateFromDisk, UpdateFromTensors, UpdateFromDistributed)


@contextlib.asynccontextmanager
async def inject_http_failure(backend: RolloutBackend, worker: str) -> AsyncIterator[None]:
    """While entered, weight loads on ``worker`` of an ``HttpFleetBackend`` fail.

    A disk load is sent to the engine with a checkpoint path that does not exist, so the engine
    itself refuses it (and its error travels back as usual); a tensor or distributed load fails on
    the client before it is sent. The other workers load for real: the transaction, which is
    client-side, must then roll back the version labels and resume everyone.
    """
    if not isinstance(backend, HttpFleetBackend):
        raise HarnessError(f"inject_http_failure needs an HttpFleetBackend, got {type(backend).__name__}")
    original: Callable[..., Awaitable[Any]] = backend._control
    missing = os.path.join(tempfile.gettempdir(), f"rb-injected-failure-{os.getpid()}", "no-such-checkpoint")

    async def failing(op: Command, worker_id: str) -> None:
        if worker_id == worker and isinstance(op, _LOAD_OPS):
            if isinstance(op, UpdateFromDisk):
                op = attrs.evolve(op, path=missing)
            else:
                raise ControlFailed(
                    op.name, [WorkerFailure(worker_id, op.name, "injected failure (conformance harness)")]
                )
        await original(op, worker_id)

    setattr(backend, "_control", failing)  # noqa: B010 - shadow the method on this instance only
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            delattr(backend, "_control")


async def memory_saver_note(fleet: Any, name: str) -> str:
    """What ``dynamo.connect`` learns by asking the workers whether SGLang's memory saver is on (its
    default, ``memory_saver=None``) against what the launcher says from the SGLang args it passed: a
    fleet where the two disagree would declare a memory release SGLang never does, or not declare one."""
    told = fleet.connect_options().get("memory_saver")
    try:
        wire: Any = (await fleet.connect(memory_saver=None)).wire
    except Exception as exc:
        return f"{name}: memory saver: connect(memory_saver=None) FAILED: {type(exc).__name__}: {exc}"
    asked = f"{wire.memory_saver} ({wire.memory_saver_source}: {wire.memory_saver_note})"
    if told is None:
        return f"{name}: memory saver asked of the workers: {asked}; the launcher says nothing for these workers"
    agree = "agree" if told == wire.memory_saver and wire.memory_saver_source == "workers" else "DISAGREE"
    return f"{name}: memory saver asked of the workers: {asked}; the launcher says {told}: {agree}"


# -- results ----------------------------------------------------------------------------------------


@attrs.define(eq=False)
class _Running:
    """A started backend (or the oracle)."""

    key: str
    name: str
    description: str
    factory: BackendFactory
    close: Callable[[], Awaitable[None]]
    workers: int
    startup_s: float
    commands: dict[str, str] = attrs.field(factory=dict)


@attrs.define(eq=False)
class _BackendRun:
    """What happened to one backend under test."""

    key: str
    name: str
    description: str
    log_dir: Path
    started: bool = False
    startup_s: float | None = None
    start_error: str | None = None
    sender_reason: str | None = None
    results: list[CheckResult] = attrs.field(factory=list)
    not_run: list[str] = attrs.field(factory=list)
    interrupted: str | None = None
    drift: dict[str, Any] | None = None
    commands: dict[str, str] = attrs.field(factory=dict)

    def counts(self) -> dict[str, int]:
        c = {o.value: 0 for o in Outcome}
        for r in self.results:
            c[r.outcome.value] += 1
        c["not_run"] = len(self.not_run)
        return c


@attrs.define(eq=False)
class TierResult:
    """Everything the run measured (written to ``conformance-results.json``)."""

    config: TierConfig
    date: str
    gpu: str | None
    versions: dict[str, str | None]
    runs: dict[str, _BackendRun]
    oracle: _BackendRun
    parity: ParityReport | None = None
    parity_error: str | None = None
    notes: list[str] = attrs.field(factory=list)
    stages: dict[str, float] = attrs.field(factory=dict)
    wall_s: float = 0.0
    budget_exhausted: bool = False

    @property
    def ok(self) -> bool:
        runs = list(self.runs.values())
        return (
            all(r.started for r in runs)
            and self.oracle.started
            and not self.budget_exhausted
            and all(not r.not_run and r.interrupted is None for r in runs)
            and all(x.outcome in (Outcome.PASS, Outcome.SKIP) for r in runs for x in r.results)
            and (self.parity is None or self.parity.ok)
            and self.parity_error is None
        )


# -- the run -------------------------------------------------------------------------------------


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {}
    for dist in ("sglang", "ai-dynamo", "ai-dynamo-runtime", "torch", "smg", "transformers", "rollout-backends"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def _gpu_name() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if not names:
        return None
    distinct = sorted(set(names))
    return ", ".join(f"{n} x{names.count(n)}" if names.count(n) > 1 else n for n in distinct)


def _vocab_size(model: Path) -> int | None:
    try:
        v = json.loads((model / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return v if isinstance(v, int) else None


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


class _Tier:
    def __init__(self, config: TierConfig) -> None:
        self.cfg = config
        self.t0 = time.monotonic()
        self.hard_deadline = self.t0 + config.budget_s
        self.work_deadline = self.hard_deadline - TEARDOWN_RESERVE_S
        self.closers: list[tuple[str, Callable[[], Awaitable[None]]]] = []
        self.running: dict[str, _Running] = {}
        self._dist_lock: asyncio.Lock | None = None
        self.work = Path(config.work_dir or tempfile.mkdtemp(prefix="rb-gpu-tier-"))
        self.logs = self.work / "logs"
        self.base = self.work / "model-seed0"
        self.alt = self.work / "model-seed1"
        self.vocab: int | None = None
        self.result = TierResult(
            config=config,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            gpu=None,
            versions={},
            runs={
                k: _BackendRun(key=k, name=BACKENDS[k], description=self._describe(k), log_dir=self.logs / BACKENDS[k])
                for k in config.backends
            },
            oracle=_BackendRun(key=ORACLE, name=ORACLE, description=self._describe(ORACLE), log_dir=self.logs / ORACLE),
        )

    # -- helpers --

    def say(self, msg: str) -> None:
        if not self.cfg.quiet:
            print(f"[gpu-tier +{time.monotonic() - self.t0:5.1f}s] {msg}", flush=True)

    def left(self) -> float:
        return self.work_deadline - time.monotonic()

    def _describe(self, key: str) -> str:
        kind = "SGLang" if self.cfg.sglang else "reference SGLang-protocol"
        where = f" on GPU {','.join(self.cfg.gpus_of(key))}" if self.cfg.sglang else " on CPU"
        if key == "direct":
            return f"1 {kind} server, no router{where}"
        if key == "smg":
            return f"2 {kind} workers behind smg (round_robin){where}"
        if key in DYNAMO_ROUTERS:
            shim = key != "dynamo16" or self.cfg.dynamo16_shim
            worker = (
                f"dynamo.sglang ({'our shim' if shim else 'stock'})" if self.cfg.sglang else "Dynamo reference worker"
            )
            which = f" of {self.cfg.dynamo16_python}" if key == "dynamo16" else ""
            return f"Dynamo frontend{which} ({DYNAMO_ROUTERS[key]}) + 1 {worker}{where}"
        return f"1 {kind} server on the alt weights (seed 1), radix cache off{where}: the fresh-engine oracle"

    def _stage(self, name: str, t: float) -> None:
        self.result.stages[name] = round(time.monotonic() - t, 2)

    # -- models --

    async def make_models(self) -> None:
        from rollout_backends.adapters.reference import make_tiny_model

        t = time.monotonic()
        await asyncio.to_thread(make_tiny_model, self.base, 0)
        await asyncio.to_thread(make_tiny_model, self.alt, 1)
        self.vocab = _vocab_size(self.base)
        self._stage("models_s", t)
        self.say(f"models: {self.base.name} (served), {self.alt.name} (alt) in {self.work}")

    # -- start-up --

    def _startup_timeout(self) -> float:
        return max(20.0, min(self.cfg.startup_timeout_s, self.left() - 20.0))

    def _sglang_extra(self) -> tuple[str, ...]:
        return ("--max-total-tokens", str(self.cfg.max_total_tokens)) if self.cfg.sglang else ()

    async def _start_sglang(self, key: str, model: Path, workers: int) -> _Running:
        from rollout_backends.adapters.sglang import SGLangFleetConfig, start_sglang_fleet
        from rollout_backends.adapters.sglang import connect as sglang_connect

        name = self.result.oracle.name if key == ORACLE else BACKENDS[key]
        c = self.cfg
        config = SGLangFleetConfig(
            model_path=str(model),
            workers=workers,
            worker_kind="sglang" if c.sglang else "reference",
            cuda_visible_devices=self.cfg.gpus_of(key) if c.sglang else None,
            mem_fraction_static=c.mem_fraction if c.sglang else None,
            attention_backend=SGLANG_FLAGS[1],
            sampling_backend=SGLANG_FLAGS[3],
            disable_cuda_graph=True,
            disable_radix_cache=key == ORACLE,
            page_size=16,
            extra_server_args=self._sglang_extra(),
            router="smg" if key == "smg" else "none",
            router_policy="round_robin",
            health_check_interval_s=5,
            log_dir=str(self.logs / name),
            startup_timeout_s=self._startup_timeout(),
        )
        t = time.monotonic()
        fleet = await start_sglang_fleet(config)
        self.closers.append((name, fleet.aclose))
        vocab = self.vocab

        async def factory() -> RolloutBackend:
            return await sglang_connect(
                fleet.entry_url, workers=list(fleet.worker_urls), routing=config.routing_kind, vocab_size=vocab
            )

        commands = {n: " ".join(fleet.supervisor.process(n).spec.argv) for n in fleet.supervisor.names}
        return _Running(
            key=key,
            name=name,
            description=self._describe(key),
            factory=factory,
            close=fleet.aclose,
            workers=workers,
            startup_s=time.monotonic() - t,
            commands=commands,
        )

    async def _start_dynamo(self, key: str = "dynamo", config: Any = None) -> _Running:
        """A Dynamo fleet: ``config`` (a ``DynamoFleetConfig``; default: this tier's dynamo.sglang
        one behind the router ``DYNAMO_ROUTERS[key]``)."""
        from rollout_backends.adapters.dynamo import DynamoFleetConfig, launch_dynamo_fleet

        c = self.cfg
        name = BACKENDS[key]
        sglang_args = (*SGLANG_FLAGS, "--mem-fraction-static", str(c.mem_fraction), *self._sglang_extra())
        config = config or DynamoFleetConfig(
            model_path=str(self.base),
            served_model_name="tiny",
            workers=1,
            worker_kind="sglang" if c.sglang else "reference",
            router_mode=DYNAMO_ROUTERS[key],
            page_size=16,
            gpus=self.cfg.gpus_of(key) if c.sglang else (),
            sglang_args=sglang_args if c.sglang else (),
            ready_timeout=self._startup_timeout(),
        )
        if key == "dynamo16" and c.dynamo16_python:  # the second install: its interpreter, stock workers
            config = attrs.evolve(config, python=c.dynamo16_python, sglang_shim=c.dynamo16_shim)
        t = time.monotonic()
        cm = launch_dynamo_fleet(config, log_dir=self.logs / name)
        fleet = await cm.__aenter__()

        async def close() -> None:
            await cm.__aexit__(None, None, None)

        self.closers.append((name, close))
        self.result.notes.append(await memory_saver_note(fleet, name))

        async def factory() -> RolloutBackend:
            return await fleet.connect()

        commands = {n: " ".join(fleet.supervisor.process(n).spec.argv) for n in fleet.supervisor.names}
        return _Running(
            key=key,
            name=name,
            description=self._describe(key),
            factory=factory,
            close=close,
            workers=1,
            startup_s=time.monotonic() - t,
            commands=commands,
        )

    async def _start(self, key: str) -> _Running:
        """Start one backend (or the oracle): what ``rb_bench.vllm_tier`` overrides."""
        if key in DYNAMO_ROUTERS:
            return await self._start_dynamo(key)
        if key == ORACLE:
            return await self._start_sglang(ORACLE, self.alt, 1)
        if key not in ("direct", "smg"):
            raise ValueError(f"{BACKENDS[key]} is started by python -m rb_bench.vllm_tier")
        return await self._start_sglang(key, self.base, 2 if key == "smg" else 1)

    async def _start_one(self, key: str) -> None:
        run = self.result.oracle if key == ORACLE else self.result.runs[key]
        try:
            rb = await self._start(key)
        except asyncio.CancelledError:
            run.start_error = "start-up cut short (budget exhausted or cancelled)"
            raise
        except Exception as exc:
            run.start_error = f"{type(exc).__name__}: {exc}"
            self.say(f"{run.name}: start-up FAILED: {_first_line(run.start_error, 200)}")
            return
        run.started = True
        run.startup_s = round(rb.startup_s, 2)
        run.commands = rb.commands
        self.running[key] = rb
        self.say(f"{run.name} up in {rb.startup_s:.0f}s")

    async def start_all(self) -> None:
        t = time.monotonic()
        self.say(
            f"starting {', '.join(BACKENDS[k] for k in self.cfg.backends)} and the oracle "
            f"({self.cfg.engine}; GPUs {','.join(self.cfg.gpus)})"
        )
        await asyncio.gather(*(self._start_one(k) for k in (*self.cfg.backends, ORACLE)))
        self._stage("startup_s", t)

    async def stop_all(self) -> None:
        t = time.monotonic()
        closers, self.closers = self.closers, []

        async def stop(name: str, close: Callable[[], Awaitable[None]]) -> None:
            left = max(5.0, self.hard_deadline - time.monotonic() - 2.0)
            try:
                await asyncio.wait_for(close(), min(60.0, left))
            except BaseException as exc:  # keep stopping the others
                self.result.notes.append(f"stopping {name}: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(stop(n, c) for n, c in closers))
        self._stage("teardown_s", t)

    # -- harness --

    def harness_for(self, key: str) -> Harness:
        c = self.cfg
        tol = c.tol
        oracle = self.running.get(ORACLE)
        alt = str(self.alt)

        async def oracle_backend() -> RolloutBackend:
            assert oracle is not None
            return await oracle.factory()

        def fresh_factory_on(path: str) -> BackendFactory:
            if os.path.realpath(path) != os.path.realpath(alt):
                raise HarnessError(f"the GPU tier runs a fresh engine on the alt weights only ({alt}), not on {path}")
            return oracle_backend

        make_sender: Callable[[int], tuple[WeightGroup, WeightSender]] | None = None
        run = self.result.runs[key]
        run.sender_reason = c.sender_unavailable(key)
        if run.sender_reason is None:
            make_sender = self._sender_factory()
        return Harness(
            alt_weights_path=alt,
            base_weights_path=str(self.base),
            fresh_factory_on=fresh_factory_on if oracle is not None else None,
            make_sender=make_sender,
            inject_failure=inject_http_failure,
            hf_model_path=str(self.base),
            concurrency=c.concurrency or (200 if c.sglang else 16),
            logprob_tolerance=tol.logprob,
            hf_logprob_tolerance=tol.hf,
            check_timeout_s=c.check_timeout_s or (150.0 if c.sglang else 60.0),
            open_timeout_s=60.0,
            vocab_size=self.vocab,
        )

    def _sender_factory(self) -> Callable[[int], tuple[WeightGroup, WeightSender]]:
        import uuid

        from rollout_backends.adapters.reference import WeightSender as GlooSender
        from rollout_backends.adapters.reference import free_port

        c = self.cfg

        def make_sender(world_size: int) -> tuple[WeightGroup, WeightSender]:
            port = free_port()
            name = f"rb-gpu-tier-{uuid.uuid4().hex[:8]}"  # unique: a name is never reused in a process
            if c.sglang:
                assert c.trainer_gpu is not None
                group = WeightGroup(
                    master_address="127.0.0.1", master_port=port, world_size=world_size, group_name=name, backend="nccl"
                )
                sender: WeightSender = NcclWeightSender(
                    "127.0.0.1", port, world_size, name, device=_cuda_index(c.trainer_gpu), timeout_s=60.0
                )
                return group, sender
            group = WeightGroup(
                master_address="127.0.0.1", master_port=port, world_size=world_size, group_name=name, backend="gloo"
            )
            return group, GlooSender("127.0.0.1", port, world_size, name, timeout_s=60.0)

        return make_sender

    # -- parity and drift --

    async def parity(self) -> None:
        keys = [k for k in self.cfg.backends if k in self.running]
        if not keys:
            self.result.parity_error = "no backend started"
            return
        t = time.monotonic()
        prompts = default_parity_prompts(self.vocab, n=self.cfg.parity_prompts)
        tol = self.cfg.tol
        with contextlib.suppress(Exception):  # transformers' per-load progress bars: noise in the output
            import importlib

            hf_logging: Any = importlib.import_module("transformers.utils.logging")
            hf_logging.disable_progress_bar()
        try:
            self.result.parity = await asyncio.wait_for(
                check_parity(
                    {self.running[k].name: self.running[k].factory for k in keys},
                    prompts,
                    max_new_tokens=self.cfg.parity_max_new_tokens,
                    tolerance=tol.parity,
                    hf_model_path=str(self.base),
                    hf_tolerance=tol.hf,
                ),
                max(10.0, min(180.0, self.left() - 10.0)),
            )
        except Exception as exc:
            self.result.parity_error = f"{type(exc).__name__}: {exc}"
            self.say(f"parity: ERROR {_first_line(self.result.parity_error)}")
        else:
            p = self.result.parity
            worst_pair = max((x.max_abs_dlogprob for x in p.pairs), default=0.0)
            worst_hf = max((h.max_abs_dlogprob for h in p.hf), default=0.0)
            self.say(
                f"parity: {'ok' if p.ok else 'MISMATCH'} ({p.cases} prompts; ids identical in "
                f"{sum(x.ids_equal for x in p.pairs)}/{len(p.pairs)} pairs, max |Δlogprob| {worst_pair:.3g}; "
                f"vs transformers max {worst_hf:.3g})"
            )
        for k in keys:
            try:
                self.result.runs[k].drift = await asyncio.wait_for(self._drift(self.running[k]), 60.0)
            except Exception as exc:
                self.result.runs[k].drift = {"error": f"{type(exc).__name__}: {exc}"}
        self._stage("parity_s", t)

    async def _drift(self, rb: _Running) -> dict[str, Any]:
        """The same greedy prompts twice without a flush: what prefix-cache hits do to logprobs."""
        prompts = default_parity_prompts(self.vocab, n=self.cfg.parity_prompts)
        sampling = SamplingParams(temperature=0.0, max_new_tokens=self.cfg.parity_max_new_tokens)
        backend = await rb.factory()
        try:
            await backend.flush_cache()

            async def run_all(tag: str) -> list[Generation]:
                out = []
                for i, p in enumerate(prompts):
                    req = GenerateRequest(
                        input_ids=p, sampling=sampling, request_id=f"gpu-tier-drift-{tag}-{i}-{time.monotonic_ns()}"
                    )
                    out.append(await backend.generate(req))
                return out

            first = await run_all("cold")
            second = await run_all("warm")
        finally:
            await backend.aclose()
        pair = pair_parity("cold", "warm", first, second, self.cfg.tol.logprob)
        same = sum(a.output_ids == b.output_ids for a, b in zip(first, second, strict=True))
        return {
            "prompts": len(prompts),
            "ids_identical": same,
            "first_mismatch": list(pair.first_mismatch) if pair.first_mismatch else None,
            "max_abs_dlogprob": round(pair.max_abs_dlogprob, 9),
            "cached_tokens_second_run": sum(g.cached_tokens for g in second),
            "prompt_tokens": sum(len(p) for p in prompts),
        }

    # -- checks --

    def checks(self) -> list[Check]:
        return select_checks(self.cfg.select, self.cfg.exclude or None)

    def _min_check_s(self) -> float:
        return self.cfg.min_check_s if self.cfg.min_check_s is not None else (15.0 if self.cfg.sglang else 5.0)

    async def suite(self, key: str, checks: Sequence[Check]) -> None:
        run = self.result.runs[key]
        rb = self.running[key]
        harness = self.harness_for(key)
        assert self._dist_lock is not None
        pending = list(checks)
        try:
            while pending:
                c = pending[0]
                left = self.left()
                if left < self._min_check_s():
                    run.not_run.extend(x.name for x in pending)
                    self.say(f"{run.name}: budget: {left:.0f}s left, {len(pending)} checks not run")
                    pending = []
                    break
                h = harness.replace(check_timeout_s=max(5.0, min(harness.check_timeout_s, left - 5.0)))
                lock = self._dist_lock if c.name == DIST_CHECK else contextlib.nullcontext()
                async with lock:
                    r = await run_check(c, rb.factory, h, label=run.name)
                pending.pop(0)
                r = self._annotate(run, r)
                run.results.append(r)
                if r.outcome is not Outcome.PASS and r.outcome is not Outcome.SKIP:
                    self.say(f"{run.name}: {r.line()[:240]}")
        except asyncio.CancelledError:
            if pending:
                run.interrupted = pending[0].name
                run.not_run.extend(x.name for x in pending[1:])
            raise
        n = run.counts()
        self.say(
            f"{run.name}: {n['pass']} pass, {n['fail']} fail, {n['skip']} skip, {n['error']} error, "
            f"{n['not_run']} not run"
        )

    def _annotate(self, run: _BackendRun, r: CheckResult) -> CheckResult:
        if r.outcome is Outcome.SKIP and run.sender_reason and "make_sender" in r.message:
            return attrs.evolve(r, message=f"{run.sender_reason} (harness hook 'make_sender' not provided)")
        return r

    async def all_suites(self) -> None:
        t = time.monotonic()
        self._dist_lock = asyncio.Lock()
        checks = self.checks()
        keys = [k for k in self.cfg.backends if k in self.running]
        for k in self.cfg.backends:
            if k not in self.running:
                self.result.runs[k].not_run = [c.name for c in checks]
        self.say(f"running {len(checks)} checks on {', '.join(BACKENDS[k] for k in keys) or 'no backend'}")
        if self.cfg.parallel:
            await asyncio.gather(*(self.suite(k, checks) for k in keys))
        else:
            for k in keys:
                await self.suite(k, checks)
        self._stage("checks_s", t)

    # -- the whole run --

    async def stages(self) -> None:
        self.result.gpu = await asyncio.to_thread(_gpu_name)
        self.result.versions = _versions()
        await self.make_models()
        await self.start_all()
        await self.parity()
        await self.all_suites()

    async def run(self) -> TierResult:
        self.cfg.out.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        stages = asyncio.ensure_future(self.stages())
        try:
            cancelled = False
            try:
                await asyncio.wait({stages}, timeout=max(1.0, self.left()))
            except asyncio.CancelledError:
                # SIGTERM/SIGINT: wind down here; results and teardown below.
                cancelled = True
                self.result.notes.append("cancelled by a signal: stopped early")
                self.say("cancelled: stopping")
                task: Any = asyncio.current_task()
                if task is not None and hasattr(task, "uncancel"):
                    task.uncancel()
            if not stages.done():
                if not cancelled:
                    self.result.budget_exhausted = True
                    self.result.notes.append(
                        f"the budget ({self.cfg.budget_s:.0f}s, {TEARDOWN_RESERVE_S:.0f}s kept for teardown) ran out"
                    )
                    self.say("budget exhausted: stopping")
                stages.cancel()
                # Let the checks record where they were, but never wait long: teardown comes first.
                await asyncio.wait({stages}, timeout=10.0)
            elif not stages.cancelled() and stages.exception() is not None:
                exc = stages.exception()
                assert exc is not None
                self.result.notes.append(f"the run failed: {type(exc).__name__}: {exc}")
                self.result.notes.append("".join(traceback.format_exception(exc, limit=8)))
                self.say(f"run failed: {type(exc).__name__}: {exc}")
            names = [c.name for c in self.checks()]
            for run in self.result.runs.values():
                if not run.started and not run.results and not run.not_run:
                    run.not_run = list(names)
            self.result.wall_s = round(time.monotonic() - self.t0, 2)
            self.write()  # before teardown: a kill during teardown still leaves the results
        finally:
            await asyncio.shield(self.stop_all())
            if not stages.done():
                stages.cancel()  # its servers are gone: it ends with an error at once
            self.result.wall_s = round(time.monotonic() - self.t0, 2)
            self.write()
            if not self.cfg.keep_work and self.cfg.work_dir is None:
                shutil.rmtree(self.work, ignore_errors=True)
        return self.result

    def write(self) -> None:
        out = self.cfg.out
        (out / RESULTS_JSON).write_text(json.dumps(result_json(self.result), indent=1, default=str) + "\n")
        (out / RESULTS_MD).write_text(result_markdown(self.result))
        (out / LOGS_TAIL).write_text(logs_tail(self.result))


# -- reports ---------------------------------------------------------------------------------------


def _result_json(r: CheckResult) -> dict[str, Any]:
    return {
        "name": r.name,
        "outcome": r.outcome.value,
        "duration_s": round(r.duration_s, 3),
        "message": r.message[:2000],
        "measurements": dict(r.measurements),
    }


def _parity_json(p: ParityReport) -> dict[str, Any]:
    return {
        "ok": p.ok,
        "cases": p.cases,
        "duration_s": round(p.duration_s, 2),
        "pairs": [
            {
                "a": x.a,
                "b": x.b,
                "ids_equal": x.ids_equal,
                "first_mismatch": list(x.first_mismatch) if x.first_mismatch else None,
                "max_abs_dlogprob": x.max_abs_dlogprob,
                "top_logprobs_compared": x.top_logprobs_compared,
                "top_mismatch": list(x.top_mismatch) if x.top_mismatch else None,
                "max_abs_dtop_logprob": x.max_abs_dtop_logprob,
                "prompt_logprobs_compared": x.prompt_logprobs_compared,
                "max_abs_dprompt_logprob": x.max_abs_dprompt_logprob,
                "tolerance": x.tolerance,
                "ok": x.ok,
            }
            for x in p.pairs
        ],
        "transformers": [
            {
                "backend": h.backend,
                "max_abs_dlogprob": h.max_abs_dlogprob,
                "mean_abs_dlogprob": h.mean_abs_dlogprob,
                "tokens": h.tokens,
                "tolerance": h.tolerance,
                "ok": h.ok,
            }
            for h in p.hf
        ],
        "output_ids": {name: [list(g.output_ids) for g in gens] for name, gens in p.outputs.items()},
    }


def _run_json(run: _BackendRun) -> dict[str, Any]:
    return {
        "description": run.description,
        "started": run.started,
        "startup_s": run.startup_s,
        "start_error": run.start_error,
        "counts": run.counts(),
        "results": [_result_json(r) for r in run.results],
        "not_run": run.not_run,
        "interrupted_in": run.interrupted,
        "sender_unavailable": run.sender_reason,
        "cache_hit_drift": run.drift,
        "commands": run.commands,
    }


def result_json(res: TierResult) -> dict[str, Any]:
    c = res.config
    return {
        "tool": "rb_bench.gpu_tier",
        "date": res.date,
        "engine": c.engine,
        "gpu": res.gpu,
        "gpus": list(c.gpus),
        "versions": res.versions,
        "budget_s": c.budget_s,
        "wall_s": res.wall_s,
        "stages": res.stages,
        "budget_exhausted": res.budget_exhausted,
        "ok": res.ok,
        "tolerances": attrs.asdict(c.tol),
        "settings": {
            "mem_fraction_static": c.mem_fraction if c.sglang else None,
            "max_total_tokens": c.max_total_tokens if c.sglang else None,
            "sglang_flags": [*SGLANG_FLAGS, "--page-size", "16"] if c.sglang else None,
            "parallel": c.parallel,
            "select": list(c.select) if c.select else None,
            "exclude": list(c.exclude),
            "parity_prompts": c.parity_prompts,
            "parity_max_new_tokens": c.parity_max_new_tokens,
        },
        "backends": {run.name: _run_json(run) for run in res.runs.values()},
        "oracle": {
            "description": res.oracle.description,
            "started": res.oracle.started,
            "startup_s": res.oracle.startup_s,
            "start_error": res.oracle.start_error,
            "commands": res.oracle.commands,
        },
        "parity": _parity_json(res.parity) if res.parity is not None else None,
        "parity_error": res.parity_error,
        "notes": res.notes,
    }


_CELL = {Outcome.PASS: "pass", Outcome.FAIL: "**FAIL**", Outcome.SKIP: "skip", Outcome.ERROR: "**ERROR**"}


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def result_markdown(res: TierResult) -> str:
    """The results page: header, backends, tolerances and the check table, failures, skips,
    measurements, parity, cache-hit drift, notes."""
    runs = list(res.runs.values())
    lines = [
        *_md_header(res, runs),
        *_md_backends(res, runs),
        *_md_checks(res.config, runs),
        *_md_outcomes(runs),
        *_md_parity(res),
        *_md_drift(res, runs),
    ]
    return "\n".join(lines) + "\n"


def _md_header(res: TierResult, runs: list[_BackendRun]) -> list[str]:
    c = res.config
    totals = {k: sum(r.counts()[k] for r in runs) for k in ("pass", "fail", "skip", "error", "not_run")}
    v = res.versions
    return [
        "# Conformance results: GPU tier",
        "",
        f"* date: {res.date}",
        f"* engine: `{c.engine}`" + (" (bf16 SGLang)" if c.sglang else " (reference workers on CPU)"),
        f"* GPU: {res.gpu or 'none found (nvidia-smi)'}; `--gpus {','.join(c.gpus)}`",
        "* versions: " + ", ".join(f"{k} {v.get(k) or '-'}" for k in v),
        f"* wall time: {res.wall_s:.1f} s of a {c.budget_s:.0f} s budget ("
        + ", ".join(f"{k.removesuffix('_s')} {s:.1f} s" for k, s in res.stages.items())
        + ")"
        + (" — **budget exhausted**" if res.budget_exhausted else ""),
        f"* checks: {totals['pass']} pass, {totals['fail']} fail, {totals['skip']} skip, {totals['error']} error, "
        f"{totals['not_run']} not run; overall **{'OK' if res.ok else 'NOT OK'}**",
        "",
        "## Backends",
        "",
        "| backend | what | start-up | pass | fail | skip | error | not run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]


def _md_backends(res: TierResult, runs: list[_BackendRun]) -> list[str]:
    lines: list[str] = []
    for r in [*runs, res.oracle]:
        n = r.counts()
        start = f"{r.startup_s:.0f} s" if r.started and r.startup_s is not None else "**failed**"
        if r is res.oracle:
            lines.append(f"| {r.name} | {_md_escape(r.description)} | {start} | | | | | |")
        else:
            lines.append(
                f"| {r.name} | {_md_escape(r.description)} | {start} | {n['pass']} | {n['fail']} | {n['skip']} | "
                f"{n['error']} | {n['not_run']} |"
            )
    errors = [r for r in [*runs, res.oracle] if r.start_error]
    for r in errors:
        lines.append(f"\n{r.name} did not start: `{_md_escape(_first_line(r.start_error or '', 400))}`")
    return lines


def _md_checks(c: TierConfig, runs: list[_BackendRun]) -> list[str]:
    """The tolerances and the check x backend table."""
    t = c.tol
    lines = [
        "",
        "## Tolerances (|Δlogprob|)",
        "",
        f"{t.why}.",
        "",
        "| where | tolerance |",
        "| --- | --- |",
        f"| same engine, two runs (cache hits, batching, retract; `Harness.logprob_tolerance`) | {t.logprob:g} |",
        f"| backend vs float32 transformers on CPU (`hf_logprob_tolerance`, parity) | {t.hf:g} |",
        f"| across backends, cold caches (parity) | {t.parity:g} |",
        "",
        "Greedy token ids must be identical everywhere.",
        "",
        "## Checks",
        "",
        "| check | " + " | ".join(r.name for r in runs) + " |",
        "| --- | " + " | ".join("---" for _ in runs) + " |",
    ]
    names: list[str] = []
    for r in runs:
        for x in r.results:
            if x.name not in names:
                names.append(x.name)
        for nm in [*([r.interrupted] if r.interrupted else []), *r.not_run]:
            if nm not in names:
                names.append(nm)
    for nm in names:
        cells = []
        for r in runs:
            found = next((x for x in r.results if x.name == nm), None)
            if found is not None:
                cells.append(f"{_CELL[found.outcome]} {found.duration_s:.1f}s")
            elif nm == r.interrupted:
                cells.append("**interrupted**")
            elif nm in r.not_run:
                cells.append("not run")
            else:
                cells.append("")
        lines.append(f"| {nm} | " + " | ".join(cells) + " |")
    return lines


def _md_outcomes(runs: list[_BackendRun]) -> list[str]:
    """Failures and errors, skips grouped by reason, and what the passing checks measured."""
    lines: list[str] = []
    bad = [(r, x) for r in runs for x in r.results if x.outcome in (Outcome.FAIL, Outcome.ERROR)]
    if bad:
        lines += ["", "## Failures and errors", ""]
        for r, x in bad:
            meas = ", ".join(f"{k}={_fmt(val)}" for k, val in x.measurements.items())
            lines.append(
                f"* {r.name} / `{x.name}` ({x.outcome.value}): {_md_escape(_first_line(x.message, 400))}"
                + (f" [{_md_escape(meas)}]" if meas else "")
            )
    skips: dict[str, list[str]] = {}
    for r in runs:
        for x in r.results:
            if x.outcome is Outcome.SKIP:
                skips.setdefault(_first_line(x.message, 300), []).append(f"{r.name}/{x.name}")
    if skips:
        lines += ["", "## Skips", ""]
        for reason, where in skips.items():
            lines.append(f"* {_md_escape(reason)}: {', '.join(where)}")
    measured = [(r, x) for r in runs for x in r.results if x.measurements and x.outcome is Outcome.PASS]
    if measured:
        lines += ["", "## Measured (passing checks)", ""]
        for r, x in measured:
            meas = ", ".join(f"{k}={_fmt(val)}" for k, val in x.measurements.items())
            lines.append(f"* {r.name} / `{x.name}`: {_md_escape(meas)}")
    return lines


def _md_parity(res: TierResult) -> list[str]:
    c = res.config
    lines = ["", "## Parity (greedy, cold caches: a flush before each prompt)", ""]
    if res.parity is None:
        lines.append(f"not measured: {res.parity_error or 'no backend started'}")
    else:
        p = res.parity
        lines += [
            f"{p.cases} prompts of 1-57 tokens, {c.parity_max_new_tokens} new tokens each, {p.duration_s:.1f} s.",
            "",
            "| pair | greedy ids | first mismatch (case, token) | max \\|Δlogprob\\| | top-k compared "
            "| max \\|Δ top logprob\\| | max \\|Δ prompt logprob\\| | tolerance | ok |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for pp in p.pairs:
            mm = f"{pp.first_mismatch}" if pp.first_mismatch else "-"
            top = f"{pp.top_logprobs_compared}" + (f" (differ at {pp.top_mismatch})" if pp.top_mismatch else "")
            prompt = f"{pp.max_abs_dprompt_logprob:.3g}" if pp.prompt_logprobs_compared else "not compared"
            lines.append(
                f"| {pp.a} ~ {pp.b} | {'identical' if pp.ids_equal else '**differ**'} | {mm} | "
                f"{pp.max_abs_dlogprob:.3g} | {top} | {pp.max_abs_dtop_logprob:.3g} | {prompt} | {pp.tolerance:g} | "
                f"{'yes' if pp.ok else '**no**'} |"
            )
        lines += [
            "",
            "Against transformers (float32 forward on CPU over each backend's own output ids):",
            "",
            "| backend | max \\|Δlogprob\\| | mean \\|Δlogprob\\| | tokens | tolerance | ok |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for h in p.hf:
            lines.append(
                f"| {h.backend} | {h.max_abs_dlogprob:.3g} | {h.mean_abs_dlogprob:.3g} | {h.tokens} | "
                f"{h.tolerance:g} | {'yes' if h.ok else '**no**'} |"
            )
    return lines


def _md_drift(res: TierResult, runs: list[_BackendRun]) -> list[str]:
    """Cache-hit drift per backend, then the run's notes."""
    lines = [
        "",
        "## Cache-hit drift (the parity prompts twice, no flush in between)",
        "",
        "| backend | ids identical | max \\|Δlogprob\\| | cached tokens, 2nd run / prompt tokens |",
        "| --- | --- | --- | --- |",
    ]
    for r in runs:
        d = r.drift
        if d is None:
            lines.append(f"| {r.name} | not measured | | |")
        elif "error" in d:
            lines.append(f"| {r.name} | error: {_md_escape(_first_line(str(d['error']), 200))} | | |")
        else:
            lines.append(
                f"| {r.name} | {d['ids_identical']}/{d['prompts']} | {d['max_abs_dlogprob']:.3g} | "
                f"{d['cached_tokens_second_run']} / {d['prompt_tokens']} |"
            )
    if res.notes:
        lines += ["", "## Notes", ""]
        lines += [f"* {_md_escape(_first_line(n, 500))}" for n in res.notes]
    return lines


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_NOTEWORTHY = re.compile(r"Traceback|Error|ERROR|panic|FAIL|Killed|out of memory|CUDA", re.IGNORECASE)


def _tail_file(path: Path, n: int = 40, width: int = 300, noteworthy: int = 30, limit: int = 16384) -> str:
    """The last ``n`` lines of a log (ANSI colours stripped), after up to ``noteworthy`` earlier lines
    that look like errors (the last lines of a log are often the teardown, not the failure)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4 * 1024 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    lines = [_ANSI.sub("", line)[:width] for line in data.splitlines()]
    head, tail = lines[:-n], lines[-n:]
    picked = [line for line in head if _NOTEWORTHY.search(line)]
    out = []
    if picked:
        out.append(f"(error-like lines before the tail: {min(len(picked), noteworthy)} of {len(picked)})")
        out.extend(picked[:noteworthy])
        out.append(f"(last {len(tail)} lines)")
    out.extend(tail)
    text = "\n".join(out)
    return text if len(text) <= limit else "...\n" + text[-limit:]


def logs_tail(res: TierResult) -> str:
    """Log tails of each backend that failed to start or failed a check, and the failed checks' tracebacks."""
    parts: list[str] = []
    for r in [*res.runs.values(), res.oracle]:
        bad = [x for x in r.results if x.outcome in (Outcome.FAIL, Outcome.ERROR)]
        if not (r.start_error or bad or r.interrupted):
            continue
        parts.append(f"===== {r.name}: {r.description}")
        if r.start_error:
            parts.append(f"start-up failed: {r.start_error[:4000]}")
        for x in bad:
            parts.append(f"--- {x.name} ({x.outcome.value}): {x.message[:1000]}")
            if x.traceback:
                parts.append("\n".join(x.traceback.strip().splitlines()[-25:]))
        for log in sorted(r.log_dir.glob("*.log")) if r.log_dir.is_dir() else []:
            parts.append(f"--- tail of {r.name}/{log.name}")
            parts.append(_tail_file(log))
    if res.parity_error:
        parts.append(f"===== parity error: {res.parity_error}")
    text = "\n".join(parts) + "\n" if parts else "no failures: nothing to show\n"
    if len(text) > LOGS_TAIL_LIMIT:
        text = text[: LOGS_TAIL_LIMIT - 40] + "\n... (truncated)\n"
    return text


def summary(res: TierResult) -> str:
    runs = list(res.runs.values())
    lines = [f"gpu-tier {res.config.engine}: {'OK' if res.ok else 'NOT OK'} in {res.wall_s:.0f}s (GPU: {res.gpu})"]
    for r in runs:
        n = r.counts()
        start = f"up {r.startup_s:.0f}s" if r.started and r.startup_s is not None else "START FAILED"
        lines.append(
            f"  {r.name:14} {start:13} {n['pass']:2} pass {n['fail']:2} fail {n['skip']:2} skip "
            f"{n['error']:2} error {n['not_run']:2} not run"
        )
    if res.parity is not None:
        p = res.parity
        worst = max((x.max_abs_dlogprob for x in p.pairs), default=0.0)
        hf = ", ".join(f"{h.backend} {h.max_abs_dlogprob:.3g}" for h in p.hf)
        lines.append(
            f"  parity: {'ok' if p.ok else 'NOT OK'}; ids identical in {sum(x.ids_equal for x in p.pairs)}/"
            f"{len(p.pairs)} pairs; max |dlogprob| {worst:.3g}; vs transformers: {hf}"
        )
    drift = ", ".join(
        f"{r.name} {r.drift['max_abs_dlogprob']:.3g}" for r in runs if r.drift and "max_abs_dlogprob" in r.drift
    )
    if drift:
        lines.append(f"  cache-hit drift (max |dlogprob|): {drift}")
    for r in runs:
        for x in r.results:
            if x.outcome in (Outcome.FAIL, Outcome.ERROR):
                lines.append(f"  {x.outcome.value.upper()} {r.name}/{x.name}: {_first_line(x.message, 160)}")
    return "\n".join(lines)


# -- entry points -----------------------------------------------------------------------------------


async def run_gpu_tier(config: TierConfig) -> TierResult:
    """Run the whole tier (see the module docstring); never leaves a process behind."""
    return await _Tier(config).run()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m rb_bench.gpu_tier",
        description="The GPU tier of the rollout-backends conformance suite: SGLang direct, SGLang behind smg "
        "and Dynamo, with an oracle on other weights; results to DIR.",
    )
    ap.add_argument("--out", required=True, metavar="DIR", help="where the results go (created)")
    ap.add_argument("--engine", choices=ENGINES, default="sglang", help="sglang (GPU) or reference (CPU dry run)")
    ap.add_argument("--gpus", default="0", help="GPU indices, e.g. 0 or 0,1 (the last of 2+ holds the NCCL trainer)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="hard limit for the whole run, teardown included")
    ap.add_argument("--check", action="append", default=None, metavar="PATTERN", help="run only these checks")
    ap.add_argument("--exclude", action="append", default=[], metavar="PATTERN", help="leave these checks out")
    ap.add_argument(
        "--backends", default=None, help=f"subset of {','.join(OWN_BACKENDS)} (default: {','.join(DEFAULT_BACKENDS)})"
    )
    ap.add_argument("--dynamo16-python", default=None, metavar="CMD",
                    help="interpreter of a second Dynamo fleet (e.g. ai-dynamo 1.6.1): adds dynamo16")  # fmt: skip
    ap.add_argument("--dynamo16-shim", action="store_true", help="run that fleet's workers through our shim")
    ap.add_argument("--sequential", action="store_true", help="run the backends' suites one after the other")
    ap.add_argument("--mem-fraction", type=float, default=0.12, help="--mem-fraction-static of each SGLang engine")
    ap.add_argument("--max-total-tokens", type=int, default=65536, help="KV pool of each SGLang engine (tokens)")
    ap.add_argument("--concurrency", type=int, default=None, help="requests of the concurrency check")
    ap.add_argument("--logprob-tol", type=float, default=None)
    ap.add_argument("--hf-tol", type=float, default=None)
    ap.add_argument("--parity-tol", type=float, default=None)
    ap.add_argument("--parity-prompts", type=int, default=8)
    ap.add_argument("--startup-timeout-s", type=float, default=420.0)
    ap.add_argument("--check-timeout-s", type=float, default=None)
    ap.add_argument("--work-dir", default=None, help="models and logs (default: a temporary directory, removed)")
    ap.add_argument("--keep-work", action="store_true", help="keep the temporary work directory")
    ap.add_argument("--quiet", action="store_true")
    return ap


def config_from_args(argv: Sequence[str] | None = None) -> TierConfig:
    args = _parser().parse_args(argv)
    second = ("dynamo16",) if args.dynamo16_python else ()
    backends = _csv(args.backends) if args.backends else (*DEFAULT_BACKENDS, *second)
    others = [b for b in backends if b not in OWN_BACKENDS]
    if others:  # vLLM's backends have their own runner (a typo is caught here too)
        raise ValueError(f"--backends takes {sorted(OWN_BACKENDS)}, got {others} (vLLM: python -m rb_bench.vllm_tier)")
    engine: str = args.engine
    base = DEFAULT_TOLERANCES[engine]
    tol = Tolerances(
        logprob=args.logprob_tol if args.logprob_tol is not None else base.logprob,
        hf=args.hf_tol if args.hf_tol is not None else base.hf,
        parity=args.parity_tol if args.parity_tol is not None else base.parity,
        why=base.why,
    )
    return TierConfig(
        out=args.out,
        engine=engine,
        gpus=_csv(args.gpus),
        budget_s=args.budget_s,
        select=tuple(args.check) if args.check else None,
        exclude=tuple(args.exclude),
        backends=backends,
        dynamo16_python=args.dynamo16_python,
        dynamo16_shim=args.dynamo16_shim,
        parallel=not args.sequential,
        mem_fraction=args.mem_fraction,
        max_total_tokens=args.max_total_tokens,
        concurrency=args.concurrency,
        tolerances=tol,
        parity_prompts=args.parity_prompts,
        startup_timeout_s=args.startup_timeout_s,
        check_timeout_s=args.check_timeout_s,
        work_dir=args.work_dir,
        keep_work=args.keep_work,
        quiet=args.quiet,
    )


async def _main_async(config: TierConfig) -> TierResult:
    loop = asyncio.get_running_loop()
    tier = _Tier(config)
    inner = asyncio.ensure_future(tier.run())
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, inner.cancel)
    try:
        return await inner
    except asyncio.CancelledError:  # a second signal during teardown
        return tier.result


def _run_without_waiting_for_stuck_threads(coro: Any) -> Any:
    """``asyncio.run`` without its final wait on the default executor.

    A collective that never returns (a hung NCCL broadcast in a sender thread) would otherwise hold
    the process for 300 s after the results are written (seen on the H200). The results and the
    teardown are done by then; a thread still blocked in a collective is abandoned.
    """
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
        executor = getattr(loop, "_default_executor", None)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        loop.close()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = config_from_args(argv)
        select_checks(config.select, config.exclude or None)  # a typo fails here, before anything starts
    except ValueError as exc:
        print(f"gpu_tier: {exc}", file=sys.stderr)
        return 2
    res = _run_without_waiting_for_stuck_threads(_main_async(config))
    print(summary(res), flush=True)
    print(f"results: {config.out / RESULTS_MD}, {config.out / RESULTS_JSON}, {config.out / LOGS_TAIL}", flush=True)
    rc = 0 if res.ok else 1
    stuck = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if stuck and __name__ == "__main__":
        # Interpreter exit would join them (concurrent.futures' atexit hook): leave now instead.
        print(f"gpu_tier: abandoning {len(stuck)} stuck thread(s) at exit", file=sys.stderr, flush=True)
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
