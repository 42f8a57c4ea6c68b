"""Dynamo workers and the frontend as launch commands (``rollout_backends.launch``), for any node.

* :class:`DynamoWorkerCommand`: one worker process per engine: ``dynamo.mocker`` (CPU),
  ``dynamo.sglang`` (GPU; through the logprob shim when the adapter ships it), ``dynamo.vllm``
  (GPU, vLLM 0.26 with the vLLM adapter's flags), or any module taking the same flags. It
  registers in etcd (``DynamoPlanes``) from whatever node it runs on.
* :class:`DynamoFrontend`: ``dynamo.frontend`` on the launcher's node; ready when its ``/health``
  lists every engine's ``generate`` instance in the fleet's namespace and ``/v1/models`` is not empty.

Ports of Dynamo processes are picked below 32768 (1.4.2 parses ``DYN_SYSTEM_PORT`` as an i16).
The same command lines serve ai-dynamo 1.4.x and 1.6.x: the few knobs only one of them reads are
listed together below (``FRONTEND_NATIVE_GENERATE_ENV``, ``SGLANG_RL_FLAG``, ``SGLANG_ENGINE_ROUTES_ENV``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rollout_backends import InvalidRequest
from rollout_backends.kit import HttpFleetBackend, get_json
from rollout_backends.launch import EngineInfo, Launch, NodeContext, ProcessSpec, ReadyCheck, env_map, str_tuple

from ..sglang._launch import kv_events_config
from ..vllm import DEFAULT_LOGPROBS_MODE, VllmServerCommand
from ._services import DynamoPlanes
from ._wire import generate_instances

__all__ = [
    "DEFAULT_STREAM_INTERVAL",
    "DynamoFrontend",
    "DynamoWorkerCommand",
    "generate_instances",
    "vllm_logprobs_mode",
]

#: Dynamo 1.4.2 parses ``DYN_SYSTEM_PORT`` as an i16.
PORT_CEILING = 32768
WORKER_KINDS = ("mocker", "reference", "sglang", "vllm", "module")
#: ``dynamo.mocker --engine-type`` values (ai-dynamo 1.4.2 and 1.6.1: the scheduler it simulates).
MOCKER_ENGINE_TYPES = ("sglang", "vllm")
#: ``--stream-interval`` of ``dynamo.sglang`` workers unless told otherwise (see the field).
DEFAULT_STREAM_INTERVAL = 50
#: ``dynamo.sglang`` through the adapter's shim (per-chunk logprob fix + ``engine_data``).
SGLANG_SHIM = "rollout_backends.adapters.dynamo._sglang_shim"

# -- what differs between ai-dynamo 1.4.x and 1.6.x on the command line, all in one place ----------
# Each knob is read by one version and ignored by the other, so the launcher passes all of them and
# needs no version check (the adapter detects the rest once, at connect: ``_client.py``).
#: Frontend env, 1.6.x: serve SGLang's native ``POST /generate`` (the 1.4.x frontend has no such route).
FRONTEND_NATIVE_GENERATE_ENV = {"DYN_SGLANG_ENABLE_GENERATE": "1"}
#: ``dynamo.sglang`` flag, 1.4.x: registers ``/engine/call_tokenizer_manager`` (pause, flush, weight
#: groups, abort). 1.6.x: only enables ``nvext.metadata_upload``; harmless.
SGLANG_RL_FLAG = "--enable-rl"
#: ``dynamo.sglang`` env, 1.6.x: ``call_tokenizer_manager`` is gone; the engine routes the adapter
#: needs beyond the built-in ones come from this allowlist (``dynamo/sglang/engine_routes.py``:
#: ``<path>[=<method>][:engine|tm]``; SGLang 0.5.21 ``Engine.flush_cache`` /
#: ``init_weights_update_group`` / ``destroy_weights_update_group`` take the JSON keys as kwargs,
#: ``TokenizerManager.abort_request(rid, abort_all)``). 1.4.x does not read it.
SGLANG_ENGINE_ROUTES_ENV = {
    "DYN_SGLANG_ENGINE_ROUTES": "flush_cache init_weights_update_group destroy_weights_update_group abort_request:tm"
}


def vllm_logprobs_mode(extra_args: Sequence[str]) -> str:
    """The ``--logprobs-mode`` a ``vllm`` worker runs: ``VllmServerCommand``'s (``_vllm`` passes its
    flags), unless ``extra_args``, which come after them, give another (argparse keeps the last);
    vLLM's default where neither gives one."""
    mode = attrs.fields(VllmServerCommand).logprobs_mode.default or DEFAULT_LOGPROBS_MODE
    for i, arg in enumerate(extra_args):
        if arg == "--logprobs-mode" and i + 1 < len(extra_args):
            mode = extra_args[i + 1]
        elif arg.startswith("--logprobs-mode="):
            mode = arg.partition("=")[2]
    return str(mode)


@attrs.frozen(kw_only=True)
class DynamoWorkerCommand:
    """One Dynamo worker per engine, discovering through ``planes``.

    ``kind``: ``mocker`` (``python -m dynamo.mocker --engine-type <mocker_engine_type>``),
    ``reference`` (the adapter's Python worker over a ``ReferenceEngine``, CPU, deterministic),
    ``sglang`` (``python -m dynamo.sglang`` with SGLang flags, through the adapter's shim unless
    ``sglang_shim=False``; ``module`` overrides the module), ``vllm`` (``python -m dynamo.vllm``
    with ``--enable-rl`` and the vLLM adapter's server flags: ``VllmServerCommand.args``), or
    ``module`` (``python -m <module>`` with the common Dynamo flags). ``extra_args`` go last
    (mocker / SGLang / vLLM flags).

    Ports (all below 32768) by role, for ``NodeContext.fixed``: ``system``, ``rpc``, and for
    ``sglang`` also ``sglang``, ``nccl``, ``kv_events``.
    """

    kind: str
    model_path: str
    namespace: str
    planes: DynamoPlanes
    served_model_name: str | None = None
    page_size: int = 16
    tp: int = 1
    kv_events: bool = True  #: sglang: publish KV events (ZMQ port per worker)
    #: sglang: ``--stream-interval`` (``None``: SGLang's default, 1). ``dynamo.sglang`` streams every
    #: request, so at 1 the scheduler, detokenizer, handler and frontend handle a chunk per token:
    #: slower and several times the CPU of 50 on one H200 (``docs/benchmarks.md``, RL fan-out
    #: routing, 2026-12-02). 50 is what SGLang itself uses for requests that do not stream
    #: (``SGLANG_FORCE_STREAM_INTERVAL``) and what Miles #1514 set.
    stream_interval: int | None = DEFAULT_STREAM_INTERVAL
    sglang_shim: bool = True  #: sglang: run the adapter's shim (False: stock ``dynamo.sglang``)
    mocker_speedup_ratio: float = 10.0
    mocker_engine_type: str = "sglang"  #: mocker: the engine whose scheduler it simulates
    #: vllm: ``--weight-transfer-config`` backend (``nccl``, ``ipc``; ``None``: disk loads only).
    transfer_backend: str | None = None
    #: vllm: ``--gpu-memory-utilization`` (``None``: vLLM's default).
    gpu_memory_utilization: float | None = None
    weight_version: str = "default"  #: reference: the version the engine starts with
    reference_threads: int = 1  #: reference: torch threads (``OMP_NUM_THREADS``)
    module: str | None = None
    extra_args: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
    env: Mapping[str, str] = attrs.field(factory=dict, converter=env_map)
    python: str | None = None
    grace: float = 10.0

    def __attrs_post_init__(self) -> None:
        if self.kind not in WORKER_KINDS:
            raise InvalidRequest("kind", f"must be one of {WORKER_KINDS}, got {self.kind!r}")
        if self.kind == "module" and not self.module:
            raise InvalidRequest("module", "kind='module' needs module=")
        if self.mocker_engine_type not in MOCKER_ENGINE_TYPES:
            raise InvalidRequest(
                "mocker_engine_type", f"must be one of {MOCKER_ENGINE_TYPES}, got {self.mocker_engine_type!r}"
            )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path.rstrip("/").rsplit("/", 1)[-1]

    def _vllm(
        self, ctx: NodeContext, py: str, endpoint: str, extra: dict[str, Any]
    ) -> tuple[list[str], dict[str, str | None]]:
        """``dynamo.vllm``'s command line and environment (the vLLM server flags are the vLLM
        adapter's, so the two fleets run the same engine)."""
        server = VllmServerCommand(
            model_path=self.model_path,
            tp=self.tp,
            transfer_backend=self.transfer_backend,
            sleep_mode=True,  # control/sleep and control/wake_up
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        argv = [
            py, "-m", self.module or "dynamo.vllm", "--model", self.model_path,
            "--served-model-name", self.model_name, "--namespace", self.namespace, "--endpoint", endpoint,
            "--enable-rl", "--block-size", str(self.page_size), *self.planes.args(), *server.args(),
        ]  # fmt: skip
        if self.kv_events:
            kv = ctx.port("kv_events", below=PORT_CEILING, any_interface=True)
            cfg = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{kv}",
                "topic": "kv-events",
            }
            argv += ["--kv-events-config", json.dumps(cfg, separators=(",", ":"))]
            extra["kv_events_port"] = kv
        env = {k: v for k, v in server.environment(ctx).items() if k != "VLLM_SERVER_DEV_MODE"}
        env["PYTHONHASHSEED"] = "0"  # block hashes must agree between workers and the router
        return argv, env

    def _sglang(
        self, ctx: NodeContext, py: str, endpoint: str, extra: dict[str, Any], ports: list[tuple[str, int]]
    ) -> tuple[list[str], dict[str, str | None]]:
        """``dynamo.sglang``'s (or the shim's) command line and environment; adds its ports."""
        sglang_port, nccl = ctx.port("sglang"), ctx.port("nccl")
        argv = [
            py, "-m", self.module or (SGLANG_SHIM if self.sglang_shim else "dynamo.sglang"),
            "--model-path", self.model_path, "--served-model-name", self.model_name,
            "--page-size", str(self.page_size),
            "--host", ctx.bind_host, "--port", str(sglang_port), "--nccl-port", str(nccl),
            "--namespace", self.namespace, "--endpoint", endpoint, SGLANG_RL_FLAG,
            *self.planes.args(),
        ]  # fmt: skip
        env: dict[str, str | None] = dict(SGLANG_ENGINE_ROUTES_ENV)
        if self.tp != 1:
            argv += ["--tp", str(self.tp)]
        ports += [(ctx.bind_host, sglang_port), (ctx.bind_host, nccl)]
        if self.kv_events:
            kv = ctx.port("kv_events", below=PORT_CEILING, any_interface=True)  # tcp://*
            argv += ["--kv-events-config", kv_events_config(kv)]
            extra["kv_events_port"] = kv
        if self.stream_interval is not None:
            argv += ["--stream-interval", str(self.stream_interval)]
        env["PYTHONHASHSEED"] = "0"  # block hashes must agree between workers and the router
        if ctx.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ctx.gpu_ids)
        return argv, env

    def build(self, ctx: NodeContext) -> Launch:
        system = ctx.port("system", below=PORT_CEILING)
        rpc = ctx.port("rpc", below=PORT_CEILING)
        py = self.python or sys.executable
        endpoint = f"dyn://{self.namespace}.backend.generate"
        env = self.planes.env(ctx.bind_host, ctx.advertise_host, namespace=self.namespace)
        # A fixed request-plane port shows up in the frontend's /health transport: instance id -> worker.
        env.update(DYN_SYSTEM_PORT=str(system), DYN_TCP_RPC_PORT=str(rpc))
        env["DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"] = None  # deprecated on 1.4.2 (warns)
        ports: list[tuple[str, int]] = [(ctx.bind_host, system), (ctx.bind_host, rpc)]
        extra: dict[str, Any] = {"rpc_port": rpc, "namespace": self.namespace}
        system_url = ctx.url(system)
        # Every kind: liveness of the system server (answers at all; the mocker's and a worker's
        # whose endpoint health is not reported answer 503); routability is the frontend's check.
        ready = ReadyCheck.http(f"{system_url}/live", status=None)
        if self.kind == "mocker":
            argv = [
                py, "-m", "dynamo.mocker", "--engine-type", self.mocker_engine_type,
                "--model-path", self.model_path, "--model-name", self.model_name,
                "--endpoint", endpoint, "--block-size", str(self.page_size),
                "--speedup-ratio", str(self.mocker_speedup_ratio),
                *self.planes.args(),
            ]  # fmt: skip
        elif self.kind == "reference":
            engine_arg = {
                "model_path": self.model_path,
                "worker_id": f"{ctx.advertise_host}:{system}",  # = worker_id_of(control_url)
                "weight_version": self.weight_version,
                "page_size": self.page_size,
                "num_threads": self.reference_threads,
            }
            argv = [
                py, "-m", "rollout_backends.adapters.dynamo._worker",
                "--engine", "rollout_backends.adapters.dynamo._worker:reference_engine",
                "--engine-arg", json.dumps(engine_arg),
                "--model-path", self.model_path, "--served-model-name", self.model_name,
                "--namespace", self.namespace, "--kv-cache-block-size", str(self.page_size),
                *self.planes.args(),
            ]  # fmt: skip
            env["OMP_NUM_THREADS"] = str(self.reference_threads)
        elif self.kind == "sglang":
            argv, more = self._sglang(ctx, py, endpoint, extra, ports)
            env.update(more)
        elif self.kind == "vllm":
            argv, more = self._vllm(ctx, py, endpoint, extra)
            env.update(more)
            ports += [(ctx.bind_host, p) for p in (extra.get("kv_events_port"),) if p is not None]
        else:
            assert self.module is not None
            argv = [py, "-m", self.module, "--model-path", self.model_path, "--served-model-name", self.model_name,
                    "--namespace", self.namespace, *self.planes.args()]  # fmt: skip
        env.update(self.env)
        spec = ProcessSpec(
            name=f"dynamo-{self.kind}-{ctx.index}",
            argv=[*argv, *self.extra_args],
            env=env,
            ready=ready,
            ports=ports,
            grace=self.grace,
        )
        return Launch(spec=spec, generate_url=None, control_url=system_url, extra=extra)


@attrs.frozen(kw_only=True)
class DynamoFrontend:
    """``python -m dynamo.frontend`` as the fleet's entry (on the launcher's node)."""

    namespace: str
    planes: DynamoPlanes
    router_mode: str = "round-robin"
    page_size: int = 16
    migration_limit: int = 0  #: keep 0 for RL: a migrated request splices two workers' tokens
    # -- KV router (``router_mode="kv"`` only)
    kv_events: bool = True  #: ``--no-router-kv-events`` when False (approximate KV routing)
    router_predicted_ttl_secs: float | None = None  #: predict-on-route (needs KV events)
    overlap_score_credit: float | None = None  #: ``--router-kv-overlap-score-credit``
    router_temperature: float | None = None  #: ``--router-temperature`` (0 = argmin)
    #: ``--router-session-affinity-ttl-secs``: requests with one routing key (``x-dynamo-session-id``,
    #: ``DynamoWire.SESSION_HEADER``) stay on one worker until the key idles this long; ``None``: off.
    session_affinity_ttl_secs: int | None = None
    #: serve SGLang's native ``/generate`` (``DYN_SGLANG_ENABLE_GENERATE=1``; a 1.4.x frontend
    #: has no such route and ignores the variable).
    native_generate: bool = True
    http_port: int | None = None  #: default: ``ctx.fixed["http"]`` or a free port
    extra_args: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
    env: Mapping[str, str] = attrs.field(factory=dict, converter=env_map)
    python: str | None = None
    grace: float = 5.0

    def build(self, ctx: NodeContext, engines: Sequence[EngineInfo]) -> Launch:
        """The frontend, ready once its ``/health`` lists every engine (``len(engines)``)."""
        port = self.http_port or ctx.port("http", below=PORT_CEILING)
        url = ctx.url(port)
        argv = [
            self.python or sys.executable, "-m", "dynamo.frontend",
            "--http-host", ctx.bind_host, "--http-port", str(port),
            "--namespace", self.namespace, "--router-mode", self.router_mode,
            *self.planes.args(),
            "--kv-cache-block-size", str(self.page_size),
            "--migration-limit", str(self.migration_limit),
        ]  # fmt: skip
        if self.router_mode == "kv":
            if not self.kv_events:
                argv.append("--no-router-kv-events")
            if self.router_predicted_ttl_secs is not None:
                argv += ["--router-predicted-ttl-secs", str(self.router_predicted_ttl_secs)]
            if self.overlap_score_credit is not None:
                argv += ["--router-kv-overlap-score-credit", str(self.overlap_score_credit)]
            if self.router_temperature is not None:
                argv += ["--router-temperature", str(self.router_temperature)]
        if self.session_affinity_ttl_secs is not None:
            argv += ["--router-session-affinity-ttl-secs", str(self.session_affinity_ttl_secs)]
        argv += self.extra_args
        env = self.planes.env(ctx.bind_host, ctx.advertise_host, namespace=self.namespace)
        env["DYN_ENABLE_RL"] = "true"
        # DYN_ENABLE_RL opens an admin listener (default 127.0.0.1:8001): one port per fleet.
        env["DYN_RL_PORT"] = str(ctx.port("rl", below=PORT_CEILING))
        if self.native_generate:
            env.update(FRONTEND_NATIVE_GENERATE_ENV)
        env.update(self.env)
        expected = len(engines)
        namespace = self.namespace

        async def ready() -> bool:
            status, health = await get_json(f"{url}/health", timeout=2.0)
            if status != 200 or len(generate_instances(health, namespace)) < expected:
                return False
            status, models = await get_json(f"{url}/v1/models", timeout=2.0)
            return status == 200 and isinstance(models, dict) and bool(models.get("data"))

        spec = ProcessSpec(
            name="dynamo-frontend",
            argv=argv,
            env=env,
            ready=ReadyCheck.custom(ready, check_timeout=5.0),
            ports=[(ctx.bind_host, port)],
            grace=self.grace,
        )
        return Launch(spec=spec, generate_url=url, control_url=url)

    @property
    def starts_with_engines(self) -> bool:
        """The frontend discovers its workers: it starts with them (ready once it lists them all)."""
        return True

    async def attach(self, entry_url: str, engines: Sequence[EngineInfo], *, timeout: float) -> None:
        """Nothing to do: the ready check waited until it lists every engine's instance."""
        return None

    async def connect(self, entry_url: str, engines: Sequence[EngineInfo], **kwargs: Any) -> HttpFleetBackend:
        """The Dynamo backend (``rollout_backends.adapters.dynamo.connect``) over the frontend and
        every worker's system port (instance ids mapped through each worker's ``DYN_TCP_RPC_PORT``)."""
        from . import _client

        workers = [e.control_url for e in engines]
        rpc_ports = {e.control_url: int(e.extra["rpc_port"]) for e in engines if "rpc_port" in e.extra}
        kwargs.setdefault("router_mode", self.router_mode)
        kwargs.setdefault("namespace", self.namespace)
        backend: HttpFleetBackend = await _client.connect(entry_url, workers=workers, rpc_ports=rpc_ports, **kwargs)
        return backend
