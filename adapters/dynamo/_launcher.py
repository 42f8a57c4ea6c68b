"""Launch a Dynamo fleet (one frontend + N workers) under the shared :class:`Supervisor`.

::

    cfg = DynamoFleet(model_path="/m/tiny", workers=2, worker_kind="reference", router_mode="kv")
    async with launch_dynamo_fleet(cfg, log_dir="/tmp/run") as fleet:
        backend = await fleet.connect()
        gen = await backend.generate(GenerateRequest(input_ids=[1, 2, 3]))

Every process is started by the supervisor (own process group, PDEATHSIG, watchdog, logs in
``log_dir``); leaving the context stops them all. Each fleet has its own namespace and its own
``DYN_FILE_KV`` directory, so fleets on one host never see each other's workers. Discovery,
request plane and event plane are always passed explicitly (their defaults differ between
versions, see ``docs/dynamo.md``).

Worker kinds:

* ``reference``: ``rollout_backends.adapters.dynamo._worker`` around a ``ReferenceEngine`` (CPU).
* ``mocker``: ``python -m dynamo.mocker --engine-type sglang`` (CPU; publishes KV events; random
  tokens, no logprobs, no engine routes).
* ``sglang``: real ``dynamo.sglang`` (GPU) through our shim
  (``rollout_backends.adapters.dynamo._sglang_shim``: per-chunk logprob fix + ``engine_data``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs

from rollout_backends._errors import BackendUnavailable, InvalidRequest
from rollout_backends._fleet import HttpFleetBackend
from rollout_backends._supervisor import ProcessSpec, ReadyCheck, Supervisor

__all__ = [
    "DynamoFleet",
    "RunningDynamoFleet",
    "WORKER_KINDS",
    "frontend_argv",
    "launch_dynamo_fleet",
    "low_port",
    "worker_argv",
]

WORKER_KINDS = ("reference", "mocker", "sglang")
ROUTER_MODES = ("round-robin", "random", "kv", "direct", "power-of-two", "least-loaded")

#: Dynamo 1.4.2 parses ``DYN_SYSTEM_PORT`` as an i16: every port we pick is below this.
_PORT_CEILING = 32768
_PORT_FLOOR = 20000


def low_port(host: str = "127.0.0.1", *, avoid: set[int] | None = None) -> int:
    """A free TCP port in [20000, 32768): below the i16 limit of ``DYN_SYSTEM_PORT`` on 1.4.2."""
    avoid = avoid or set()
    for _ in range(500):
        port = random.randrange(_PORT_FLOOR, _PORT_CEILING)
        if port in avoid:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        avoid.add(port)
        return port
    raise BackendUnavailable(f"no free port in [{_PORT_FLOOR}, {_PORT_CEILING}) on {host}")


def _str_tuple(value: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(str(v) for v in (value or ()))


def _env_map(value: Mapping[str, str] | None) -> Mapping[str, str]:
    return dict(value or {})


@attrs.frozen(kw_only=True)
class DynamoFleet:
    """What to launch. Defaults: 2 reference workers behind a round-robin frontend, file discovery."""

    model_path: str = attrs.field(converter=str)
    served_model_name: str | None = None
    workers: int = 2
    worker_kind: str = "reference"
    # -- frontend / router
    router_mode: str = "round-robin"
    #: KV block size = the workers' page size (``--kv-cache-block-size``, mocker ``--block-size``,
    #: SGLang ``--page-size``). Must be > 1 for the KV router.
    page_size: int = 16
    kv_events: bool = True  #: ``--no-router-kv-events`` when False (approximate KV routing)
    router_predicted_ttl_secs: float | None = None  #: predict-on-route (needs KV events)
    overlap_score_credit: float | None = None  #: ``--router-kv-overlap-score-credit``
    router_temperature: float | None = None  #: ``--router-temperature`` (0 = argmin)
    migration_limit: int = 0  #: keep 0 for RL: a migrated request splices two workers' tokens
    frontend_args: tuple[str, ...] = attrs.field(factory=tuple, converter=_str_tuple)
    # -- discovery and planes
    namespace: str | None = None  #: default: a fresh ``rb<hex>`` per fleet
    discovery: str = "file"  #: "file" (one host) or "etcd" (endpoints below, or ``start_etcd``)
    etcd_endpoints: tuple[str, ...] = attrs.field(factory=tuple, converter=_str_tuple)
    #: start etcd (and NATS when a plane is nats) under the fleet's supervisor (``EtcdNats``).
    start_etcd: bool = False
    request_plane: str = "tcp"
    event_plane: str = "zmq"
    nats_server: str | None = None  #: ``NATS_SERVER`` for a nats plane
    host: str = "127.0.0.1"
    http_port: int | None = None
    # -- workers
    weight_version: str = "default"  #: the version reference workers start with (and stamped ones)
    reference_threads: int = 1
    mocker_speedup_ratio: float = 10.0
    mocker_args: tuple[str, ...] = attrs.field(factory=tuple, converter=_str_tuple)
    #: sglang: one CUDA_VISIBLE_DEVICES value per worker (default "0", "1", ...).
    gpus: tuple[str, ...] = attrs.field(factory=tuple, converter=_str_tuple)
    stream_interval: int | None = None
    sglang_args: tuple[str, ...] = attrs.field(factory=tuple, converter=_str_tuple)
    #: the shim (logprob fix + engine_data); False runs stock ``python -m dynamo.sglang``.
    sglang_shim: bool = True
    worker_env: Mapping[str, str] = attrs.field(factory=dict, converter=_env_map)
    python: str = sys.executable
    ready_timeout: float = 180.0

    def __attrs_post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise InvalidRequest("workers", f"must be an int >= 1, got {self.workers!r}")
        if self.worker_kind not in WORKER_KINDS:
            raise InvalidRequest("worker_kind", f"must be one of {WORKER_KINDS}, got {self.worker_kind!r}")
        if self.router_mode not in ROUTER_MODES:
            raise InvalidRequest("router_mode", f"must be one of {ROUTER_MODES}, got {self.router_mode!r}")
        if self.page_size < 1 or (self.router_mode == "kv" and self.page_size < 2):
            raise InvalidRequest("page_size", f"must be >= 2 for the KV router (got {self.page_size})")
        if self.router_predicted_ttl_secs is not None and not self.kv_events:
            raise InvalidRequest("router_predicted_ttl_secs", "predict-on-route needs kv_events=True (Dynamo refuses)")
        if self.discovery not in ("file", "etcd"):
            raise InvalidRequest("discovery", f"must be 'file' or 'etcd', got {self.discovery!r}")
        if self.discovery == "etcd" and not self.etcd_endpoints and not self.start_etcd:
            raise InvalidRequest("etcd_endpoints", "discovery='etcd' needs etcd endpoints (e.g. http://host:2379)")
        if self.request_plane not in ("tcp", "nats") or self.event_plane not in ("zmq", "nats"):
            raise InvalidRequest("request_plane", "request plane tcp|nats, event plane zmq|nats")
        if self.worker_kind == "sglang" and self.gpus and len(self.gpus) != self.workers:
            raise InvalidRequest("gpus", f"one CUDA_VISIBLE_DEVICES value per worker ({self.workers}), got {self.gpus}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).name


@attrs.frozen(slots=True)
class _WorkerPorts:
    system: int
    rpc: int
    kv_events: int | None = None
    sglang: int | None = None
    nccl: int | None = None


def _common_env(cfg: DynamoFleet, namespace: str, kv_dir: Path) -> dict[str, str | None]:
    env: dict[str, str | None] = {
        "DYN_NAMESPACE": namespace,
        "DYN_DISCOVERY_BACKEND": cfg.discovery,
        "DYN_REQUEST_PLANE": cfg.request_plane,
        "DYN_EVENT_PLANE": cfg.event_plane,
        "DYN_FILE_KV": str(kv_dir),
        "DYN_SYSTEM_PORT": None,  # never inherited: the frontend warns, workers would collide
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if cfg.host in ("127.0.0.1", "localhost"):
        # Loopback only: the request plane takes an address, the response stream an interface name.
        env["DYN_TCP_RPC_HOST"] = "127.0.0.1"
        env["DYN_TCP_RESPONSE_STREAM_HOST"] = "lo"
        env["DYN_SYSTEM_HOST"] = "127.0.0.1"
    else:
        env["DYN_TCP_RPC_HOST"] = cfg.host
        env["DYN_SYSTEM_HOST"] = cfg.host
    if cfg.discovery == "etcd":
        env["ETCD_ENDPOINTS"] = ",".join(cfg.etcd_endpoints)
    if cfg.nats_server:
        env["NATS_SERVER"] = cfg.nats_server
    return env


def frontend_argv(cfg: DynamoFleet, namespace: str, http_port: int) -> list[str]:
    """``python -m dynamo.frontend ...`` for ``cfg`` (every plane explicit)."""
    argv = [
        cfg.python, "-m", "dynamo.frontend",
        "--http-host", cfg.host, "--http-port", str(http_port),
        "--namespace", namespace,
        "--router-mode", cfg.router_mode,
        "--discovery-backend", cfg.discovery,
        "--request-plane", cfg.request_plane,
        "--event-plane", cfg.event_plane,
        "--kv-cache-block-size", str(cfg.page_size),
        "--migration-limit", str(cfg.migration_limit),
    ]  # fmt: skip
    if cfg.router_mode == "kv":
        if not cfg.kv_events:
            argv.append("--no-router-kv-events")
        if cfg.router_predicted_ttl_secs is not None:
            argv += ["--router-predicted-ttl-secs", str(cfg.router_predicted_ttl_secs)]
        if cfg.overlap_score_credit is not None:
            argv += ["--router-kv-overlap-score-credit", str(cfg.overlap_score_credit)]
        if cfg.router_temperature is not None:
            argv += ["--router-temperature", str(cfg.router_temperature)]
    return argv + list(cfg.frontend_args)


def worker_argv(cfg: DynamoFleet, index: int, namespace: str, ports: _WorkerPorts) -> list[str]:
    """The command line of worker ``index`` (its env comes from :func:`worker_env`)."""
    planes = [
        "--discovery-backend", cfg.discovery,
        "--request-plane", cfg.request_plane,
        "--event-plane", cfg.event_plane,
    ]  # fmt: skip
    if cfg.worker_kind == "reference":
        engine_arg = {
            "model_path": cfg.model_path,
            "worker_id": f"{cfg.host}:{ports.system}",
            "weight_version": cfg.weight_version,
            "page_size": cfg.page_size,
            "num_threads": cfg.reference_threads,
        }
        return [
            cfg.python, "-m", "rollout_backends.adapters.dynamo._worker",
            "--engine", "rollout_backends.adapters.dynamo._worker:reference_engine",
            "--engine-arg", json.dumps(engine_arg),
            "--model-path", cfg.model_path,
            "--served-model-name", cfg.model_name,
            "--namespace", namespace,
            "--kv-cache-block-size", str(cfg.page_size),
            *planes,
        ]  # fmt: skip
    if cfg.worker_kind == "mocker":
        argv = [
            cfg.python, "-m", "dynamo.mocker", "--engine-type", "sglang",
            "--model-path", cfg.model_path,
            "--model-name", cfg.model_name,
            "--endpoint", f"dyn://{namespace}.backend.generate",
            "--block-size", str(cfg.page_size),
            "--speedup-ratio", str(cfg.mocker_speedup_ratio),
            *planes,
        ]  # fmt: skip
        return argv + list(cfg.mocker_args)
    # sglang (GPU)
    module = "rollout_backends.adapters.dynamo._sglang_shim" if cfg.sglang_shim else "dynamo.sglang"
    assert ports.kv_events is not None and ports.sglang is not None and ports.nccl is not None
    kv_events = {"publisher": "zmq", "topic": "kv-events", "endpoint": f"tcp://*:{ports.kv_events}"}
    argv = [
        cfg.python, "-m", module,
        "--model-path", cfg.model_path,
        "--served-model-name", cfg.model_name,
        "--page-size", str(cfg.page_size),
        "--host", "127.0.0.1", "--port", str(ports.sglang), "--nccl-port", str(ports.nccl),
        "--namespace", namespace,
        "--endpoint", f"dyn://{namespace}.backend.generate",
        "--enable-rl",
        *planes,
    ]  # fmt: skip
    if cfg.kv_events:
        argv += ["--kv-events-config", json.dumps(kv_events, separators=(",", ":"))]
    if cfg.stream_interval is not None:
        argv += ["--stream-interval", str(cfg.stream_interval)]
    return argv + list(cfg.sglang_args)


def worker_env(
    cfg: DynamoFleet, index: int, common: Mapping[str, str | None], ports: _WorkerPorts
) -> dict[str, str | None]:
    env = dict(common)
    env["DYN_SYSTEM_PORT"] = str(ports.system)
    # A fixed request-plane port shows up in the frontend's /health transport: instance id -> worker.
    env["DYN_TCP_RPC_PORT"] = str(ports.rpc)
    env["DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"] = None  # deprecated on 1.4.2 (warns)
    if cfg.worker_kind == "sglang":
        env["PYTHONHASHSEED"] = "0"  # block hashes must agree between workers and the router
        env["CUDA_VISIBLE_DEVICES"] = cfg.gpus[index] if cfg.gpus else str(index)
    elif cfg.worker_kind == "reference":
        env["OMP_NUM_THREADS"] = str(cfg.reference_threads)
    env.update(cfg.worker_env)
    return env


async def _get_json(session: Any, url: str, timeout: float = 2.0) -> tuple[int, Any]:
    import aiohttp

    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        body = await resp.read()
        try:
            return resp.status, json.loads(body) if body else None
        except ValueError:
            return resp.status, None


def generate_instances(health: Any, namespace: str | None = None) -> list[dict[str, Any]]:
    """The ``generate`` instances listed by a frontend's ``GET /health`` body."""
    if not isinstance(health, dict):
        return []
    out = []
    for inst in health.get("instances") or []:
        if not isinstance(inst, dict) or inst.get("endpoint") != "generate":
            continue
        if namespace is not None and inst.get("namespace") != namespace:
            continue
        out.append(inst)
    return out


@attrs.define(eq=False)
class RunningDynamoFleet:
    """A launched fleet: URLs, the supervisor, and ``connect()`` for the backend."""

    config: DynamoFleet
    namespace: str
    frontend_url: str
    worker_urls: tuple[str, ...]  #: each worker's system-port URL (engine routes)
    rpc_ports: Mapping[str, int]  #: worker URL -> request-plane port (maps instance ids)
    worker_names: tuple[str, ...]
    supervisor: Supervisor
    run_dir: Path
    _backends: list[HttpFleetBackend] = attrs.field(factory=list)

    async def connect(self, **kwargs: Any) -> HttpFleetBackend:
        """The ``RolloutBackend`` over this fleet (closed with the fleet)."""
        from rollout_backends.adapters.dynamo._client import connect

        flavor = {"reference": "rollout", "mocker": "mocker", "sglang": "sglang14"}[self.config.worker_kind]
        if self.config.worker_kind == "sglang" and self.config.sglang_shim:
            flavor = "sglang14-shim"
        kwargs.setdefault("flavor", flavor)
        kwargs.setdefault("router_mode", self.config.router_mode)
        kwargs.setdefault("model", self.config.model_name)
        kwargs.setdefault("initial_version", self.config.weight_version)
        kwargs.setdefault("model_path", self.config.model_path)
        backend = await connect(self.frontend_url, workers=list(self.worker_urls), rpc_ports=self.rpc_ports, **kwargs)
        self._backends.append(backend)
        return backend

    def worker_name(self, worker: str | int) -> str:
        """Supervisor process name of a worker (by index or by worker id / URL)."""
        if isinstance(worker, int):
            return self.worker_names[worker]
        for url, name in zip(self.worker_urls, self.worker_names, strict=True):
            if worker in (url, url.split("://", 1)[-1]):
                return name
        raise KeyError(worker)

    def kill_worker(self, worker: str | int) -> None:
        """SIGKILL one worker's process group (fault tests)."""
        self.supervisor.kill(self.worker_name(worker))

    async def frontend_health(self) -> Any:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            return (await _get_json(session, f"{self.frontend_url}/health"))[1]

    async def aclose(self) -> None:
        for b in self._backends:
            await b.aclose()
        await self.supervisor.aclose()


@asynccontextmanager
async def launch_dynamo_fleet(
    config: DynamoFleet,
    *,
    log_dir: str | os.PathLike[str] | None = None,
    progress: Any = None,
) -> AsyncIterator[RunningDynamoFleet]:
    """Start the frontend and the workers; yield when the frontend routes to all of them.

    Ready = the frontend's ``/health`` lists ``config.workers`` ``generate`` instances of this
    fleet's namespace, then ``/v1/models`` is non-empty. Raises ``BackendUnavailable`` (with log
    tails) when a process exits or the fleet is not ready within ``config.ready_timeout``.
    """
    cfg = config
    namespace = cfg.namespace or f"rb{uuid.uuid4().hex[:10]}"
    run_dir = Path(tempfile.mkdtemp(prefix=f"dynamo-{namespace}-"))
    logs = Path(log_dir) if log_dir is not None else run_dir / "logs"
    kv_dir = run_dir / "kv"
    kv_dir.mkdir(parents=True)
    taken: set[int] = set()
    sup = Supervisor(logs, grace=10.0)
    fleet: RunningDynamoFleet | None = None
    try:
        if cfg.start_etcd:
            # etcd (and NATS for a nats plane) under this fleet's supervisor; stopped with the fleet.
            from rollout_backends.adapters.dynamo._services import EtcdNats

            services = await EtcdNats.start(
                etcd_endpoints=cfg.etcd_endpoints or None,
                nats_url=cfg.nats_server,
                nats="nats" in (cfg.request_plane, cfg.event_plane),
                host=cfg.host,
                supervisor=sup,
                data_dir=run_dir / "services",
            )
            cfg = attrs.evolve(
                cfg, etcd_endpoints=services.etcd_endpoints, nats_server=services.nats_url, start_etcd=False
            )
        http_port = cfg.http_port or low_port(cfg.host, avoid=taken)
        common = _common_env(cfg, namespace, kv_dir)
        frontend_url = f"http://{cfg.host}:{http_port}"
        fe_env = dict(common)
        fe_env["DYN_ENABLE_RL"] = "true"
        # DYN_ENABLE_RL opens an admin listener (default 127.0.0.1:8001): one per fleet.
        fe_env["DYN_RL_PORT"] = str(low_port(cfg.host, avoid=taken))

        n_expected = cfg.workers

        async def frontend_ready() -> bool:
            import aiohttp

            async with aiohttp.ClientSession() as session:
                status, health = await _get_json(session, f"{frontend_url}/health")
                if status != 200 or len(generate_instances(health, namespace)) < n_expected:
                    return False
                status, models = await _get_json(session, f"{frontend_url}/v1/models")
                return status == 200 and isinstance(models, dict) and bool(models.get("data"))

        await sup.start(
            ProcessSpec(
                name="frontend",
                argv=frontend_argv(cfg, namespace, http_port),
                env=fe_env,
                ready=ReadyCheck.custom(frontend_ready, check_timeout=5.0),
                ports=[(cfg.host, http_port)],
                grace=5.0,
            )
        )
        worker_urls: list[str] = []
        rpc_ports: dict[str, int] = {}
        names: list[str] = []
        for i in range(cfg.workers):
            ports = _WorkerPorts(
                system=low_port(cfg.host, avoid=taken),
                rpc=low_port(cfg.host, avoid=taken),
                kv_events=low_port("0.0.0.0", avoid=taken) if cfg.worker_kind == "sglang" else None,
                sglang=low_port(cfg.host, avoid=taken) if cfg.worker_kind == "sglang" else None,
                nccl=low_port(cfg.host, avoid=taken) if cfg.worker_kind == "sglang" else None,
            )
            url = f"http://{cfg.host}:{ports.system}"
            name = f"worker-{i}"
            await sup.start(
                ProcessSpec(
                    name=name,
                    argv=worker_argv(cfg, i, namespace, ports),
                    env=worker_env(cfg, i, common, ports),
                    # Liveness of the system server; routability is the frontend's check.
                    ready=ReadyCheck.custom(_answers(f"{url}/live")),
                    ports=[(cfg.host, ports.system), (cfg.host, ports.rpc)],
                    grace=10.0 if cfg.worker_kind == "sglang" else 5.0,
                )
            )
            worker_urls.append(url)
            rpc_ports[url] = ports.rpc
            names.append(name)
        await sup.wait_ready(timeout=cfg.ready_timeout, progress=progress)
        fleet = RunningDynamoFleet(
            config=cfg,
            namespace=namespace,
            frontend_url=frontend_url,
            worker_urls=tuple(worker_urls),
            rpc_ports=rpc_ports,
            worker_names=tuple(names),
            supervisor=sup,
            run_dir=run_dir,
        )
        yield fleet
    finally:
        if fleet is not None:
            await fleet.aclose()
        else:
            await sup.aclose()
        # A crash may leave the kv dir behind; logs stay (they may be in log_dir).
        await asyncio.to_thread(shutil.rmtree, kv_dir, True)


def _answers(url: str) -> Any:
    """A ready check that passes once ``url`` answers at all (mocker system ports answer 503)."""

    async def check() -> bool:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            status, _ = await _get_json(session, url)
            return status > 0

    return check
