"""Dynamo workers and the frontend as launch commands (``rollout_backends._launch``), for any node.

* :class:`DynamoWorkerCommand`: one worker process per engine: ``dynamo.mocker`` (CPU),
  ``dynamo.sglang`` (GPU; through the logprob shim when the adapter ships it), or any module
  taking the same flags. It registers in etcd (``DynamoPlanes``) from whatever node it runs on.
* :class:`DynamoFrontend`: ``dynamo.frontend`` on the launcher's node; ready when its ``/health``
  lists every engine's ``generate`` instance in the fleet's namespace and ``/v1/models`` is not empty.

Ports of Dynamo processes are picked below 32768 (1.4.2 parses ``DYN_SYSTEM_PORT`` as an i16).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rollout_backends._errors import InvalidRequest
from rollout_backends._fleet import HttpFleetBackend
from rollout_backends._launch import EngineInfo, Launch, NodeContext
from rollout_backends._supervisor import ProcessSpec, ReadyCheck
from rollout_backends.adapters.dynamo._services import DynamoPlanes

__all__ = ["DynamoFrontend", "DynamoWorkerCommand", "generate_instances"]

#: Dynamo 1.4.2 parses ``DYN_SYSTEM_PORT`` as an i16.
PORT_CEILING = 32768
WORKER_KINDS = ("mocker", "reference", "sglang", "module")


def _str_tuple(value: Sequence[Any] | None) -> tuple[str, ...]:
    return tuple(str(v) for v in (value or ()))


def _env_map(value: Mapping[str, str] | None) -> Mapping[str, str]:
    return dict(value or {})


async def _get_json(url: str, timeout: float = 2.0) -> tuple[int, Any]:
    import aiohttp

    async with (
        aiohttp.ClientSession() as session,
        session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp,
    ):
        body = await resp.read()
        try:
            return resp.status, json.loads(body) if body else None
        except ValueError:
            return resp.status, None


def generate_instances(health: Any, namespace: str | None = None) -> list[dict[str, Any]]:
    """The ``generate`` instances a frontend's ``GET /health`` lists (optionally of one namespace)."""
    if not isinstance(health, dict):
        return []
    out = []
    for inst in health.get("instances") or []:
        ok = isinstance(inst, dict) and inst.get("endpoint") == "generate"
        if ok and (namespace is None or inst.get("namespace") == namespace):
            out.append(inst)
    return out


@attrs.frozen(kw_only=True)
class DynamoWorkerCommand:
    """One Dynamo worker per engine, discovering through ``planes``.

    ``kind``: ``mocker`` (``python -m dynamo.mocker --engine-type sglang``), ``reference`` (the
    adapter's Python worker over a ``ReferenceEngine``, CPU, deterministic), ``sglang``
    (``python -m dynamo.sglang`` with SGLang flags; ``module`` overrides the module, e.g. the
    adapter's shim), or ``module`` (``python -m <module>`` with the common Dynamo flags).
    """

    kind: str
    model_path: str
    namespace: str
    planes: DynamoPlanes
    served_model_name: str | None = None
    page_size: int = 16
    tp: int = 1
    kv_events: bool = True  #: sglang: publish KV events (ZMQ port per worker)
    mocker_speedup_ratio: float = 10.0
    weight_version: str = "default"  #: reference: the version the engine starts with
    module: str | None = None
    extra_args: tuple[str, ...] = attrs.field(factory=tuple, converter=_str_tuple)
    env: Mapping[str, str] = attrs.field(factory=dict, converter=_env_map)
    python: str | None = None
    grace: float = 10.0

    def __attrs_post_init__(self) -> None:
        if self.kind not in WORKER_KINDS:
            raise InvalidRequest("kind", f"must be one of {WORKER_KINDS}, got {self.kind!r}")
        if self.kind == "module" and not self.module:
            raise InvalidRequest("module", "kind='module' needs module=")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path.rstrip("/").rsplit("/", 1)[-1]

    def build(self, ctx: NodeContext) -> Launch:
        system = ctx.port(below=PORT_CEILING)
        rpc = ctx.port(below=PORT_CEILING)
        py = self.python or sys.executable
        endpoint = f"dyn://{self.namespace}.backend.generate"
        env: dict[str, str | None] = self.planes.env(ctx.bind_host, ctx.advertise_host)
        env.update(DYN_NAMESPACE=self.namespace, DYN_SYSTEM_PORT=str(system), DYN_TCP_RPC_PORT=str(rpc))
        ports: list[tuple[str, int]] = [(ctx.bind_host, system), (ctx.bind_host, rpc)]
        extra: dict[str, Any] = {"rpc_port": rpc, "namespace": self.namespace}
        if self.kind == "mocker":
            argv = [
                py, "-m", "dynamo.mocker", "--engine-type", "sglang",
                "--model-path", self.model_path, "--model-name", self.model_name,
                "--endpoint", endpoint, "--block-size", str(self.page_size),
                "--speedup-ratio", str(self.mocker_speedup_ratio),
                *self.planes.args(),
            ]  # fmt: skip
            # The mocker's system port answers /live with 503 forever: "answers at all" is its liveness.
            ready = ReadyCheck.custom(_answers(f"{ctx.url(system)}/live"))
        elif self.kind == "reference":
            engine_arg = {
                "model_path": self.model_path,
                "worker_id": ctx.url(system),
                "weight_version": self.weight_version,
                "page_size": self.page_size,
                "num_threads": 1,
            }
            argv = [
                py, "-m", "rollout_backends.adapters.dynamo._worker",
                "--engine", "rollout_backends.adapters.dynamo._worker:reference_engine",
                "--engine-arg", json.dumps(engine_arg),
                "--model-path", self.model_path, "--served-model-name", self.model_name,
                "--namespace", self.namespace, "--kv-cache-block-size", str(self.page_size),
                *self.planes.args(),
            ]  # fmt: skip
            env["OMP_NUM_THREADS"] = "1"
            ready = ReadyCheck.http(f"{ctx.url(system)}/health", check_timeout=5.0)
        elif self.kind == "sglang":
            sglang_port, nccl = ctx.port(), ctx.port()
            argv = [
                py, "-m", self.module or "dynamo.sglang",
                "--model-path", self.model_path, "--served-model-name", self.model_name,
                "--page-size", str(self.page_size), "--tp", str(self.tp),
                "--host", ctx.bind_host, "--port", str(sglang_port), "--nccl-port", str(nccl),
                "--namespace", self.namespace, "--endpoint", endpoint, "--enable-rl",
                *self.planes.args(),
            ]  # fmt: skip
            ports += [(ctx.bind_host, sglang_port), (ctx.bind_host, nccl)]
            if self.kv_events:
                kv = ctx.port(below=PORT_CEILING)
                cfg = {"publisher": "zmq", "topic": "kv-events", "endpoint": f"tcp://*:{kv}"}
                argv += ["--kv-events-config", json.dumps(cfg, separators=(",", ":"))]
                extra["kv_events_port"] = kv
            env["PYTHONHASHSEED"] = "0"  # block hashes must agree between workers and the router
            if ctx.gpu_ids:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(ctx.gpu_ids)
            ready = ReadyCheck.http(f"{ctx.url(system)}/health", check_timeout=5.0)
        else:
            assert self.module is not None
            argv = [py, "-m", self.module, "--model-path", self.model_path, "--served-model-name", self.model_name,
                    "--namespace", self.namespace, *self.planes.args()]  # fmt: skip
            ready = ReadyCheck.http(f"{ctx.url(system)}/health", check_timeout=5.0)
        env.update(self.env)
        spec = ProcessSpec(
            name=f"dynamo-{self.kind}-{ctx.index}",
            argv=[*argv, *self.extra_args],
            env=env,
            ready=ready,
            ports=ports,
            grace=self.grace,
        )
        return Launch(spec=spec, generate_url=None, control_url=ctx.url(system), extra=extra)


def _answers(url: str) -> Any:
    async def check() -> bool:
        status, _ = await _get_json(url)
        return status > 0

    return check


@attrs.frozen(kw_only=True)
class DynamoFrontend:
    """``python -m dynamo.frontend`` as the fleet's entry (on the launcher's node)."""

    namespace: str
    planes: DynamoPlanes
    router_mode: str = "round-robin"
    page_size: int = 16
    migration_limit: int = 0  #: keep 0 for RL: a migrated request splices two workers' tokens
    http_port: int | None = None
    extra_args: tuple[str, ...] = attrs.field(factory=tuple, converter=_str_tuple)
    env: Mapping[str, str] = attrs.field(factory=dict, converter=_env_map)
    python: str | None = None
    grace: float = 5.0

    def build(self, ctx: NodeContext, engines: Sequence[EngineInfo]) -> Launch:
        port = self.http_port or ctx.port(below=PORT_CEILING)
        url = ctx.url(port)
        argv = [
            self.python or sys.executable, "-m", "dynamo.frontend",
            "--http-host", ctx.bind_host, "--http-port", str(port),
            "--namespace", self.namespace, "--router-mode", self.router_mode,
            "--kv-cache-block-size", str(self.page_size),
            "--migration-limit", str(self.migration_limit),
            *self.planes.args(),
            *self.extra_args,
        ]  # fmt: skip
        env = self.planes.env(ctx.bind_host, ctx.advertise_host)
        env["DYN_NAMESPACE"] = self.namespace
        env.update(self.env)
        expected = len(engines)
        namespace = self.namespace

        async def ready() -> bool:
            status, health = await _get_json(f"{url}/health")
            if status != 200 or len(generate_instances(health, namespace)) < expected:
                return False
            status, models = await _get_json(f"{url}/v1/models")
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

    async def connect(self, entry_url: str, engines: Sequence[EngineInfo], **kwargs: Any) -> HttpFleetBackend:
        """The Dynamo backend (``rollout_backends.adapters.dynamo.connect``) over the frontend and
        every worker's system port (instance ids mapped through each worker's ``DYN_TCP_RPC_PORT``)."""
        from rollout_backends.adapters.dynamo import _client

        workers = [e.control_url for e in engines]
        rpc_ports = {e.control_url: int(e.extra["rpc_port"]) for e in engines if "rpc_port" in e.extra}
        kwargs.setdefault("router_mode", self.router_mode)
        kwargs.setdefault("namespace", self.namespace)
        backend: HttpFleetBackend = await _client.connect(entry_url, workers=workers, rpc_ports=rpc_ports, **kwargs)
        return backend
