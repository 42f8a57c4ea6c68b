"""Launch N vLLM servers (no router: the fleet hands unpinned requests to each in turn)::

    cfg = VllmFleetConfig(model_path="/m/tiny", workers=2, gpus=("0", "1"))
    async with launch_vllm_fleet(cfg) as fleet:
        gen = await fleet.backend.generate(GenerateRequest(input_ids=[1, 2, 3]))
    # every server is stopped here

The processes are started by :func:`rollout_backends.launch.launch_fleet` (``Local`` placement) under
one ``Supervisor``, like every fleet's; a failed start stops what started and raises with log tails.
Without ``log_dir`` the logs go to a temporary folder, removed after a clean stop unless
``keep_run_dir``, and kept when the start failed (the error names the log).
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlencode

import attrs

from rollout_backends import InvalidRequest
from rollout_backends.kit import HttpFleetBackend, worker_id_of
from rollout_backends.launch import (
    Local,
    ReadyProgress,
    RunningFleet,
    Supervisor,
    carry,
    env_map,
    launch_fleet,
    require_model_dir,
    require_module,
    str_tuple,
)

from ._client import vocab_size_of
from ._launch import VllmServerCommand

__all__ = ["RunningVllmFleet", "VllmFleetConfig", "launch_vllm_fleet", "server_command"]


@attrs.frozen(slots=True, kw_only=True)
class VllmFleetConfig:
    """What to launch. Only ``model_path`` is required; the server flags are ``VllmServerCommand``'s.

    ``gpus``: one ``CUDA_VISIBLE_DEVICES`` value per server (``"0"``, ``"0,1"`` for TP 2); servers
    sharing a GPU split ``gpu_memory_utilization`` (default ``0.8 / n`` for ``n`` on one device).
    The defaults are the command line's too (``launch vllm`` reads them from these fields).
    """

    model_path: str = attrs.field(converter=str)
    #: One server unless told: each takes a GPU, and how many the host has is the caller's to say.
    workers: int = 1
    host: str = "127.0.0.1"
    gpus: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
    served_model_name: str | None = None
    tp: int = 1
    enforce_eager: bool = True
    attention_backend: str | None = "TRITON_ATTN"
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    transfer_backend: str | None = None
    sleep_mode: bool = False
    seed: int | None = None
    batch_invariant: bool = False
    #: The label the fleet's versions start at (vLLM 0.26 keeps none of its own).
    weight_version: str = "default"
    extra_args: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
    env: Mapping[str, str] = attrs.field(factory=dict, converter=env_map)
    log_dir: str | None = None
    startup_timeout_s: float = 900.0
    python: str = sys.executable

    def __attrs_post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise InvalidRequest("workers", f"must be an int >= 1, got {self.workers!r}")
        if self.gpus and len(self.gpus) != self.workers:
            raise InvalidRequest("gpus", f"one CUDA_VISIBLE_DEVICES value per server ({self.workers}), got {self.gpus}")

    def describe(self) -> str:
        """One line saying what this config starts (the CLI prints it first)."""
        kind = f"{self.workers} x vllm server{'s' if self.workers > 1 else ''}"
        return (
            f"{kind}: vllm serve (vLLM 0.26; GPU); no router (the fleet hands unpinned requests to each "
            f"server in turn); model {self.model_path}"
        )

    def preflight(self) -> None:
        """What can be found wrong on this host before anything starts: the model is a directory
        here, and vLLM is installed (``InvalidRequest`` naming the field)."""
        require_model_dir(self.model_path)
        require_module("vllm", "python", "the servers run vllm serve under this interpreter", self.python)

    def memory_share(self, index: int) -> float | None:
        """``--gpu-memory-utilization`` of server ``index`` (see the class)."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        devices = self.gpus or tuple("0" for _ in range(self.workers))
        mine = set(devices[index].split(","))
        sharing = sum(1 for d in devices if mine & set(d.split(",")))
        return None if sharing <= 1 else round(0.8 / sharing, 3)


def server_command(config: VllmFleetConfig, index: int) -> VllmServerCommand:
    """Server ``index``'s command (same-named config fields carry over)."""
    return carry(VllmServerCommand, config, gpu_memory_utilization=config.memory_share(index))


@attrs.define(eq=False)
class RunningVllmFleet:
    """A launched fleet: its servers, the connected ``backend``, ``connect_url()``."""

    config: VllmFleetConfig
    fleet: RunningFleet
    backend: HttpFleetBackend

    @property
    def worker_urls(self) -> tuple[str, ...]:
        return tuple(e.control_url for e in self.fleet.engines)

    @property
    def log_dir(self) -> str:
        return str(self.fleet.supervisor.log_dir)

    @property
    def supervisor(self) -> Supervisor:
        return self.fleet.supervisor

    def connect_url(self) -> str:
        """A ``vllm://`` URL that ``rollout_backends.open_backend`` opens as this fleet's backend."""
        query = {
            "workers": ",".join(worker_id_of(u) for u in self.worker_urls),
            "cached_tokens": "1",
            "initial_version": self.config.weight_version,
        }
        vocab = vocab_size_of(self.config.model_path)
        if vocab is not None:
            query["vocab_size"] = str(vocab)
        return f"vllm://{self.worker_urls[0].split('://', 1)[1]}?{urlencode(query, safe=',:')}"


@asynccontextmanager
async def launch_vllm_fleet(
    config: VllmFleetConfig,
    *,
    progress: Callable[[ReadyProgress], None] | None = None,
    keep_run_dir: bool = False,
) -> AsyncIterator[RunningVllmFleet]:
    """Start the servers, connect the backend; stop everything on exit. A model that is not a
    directory here, or vLLM missing, fails before anything starts (``VllmFleetConfig.preflight``).

    Without ``config.log_dir`` the logs go to a temporary folder, removed on exit unless
    ``keep_run_dir``, or unless the start failed and wrote logs there (the error names them)."""
    c = config
    c.preflight()
    run_dir = None if c.log_dir is not None else tempfile.mkdtemp(prefix="rollout-backends-vllm-")
    placement = Local(host=c.host, gpu_ids=[g.split(",") for g in c.gpus] if c.gpus else ())
    fleet: RunningFleet | None = None
    try:
        fleet = await launch_fleet(
            [server_command(c, i) for i in range(c.workers)],
            c.workers,
            None,
            placement,
            log_dir=c.log_dir or run_dir,
            ready_timeout=c.startup_timeout_s,
            progress=progress,
        )
        try:
            backend = await fleet.connect(initial_version=c.weight_version)
            yield RunningVllmFleet(config=c, fleet=fleet, backend=backend)
        finally:
            await fleet.aclose()
    finally:
        if run_dir is not None:
            failed_start = fleet is None and any(Path(run_dir).glob("*.log"))
            if not (keep_run_dir or failed_start):
                await asyncio.to_thread(shutil.rmtree, run_dir, True)
