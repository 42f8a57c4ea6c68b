"""``RolloutEngine``: Miles' ``SGLangEngine`` actor surface over one worker of any backend.

Every method Miles calls on an engine handle (miles.md §1.1/§1.2, radixark/miles ``31f1ca961a94``)
exists with SGLangEngine's argument names and defaults, and acts on the backend with
``workers=[<this engine's worker>]``. It is a plain class: use it as a Ray actor with
``ray.remote(RolloutEngine)``; Ray is not imported.

Methods are synchronous, like SGLangEngine's (Ray runs them in the actor's thread). The backend's
coroutines run on one event loop per process, in a daemon thread, shared by every engine of the
process, so one backend client serves them all.

Results follow SGLangEngine's: weight calls return SGLang's ``{"success": true, "message": ...}``
dicts; a failure raises (SGLangEngine raises on an HTTP error status), with the backend's error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from rollout_backends import (
    ControlFailed,
    GenerateRequest,
    InvalidRequest,
    MemoryTag,
    PauseMode,
    RolloutBackend,
    RolloutBackendError,
    SamplingParams,
    TensorSpec,
    Unsupported,
    WeightBucket,
)
from rollout_backends import WeightGroup as _WeightGroup

from ._config import backend_url, get_backend
from ._shapes import decode_tensor_payload

__all__ = ["EngineCrashed", "RolloutEngine"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class EngineCrashed(RolloutBackendError):
    """The engine was shut down (``shutdown``/``simulate_crash``); Miles' health monitor sees this."""


class _LoopThread:
    """One asyncio loop in a daemon thread, shared by every engine of the process."""

    _lock = threading.Lock()
    _instance: _LoopThread | None = None

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-backends-miles", daemon=True)
        self.thread.start()

    @classmethod
    def get(cls) -> _LoopThread:
        with cls._lock:
            if cls._instance is None or not cls._instance.thread.is_alive():
                cls._instance = cls()
            return cls._instance

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no answer within {timeout}s") from None


def _ok(message: str, **extra: Any) -> dict[str, Any]:
    return {"success": True, "message": message, **extra}


def _free_ports(start_port: int, consecutive: int) -> int:
    """The first port >= ``start_port`` where ``consecutive`` ports in a row are free."""
    port = start_port
    while port + consecutive <= 65536:
        try:
            for p in range(port, port + consecutive):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("", p))
            return port
        except OSError:
            port += 1
    raise RuntimeError(f"no {consecutive} consecutive free ports from {start_port}")


def _node_ip() -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outbound interface
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class RolloutEngine:
    """SGLangEngine's public surface over one worker of a ``RolloutBackend``.

    The backend URL comes from ``args`` (``--rollout-backend-url``, or ``--rollout-backend`` with the
    router address, see ``backend_url``) unless ``backend_url`` is given. The worker is ``worker``,
    or the backend's ``workers[engine index]`` where the engine index is ``rank`` divided by the
    nodes per engine (SGLangEngine's ``node_rank = rank % nnodes``); only node rank 0 acts, as in
    SGLangEngine.
    """

    def __init__(
        self,
        args: Any,
        rank: int,
        worker_type: str = "regular",
        base_gpu_id: int | None = None,
        sglang_overrides: dict[str, Any] | None = None,
        num_gpus_per_engine: int | None = None,
        *,
        backend_url: str | None = None,
        worker: str | None = None,
        call_timeout: float | None = None,
        flush_retries: int = 60,
        flush_retry_interval: float = 1.0,
    ) -> None:
        self.args = args
        self.rank = rank
        self.worker_type = worker_type
        self.base_gpu_id = base_gpu_id
        self.sglang_overrides = sglang_overrides or {}
        self.num_gpus_per_engine = num_gpus_per_engine
        self._url = backend_url
        self._worker = worker
        self._call_timeout = call_timeout
        self._flush_retries = flush_retries
        self._flush_retry_interval = flush_retry_interval
        gpus = num_gpus_per_engine or getattr(args, "rollout_num_gpus_per_engine", 1) or 1
        per_node = getattr(args, "num_gpus_per_node", None) or gpus
        self._nnodes = max(1, int(gpus) // int(per_node))
        self.node_rank = rank % self._nnodes
        self._backend: RolloutBackend | None = None
        self._released: set[MemoryTag] = set()
        self._crashed = False
        self.server_host: str | None = None
        self.server_port: int | None = None
        self.router_ip: str | None = None
        self.router_port: int | None = None
        self.master_addr: str | None = None
        self.master_port: int | None = None

    # -- plumbing -----------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        return _LoopThread.get().run(coro, timeout if timeout is not None else self._call_timeout)

    @property
    def backend(self) -> RolloutBackend:
        if self._crashed:
            raise EngineCrashed(f"engine rank {self.rank} ({self._worker}) was shut down")
        if self._backend is None:
            raise RuntimeError("RolloutEngine.init() has not been called")
        return self._backend

    @property
    def worker(self) -> str:
        self.backend  # noqa: B018  (raises if not initialised or crashed)
        assert self._worker is not None
        return self._worker

    @property
    def _sel(self) -> list[str]:
        return [self.worker]

    def _acts(self) -> bool:
        """SGLangEngine sends HTTP calls from node rank 0 only."""
        return self.node_rank == 0

    # -- lifecycle ----------------------------------------------------------------------------

    @staticmethod
    def _get_current_node_ip_and_free_port(start_port: int = 10000, consecutive: int = 1) -> tuple[str, int]:
        return _node_ip(), _free_ports(start_port, consecutive)

    def get_master_addr_and_port(self) -> tuple[str | None, int | None]:
        return self.master_addr, self.master_port

    def init(
        self,
        dist_init_addr: str | None = None,
        port: int | None = None,
        nccl_port: int | None = None,
        host: str | None = None,
        disaggregation_bootstrap_port: int | None = None,
        router_ip: str | None = None,
        router_port: int | None = None,
        engine_info_bootstrap_port: int | None = None,
    ) -> None:
        """Open the backend (once per process), bind this engine's worker and wait until it is ready.

        The address arguments Miles allocates are recorded but unused: the worker already runs.
        """
        if self.worker_type != "regular":
            raise Unsupported("worker_type", f"{self.worker_type!r} (PD disaggregation) engines are not supported")
        self.router_ip = router_ip if router_ip is not None else getattr(self.args, "sglang_router_ip", None)
        self.router_port = router_port if router_port is not None else getattr(self.args, "sglang_router_port", None)
        self.server_host = host
        self.server_port = port
        url = self._url or backend_url(self.args)
        self._url = url
        self._backend = self._run(get_backend(url))
        workers = self._backend.workers
        if self._worker is None:
            index = self.rank // self._nnodes
            if index >= len(workers):
                raise InvalidRequest("rank", f"engine {index} has no worker: the backend has {list(workers)}")
            self._worker = workers[index]
        elif self._worker not in workers:
            raise InvalidRequest("worker", f"unknown worker {self._worker!r} (known: {list(workers)})")
        timeout = float(getattr(self.args, "rollout_backend_ready_timeout", 600.0))
        self._run(self._wait_worker_ready(timeout))

    async def _wait_worker_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            report = await self.backend.health()
            h = report.worker(self.worker)
            if h.live and h.ready:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"worker {self.worker} not ready after {timeout:.0f}s ({h.error})")
            await asyncio.sleep(0.5)

    def shutdown(self) -> None:
        """Stop using the backend. The worker keeps running (its fleet is not this actor's)."""
        self._crashed = True
        self._backend = None

    def simulate_crash(self) -> None:
        """Miles' fault-injection hook: afterwards every call raises ``EngineCrashed``."""
        logger.info("simulate_crash on engine rank %s (%s)", self.rank, self._worker)
        self.shutdown()

    def get_topology_info(self) -> dict[str, Any]:
        return {
            "url": f"{self._url}#{self._worker}",
            "node_ip": _node_ip(),
            "gpu_ids": [],
            "gpu_uuids": [],
            "worker_type": self.worker_type,
            "node_rank": self.node_rank,
        }

    # -- health and info ----------------------------------------------------------------------

    def health_generate(self, timeout: float = 5.0) -> bool:
        """A 1-token greedy generation on this worker (SGLang's ``/health_generate``); raises on failure."""
        if not self._acts():
            return True
        backend = self.backend
        if backend.capabilities.worker_pinning:
            req = GenerateRequest(
                input_ids=(0,),
                sampling=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
                worker=self.worker,
                return_logprobs=False,
            )
            gen = self._run(asyncio.wait_for(backend.generate(req), timeout), timeout + 1.0)
            if len(gen.output_ids) != 1:
                raise RuntimeError(f"health probe on {self.worker} produced {len(gen.output_ids)} tokens")
            return True
        report = self._run(asyncio.wait_for(backend.health(probe=True), timeout), timeout + 1.0)
        if not report.worker(self.worker).making_progress:
            raise RuntimeError(f"worker {self.worker} is not making progress ({report.worker(self.worker).error})")
        return True

    def get_weight_version(self) -> str | None:
        if not self._acts():
            return None
        return self._run(self.backend.weight_versions()).get(self.worker)

    def get_server_info(self) -> dict[str, Any]:
        caps = self.backend.capabilities
        return {
            "version": "rollout-backends",
            "worker": self.worker,
            "backend_url": self._url,
            "tp_size": self.num_gpus_per_engine,
            "context_length": caps.max_context,
            "enable_memory_saver": caps.memory_release,
            "weight_version": self.get_weight_version(),
        }

    def get_parallelism_info(self, rank: int) -> dict[str, Any]:
        raise Unsupported("p2p_weight_transfer", "get_parallelism_info is for --update-weight-transfer-mode p2p")

    def get_remote_instance_transfer_engine_info(self, rank: int) -> Any:
        raise Unsupported("p2p_weight_transfer", "transfer-engine info is for --update-weight-transfer-mode p2p")

    # -- generation control ---------------------------------------------------------------------

    def pause_generation(self, mode: str = "retract") -> dict[str, Any]:
        try:
            pause_mode = PauseMode(mode)
        except ValueError:
            raise InvalidRequest("mode", f"unknown pause mode {mode!r}") from None
        self._run(self.backend.pause(pause_mode, workers=self._sel))
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self) -> dict[str, Any]:
        self._run(self.backend.resume(workers=self._sel))
        return {"message": "Generation continued successfully.", "status": "ok"}

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Not on SGLangEngine (Miles aborts over HTTP); for Ray actors of one's own."""
        if abort_all:
            self._run(self.backend.abort_all(workers=self._sel))
        elif rid:
            self._run(self.backend.abort(rid))

    def flush_cache(self) -> None:
        """Flush this worker's prefix cache; like SGLangEngine, retried while refused, then TimeoutError."""
        if not self._acts():
            return
        last: str | None = None
        for attempt in range(self._flush_retries):
            try:
                self._run(self.backend.flush_cache(workers=self._sel))
                return
            except ControlFailed as exc:
                last = str(exc)
                logger.info("flush_cache on %s refused (%s), attempt %d", self.worker, exc, attempt + 1)
            time.sleep(self._flush_retry_interval)
        raise TimeoutError(f"Timeout while flushing cache: {last}")

    # -- weights --------------------------------------------------------------------------------

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict[str, Any] | None:
        if not self._acts():
            return None
        group = _WeightGroup(
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            rank_offset=rank_offset,
            group_name=group_name,
            backend=backend,
        )
        self._run(self.backend.init_weight_group(group, workers=self._sel))
        return _ok("Succeeded to initialize custom process group.")

    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any] | None:
        """Errors are swallowed, as in SGLangEngine (a new engine may not have the group)."""
        if not self._acts():
            return None
        try:
            self._run(self.backend.destroy_weight_group(group_name, workers=self._sel))
        except RolloutBackendError as exc:
            logger.info("destroy_weights_update_group(%s) on %s: %s", group_name, self._worker, exc)
            return None
        return _ok("Succeeded to destroy custom process group.")

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        flush_cache: bool = False,
        weight_version: str | None = None,
        selector: str = "all",
    ) -> dict[str, Any] | None:
        """``selector`` is carried by ``begin_weight_update`` in the protocol; accepted here for Miles."""
        if not self._acts():
            return None
        bucket = WeightBucket(
            tuple(TensorSpec(n, d, tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes, strict=True))
        )
        self._run(
            self.backend.update_weights_from_distributed(
                bucket, group_name=group_name, version=weight_version, flush_cache=flush_cache, workers=self._sel
            )
        )
        return _ok("Succeeded to update parameter online from distributed.")

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
        selector: str = "all",
    ) -> dict[str, Any] | None:
        """SGLang's serialized payloads (one per TP rank, CUDA-IPC handles on GPU) are decoded to
        named tensors (rank 0's entry; ``flattened_bucket`` is unflattened) and handed to the backend."""
        if not self._acts():
            return None
        if not serialized_named_tensors:
            raise InvalidRequest("serialized_named_tensors", "must be a non-empty list (one entry per TP rank)")
        named = decode_tensor_payload(serialized_named_tensors[0], load_format)
        self._run(
            self.backend.update_weights_from_tensors(
                named, version=weight_version, flush_cache=flush_cache, workers=self._sel
            )
        )
        return _ok("Succeeded to update parameter online from tensor.")

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None
    ) -> dict[str, Any] | None:
        if not self._acts():
            return None
        # SGLang's flush_cache defaults to true for disk loads; SGLangEngine does not override it.
        self._run(
            self.backend.update_weights_from_disk(
                model_path, version=weight_version, load_format=load_format, flush_cache=True, workers=self._sel
            )
        )
        return _ok("Succeeded to update model weights.", num_paused_requests=0)

    def begin_weight_update(self, selector: str = "all") -> dict[str, Any] | None:
        if not self._acts():
            return None
        self._run(self.backend.begin_weight_update(selector, workers=self._sel))
        return _ok("Weight update session opened.")

    def end_weight_update(self) -> dict[str, Any] | None:
        if not self._acts():
            return None
        self._run(self.backend.end_weight_update(workers=self._sel))
        return _ok("Weight update session closed.")

    def update_weight_version(self, weight_version: str) -> dict[str, Any] | None:
        """Never aborts in-flight requests (Miles sends ``abort_all_requests: False``)."""
        if not self._acts():
            return None
        self._run(self.backend.set_weight_version(weight_version, workers=self._sel))
        return _ok(f"Weight version updated to {weight_version}", new_version=weight_version)

    def check_weights(
        self,
        action: str,
        allow_quant_error: bool = False,
        selector: str = "all",
        skip_list: list[str] | None = None,
    ) -> dict[str, Any]:
        raise Unsupported("weights_checker", "weight checksums are not part of the protocol")

    def pull_weights(self, target_version: int) -> dict[str, Any]:
        raise Unsupported("pull_weights", "disk-delta pulls are not part of the protocol; use update_weights_from_disk")

    # -- memory -----------------------------------------------------------------------------------

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Flush, then really release the worker's memory through the backend (like SGLangEngine).

        The worker stays in the fleet; ``resume_memory_occupation`` gives the memory back and the
        backend routes to it again (Dynamo's adapter re-registers it).
        """
        if not self._acts():
            return None
        self.flush_cache()
        self._run(self.backend.release_memory(tags, workers=self._sel))
        self._released |= {MemoryTag(t) for t in tags} if tags is not None else set(MemoryTag)
        return None

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        if not self._acts():
            return None
        self._run(self.backend.resume_memory(tags, workers=self._sel))
        self._released -= {MemoryTag(t) for t in tags} if tags is not None else set(MemoryTag)
        return None

    @property
    def released_memory(self) -> frozenset[MemoryTag]:
        """What this engine released and has not resumed (for tests and dashboards)."""
        return frozenset(self._released)

    # -- LoRA and profiling: not in the protocol ----------------------------------------------------

    def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict[str, Any],
        serialized_tensors: str | None = None,
        serialized_named_tensors: list[Any] | None = None,
        load_format: str | None = None,
        pinned: bool = False,
        added_tokens_config: dict[str, Any] | None = None,
        upsert: bool = False,
        expected_checksums: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        raise Unsupported("lora", "LoRA adapters are not part of the protocol")

    def load_lora_adapter_from_distributed(
        self,
        lora_name: str,
        config_dict: dict[str, Any],
        names: list[str],
        dtypes: list[Any],
        shapes: list[Any],
        group_name: str,
        pinned: bool = False,
        added_tokens_config: dict[str, Any] | None = None,
        upsert: bool = False,
    ) -> dict[str, Any]:
        raise Unsupported("lora", "LoRA adapters are not part of the protocol")

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        raise Unsupported("lora", "LoRA adapters are not part of the protocol")

    def start_profile(
        self,
        output_dir: str | None = None,
        start_step: int | None = None,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        profile_by_stage: bool = False,
        with_stack: bool | None = None,
        record_shapes: bool | None = None,
    ) -> None:
        raise Unsupported("profiling", "profile the engines with their own tools")

    def stop_profile(self) -> None:
        raise Unsupported("profiling", "profile the engines with their own tools")
