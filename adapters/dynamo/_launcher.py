"""Launch a Dynamo fleet (one frontend + N workers) under the shared :class:`Supervisor`.

::

    cfg = DynamoFleetConfig(model_path="/m/tiny", workers=2, worker_kind="reference", router_mode="kv")
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
* ``vllm``: real ``dynamo.vllm`` (GPU, vLLM 0.26) with ``--enable-rl`` and the vLLM adapter's
  server flags (``docs/vllm.md``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import attrs

from rollout_backends import InvalidRequest
from rollout_backends.kit import HttpFleetBackend, get_json
from rollout_backends.launch import (
    EngineInfo,
    Launch,
    Local,
    NodeContext,
    ReadyProgress,
    Supervisor,
    carry,
    env_map,
    launch_fleet,
    require_model_dir,
    require_module,
    str_tuple,
)

from ._commands import DEFAULT_STREAM_INTERVAL, DynamoFrontend, DynamoWorkerCommand, vllm_logprobs_mode
from ._services import DynamoPlanes
from ._wire import generate_instances

__all__ = [
    "DynamoFleet",
    "DynamoFleetConfig",
    "RunningDynamoFleet",
    "WORKER_KINDS",
    "fleet_planes",
    "frontend_argv",
    "frontend_command",
    "generate_instances",
    "launch_dynamo_fleet",
    "worker_argv",
    "worker_command",
]

#: Every worker kind, with what it runs: the launch line and ``--worker-kind``'s help read this.
WORKER_KIND_DESCRIPTIONS: Mapping[str, str] = {
    "sglang": "dynamo.sglang (SGLang; GPU)",
    "vllm": "dynamo.vllm (vLLM 0.26; GPU)",
    "reference": "our Dynamo worker over the CPU reference engine (not SGLang)",
    "mocker": "dynamo.mocker (CPU; random tokens, no logprobs)",
}
WORKER_KINDS = tuple(WORKER_KIND_DESCRIPTIONS)
#: Worker kinds that run on GPUs (one ``CUDA_VISIBLE_DEVICES`` value each).
GPU_KINDS = ("sglang", "vllm")
ROUTER_MODES = ("round-robin", "random", "kv", "direct", "power-of-two", "least-loaded")


@attrs.frozen(kw_only=True)
class DynamoFleetConfig:
    """What to launch. Defaults: one ``dynamo.sglang`` worker behind a round-robin frontend, file
    discovery. They are the command line's too (``launch dynamo`` reads them from these fields)."""

    model_path: str = attrs.field(converter=str)
    served_model_name: str | None = None
    #: One worker unless told: each ``sglang`` worker takes a GPU, and how many the host has is the
    #: caller's to say.
    workers: int = 1
    #: ``dynamo.sglang`` unless told otherwise, as ``SGLangFleetConfig`` runs SGLang: switching
    #: launchers switches the serving stack, not the engine. A CPU kind answering in its place would
    #: pass for it (its tokens, speed and failures are not SGLang's); the CLI's first line names it.
    worker_kind: str = "sglang"
    # -- frontend / router
    #: The frontend's own default (ai-dynamo 1.4.2 ``dynamo/frontend/main.py``: "Router, defaulting
    #: to round-robin"), as the SGLang fleet takes smg's: the mode Dynamo's documentation describes,
    #: and the one the conformance tiers pass on. ``kv`` is one flag away (``--router-mode kv``).
    router_mode: str = "round-robin"
    #: KV block size = the workers' page size (``--kv-cache-block-size``, mocker ``--block-size``,
    #: SGLang ``--page-size``). Must be > 1 for the KV router.
    page_size: int = 16
    kv_events: bool = True  #: ``--no-router-kv-events`` when False (approximate KV routing)
    router_predicted_ttl_secs: float | None = None  #: predict-on-route (needs KV events)
    overlap_score_credit: float | None = None  #: ``--router-kv-overlap-score-credit``
    router_temperature: float | None = None  #: ``--router-temperature`` (0 = argmin)
    #: Session affinity (any router mode): a routing key's requests stay on one worker until the key
    #: idles this many seconds (``--router-session-affinity-ttl-secs``); ``None``: off.
    session_affinity_ttl_secs: int | None = None
    migration_limit: int = 0  #: keep 0 for RL: a migrated request splices two workers' tokens
    #: 1.6.x: the frontend serves native ``/generate`` and ``connect()`` uses it where it is
    #: better (our reference workers); False keeps every request on ``/v1/completions``.
    native_generate: bool = True
    frontend_args: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
    # -- discovery and planes
    namespace: str | None = None  #: default: a fresh ``rb<hex>`` per fleet
    discovery: str = "file"  #: "file" (one host) or "etcd" (endpoints below, or ``start_etcd``)
    etcd_endpoints: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
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
    #: mocker: ``--engine-type`` (the scheduler it simulates: ``sglang`` or ``vllm``).
    mocker_engine_type: str = "sglang"
    mocker_args: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
    #: sglang: one CUDA_VISIBLE_DEVICES value per worker (default "0", "1", ...).
    gpus: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
    #: sglang workers' ``--stream-interval`` (``None``: SGLang's default, 1; see ``DynamoWorkerCommand``).
    stream_interval: int | None = DEFAULT_STREAM_INTERVAL
    sglang_args: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
    #: the shim (logprob fix + engine_data); False runs stock ``python -m dynamo.sglang``.
    sglang_shim: bool = True
    #: vllm workers: ``--weight-transfer-config`` backend (``nccl``, ``ipc``; ``None``: disk loads only).
    transfer_backend: str | None = None
    #: vllm workers: ``--gpu-memory-utilization`` (``None``: vLLM's default).
    gpu_memory_utilization: float | None = None
    vllm_args: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
    worker_env: Mapping[str, str] = attrs.field(factory=dict, converter=env_map)
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
        ttl = self.session_affinity_ttl_secs
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= 31_536_000):
            # the frontend's own bounds (frontend_args.py: 1 s to a year)
            raise InvalidRequest("session_affinity_ttl_secs", f"must be an int in [1, 31536000] or None, got {ttl!r}")
        if self.discovery not in ("file", "etcd"):
            raise InvalidRequest("discovery", f"must be 'file' or 'etcd', got {self.discovery!r}")
        if self.discovery == "etcd" and not self.etcd_endpoints and not self.start_etcd:
            raise InvalidRequest("etcd_endpoints", "discovery='etcd' needs etcd endpoints (e.g. http://host:2379)")
        if self.request_plane not in ("tcp", "nats") or self.event_plane not in ("zmq", "nats"):
            raise InvalidRequest("request_plane", "request plane tcp|nats, event plane zmq|nats")
        if self.worker_kind in GPU_KINDS and self.gpus and len(self.gpus) != self.workers:
            raise InvalidRequest("gpus", f"one CUDA_VISIBLE_DEVICES value per worker ({self.workers}), got {self.gpus}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).name

    def describe(self) -> str:
        """One line saying what this config starts (the CLI prints it first)."""
        kind = f"{self.workers} x {self.worker_kind} worker{'s' if self.workers > 1 else ''}"
        return (
            f"{kind}: {WORKER_KIND_DESCRIPTIONS[self.worker_kind]}; Dynamo frontend, router mode {self.router_mode}, "
            f"{self.discovery} discovery; model {self.model_path}"
        )

    def preflight(self) -> None:
        """What can be found wrong before anything starts: the model is a directory on this host,
        and the engine is installed for ``sglang`` and ``vllm`` workers (``InvalidRequest`` naming
        the field)."""
        require_model_dir(self.model_path)
        if self.worker_kind in GPU_KINDS:
            engine = self.worker_kind
            instead = "worker kind 'reference' runs the CPU reference engine, 'mocker' Dynamo's mocker"
            require_module(engine, "worker_kind", f"'{engine}' workers run dynamo.{engine}; {instead}", self.python)


#: The config's name before every engine's was named ``<Engine>FleetConfig`` (docs, tests and
#: user code still use it).
DynamoFleet = DynamoFleetConfig


# -- the fleet as launch commands (the one place its command lines come from) -------------------


def fleet_planes(cfg: DynamoFleetConfig, kv_dir: str | os.PathLike[str] | None = None) -> DynamoPlanes:
    """The fleet's discovery and planes (``kv_dir``: its ``DYN_FILE_KV`` for file discovery)."""
    file_kv = str(kv_dir) if kv_dir is not None and cfg.discovery == "file" else None
    return carry(DynamoPlanes, cfg, nats_url=cfg.nats_server, file_kv=file_kv)


def worker_command(cfg: DynamoFleetConfig, namespace: str, planes: DynamoPlanes) -> DynamoWorkerCommand:
    """Every worker of the fleet (one ``build`` per worker); same-named config fields carry over."""
    extra = {"mocker": cfg.mocker_args, "sglang": cfg.sglang_args, "vllm": cfg.vllm_args}.get(cfg.worker_kind, ())
    return carry(DynamoWorkerCommand, cfg, kind=cfg.worker_kind, namespace=namespace, planes=planes,
                 served_model_name=cfg.model_name, extra_args=extra, env=cfg.worker_env,
                 grace=10.0 if cfg.worker_kind in GPU_KINDS else 5.0)  # fmt: skip


def frontend_command(cfg: DynamoFleetConfig, namespace: str, planes: DynamoPlanes) -> DynamoFrontend:
    """The fleet's frontend; same-named config fields carry over."""
    return carry(DynamoFrontend, cfg, namespace=namespace, planes=planes, extra_args=cfg.frontend_args, grace=5.0)


def _node(
    cfg: DynamoFleetConfig,
    index: int,
    log_dir: str | os.PathLike[str],
    picked: set[int],
    fixed: Mapping[str, int] | None = None,
) -> NodeContext:
    """This host as the node of worker ``index`` (-1: the frontend). GPU workers get a GPU each."""
    gpus: tuple[str, ...] = ()
    if cfg.worker_kind in GPU_KINDS and index >= 0:
        gpus = tuple((cfg.gpus[index] if cfg.gpus else str(index)).split(","))
    return NodeContext.on(index, cfg.host, str(log_dir), gpu_ids=gpus, picked=picked, fixed=fixed)


@attrs.frozen(slots=True)
class _WorkerPorts:
    system: int
    rpc: int
    kv_events: int | None = None
    sglang: int | None = None
    nccl: int | None = None


def _worker_launch(cfg: DynamoFleetConfig, index: int, namespace: str, ports: _WorkerPorts) -> Launch:
    fixed = {k: v for k, v in attrs.asdict(ports).items() if v is not None}
    return worker_command(cfg, namespace, fleet_planes(cfg)).build(_node(cfg, index, "", set(), fixed))


def frontend_argv(cfg: DynamoFleetConfig, namespace: str, http_port: int) -> list[str]:
    """The frontend's command line (a view of :func:`frontend_command`; every plane explicit)."""
    cmd = attrs.evolve(frontend_command(cfg, namespace, fleet_planes(cfg)), http_port=http_port)
    return list(cmd.build(_node(cfg, -1, "", set()), []).spec.argv)


def worker_argv(cfg: DynamoFleetConfig, index: int, namespace: str, ports: _WorkerPorts) -> list[str]:
    """Worker ``index``'s command line on ``ports`` (a view of :func:`worker_command`)."""
    return list(_worker_launch(cfg, index, namespace, ports).spec.argv)


def worker_env(
    cfg: DynamoFleetConfig, index: int, common: Mapping[str, str | None], ports: _WorkerPorts
) -> dict[str, str | None]:
    """Worker ``index``'s environment on ``ports`` over ``common`` (a view of :func:`worker_command`)."""
    return {**common, **_worker_launch(cfg, index, "ns", ports).spec.env}


def _common_env(cfg: DynamoFleetConfig, namespace: str, kv_dir: Path) -> dict[str, str | None]:
    """What every process of the fleet gets (a view of :meth:`DynamoPlanes.env`)."""
    ctx = _node(cfg, -1, "", set())
    return fleet_planes(cfg, kv_dir).env(ctx.bind_host, ctx.advertise_host, namespace=namespace)


@attrs.define(eq=False)
class RunningDynamoFleet:
    """A launched fleet: URLs, the supervisor, and ``connect()`` for the backend."""

    config: DynamoFleetConfig
    namespace: str
    frontend_url: str
    worker_urls: tuple[str, ...]  #: each worker's system-port URL (engine routes)
    rpc_ports: Mapping[str, int]  #: worker URL -> request-plane port (maps instance ids)
    worker_names: tuple[str, ...]
    supervisor: Supervisor
    run_dir: Path  #: removed on exit unless ``launch_dynamo_fleet(keep_run_dir=True)``
    #: Frontends :meth:`add_frontend` started: URL -> router mode.
    frontends: dict[str, str] = attrs.field(factory=dict)
    _backends: list[HttpFleetBackend] = attrs.field(factory=list)

    async def add_frontend(
        self,
        router_mode: str,
        *,
        router_predicted_ttl_secs: float | None = None,
        name: str | None = None,
        timeout: float = 120.0,
    ) -> str:
        """Start one more frontend over the same workers, in ``router_mode``; return its URL.

        It discovers the fleet's workers (same namespace and discovery) and, in ``kv`` mode, reads
        their KV events like the first one. Stopped with the fleet. For comparing router modes on
        warm workers without restarting anything (``connect(frontend_url=...)`` reaches it).
        """
        cfg = attrs.evolve(
            self.config, router_mode=router_mode, router_predicted_ttl_secs=router_predicted_ttl_secs
        )  # validates the mode and the TTL against kv_events
        name = name or f"frontend-{len(self.frontends)}"
        planes = fleet_planes(cfg, self.run_dir / "kv")
        ctx = _node(cfg, -1, self.supervisor.log_dir, set(self.frontends_ports()))
        engines = [
            EngineInfo(index=i, name=n, host=cfg.host, node_id=None, node_ip=None, pid=0, generate_url=None,
                       control_url=u, extra={"rpc_port": self.rpc_ports[u]})
            for i, (u, n) in enumerate(zip(self.worker_urls, self.worker_names, strict=True))
        ]  # fmt: skip
        launch = frontend_command(cfg, self.namespace, planes).build(ctx, engines).named(name)
        await self.supervisor.start(launch.spec)
        await self.supervisor.wait_ready([name], timeout=timeout)
        self.frontends[launch.control_url] = router_mode
        return launch.control_url

    @property
    def log_dir(self) -> Path:
        """Where every process's ``<name>.log`` is (``log_dir`` if given, else ``run_dir / "logs"``)."""
        return self.supervisor.log_dir

    def frontends_ports(self) -> list[int]:
        """The HTTP ports of every frontend of this fleet."""
        return [int(u.rsplit(":", 1)[1]) for u in (self.frontend_url, *self.frontends)]

    def connect_options(self, frontend_url: str | None = None) -> dict[str, Any]:
        """What :meth:`connect` passes to ``dynamo.connect`` besides the URLs (and what
        :meth:`connect_url` writes in the query): everything this launcher knows about its workers."""
        url = frontend_url or self.frontend_url
        if url != self.frontend_url and url not in self.frontends:
            raise InvalidRequest("frontend_url", f"{url!r} is not a frontend of this fleet")
        options: dict[str, Any] = {"router_mode": self.frontends.get(url, self.config.router_mode)}
        # The mocker has no engine routes to probe; dynamo.sglang's routes differ by version (and by
        # whether the shim took): connect() detects them.
        flavor = {"reference": "rollout", "mocker": "mocker", "vllm": "vllm"}.get(self.config.worker_kind)
        if flavor is not None:
            options["flavor"] = flavor
        if self.config.worker_kind == "vllm" and self.config.transfer_backend is not None:
            options["transfer_backend"] = self.config.transfer_backend
        if self.config.worker_kind == "vllm":  # Dynamo does not show it either (filtered_logprobs)
            options["logprobs_mode"] = vllm_logprobs_mode(self.config.vllm_args)
        if self.config.worker_kind == "sglang":
            # Without --enable-memory-saver SGLang's release_memory_occupation frees nothing (its
            # no-op memory saver adapter) yet answers success, and dynamo.sglang unregisters and
            # re-registers the worker around it: memory_release must not be declared then. Said,
            # not asked (connect's detection): stock 1.6.x workers have no route that shows it.
            options["memory_saver"] = "--enable-memory-saver" in self.config.sglang_args
        options["model"] = self.config.model_name
        options["initial_version"] = self.config.weight_version
        options["model_path"] = self.config.model_path
        options["namespace"] = self.namespace
        if not self.config.native_generate:
            options["native_generate"] = False
        return options

    def connect_url(self, frontend_url: str | None = None) -> str:
        """A ``dynamo://`` URL that ``rollout_backends.open_backend`` opens as :meth:`connect` would."""
        url = frontend_url or self.frontend_url
        query: dict[str, str] = {
            "workers": ",".join(u.split("://", 1)[1] for u in self.worker_urls),
            "rpc_ports": ",".join(str(self.rpc_ports[u]) for u in self.worker_urls),
        }
        for key, value in self.connect_options(url).items():
            query[key] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return f"dynamo://{url.split('://', 1)[1]}?{urlencode(query, safe=',/:')}"

    async def connect(self, *, frontend_url: str | None = None, **kwargs: Any) -> HttpFleetBackend:
        """The ``RolloutBackend`` over this fleet (closed with the fleet), through the first
        frontend or ``frontend_url`` (one :meth:`add_frontend` started)."""
        from ._client import connect

        url = frontend_url or self.frontend_url
        for key, value in self.connect_options(url).items():
            kwargs.setdefault(key, value)
        backend = await connect(url, workers=list(self.worker_urls), rpc_ports=self.rpc_ports, **kwargs)
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
        return (await get_json(f"{self.frontend_url}/health", timeout=2.0))[1]

    async def aclose(self) -> None:
        for b in self._backends:
            await b.aclose()
        await self.supervisor.aclose()


@asynccontextmanager
async def launch_dynamo_fleet(
    config: DynamoFleetConfig,
    *,
    log_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[ReadyProgress], None] | None = None,
    keep_run_dir: bool = False,
) -> AsyncIterator[RunningDynamoFleet]:
    """Start the frontend and the workers; yield when the frontend routes to all of them.

    Ready = the frontend's ``/health`` lists ``config.workers`` ``generate`` instances of this
    fleet's namespace, then ``/v1/models`` is non-empty. Raises ``BackendUnavailable`` (with log
    tails) when a process exits or the fleet is not ready within ``config.ready_timeout``.

    The run folder (``dynamo-<namespace>-*`` under the temporary directory: file discovery, etcd's
    data, and the logs unless ``log_dir`` puts them elsewhere) is removed on exit unless
    ``keep_run_dir``; logs in ``log_dir`` always stay, and so do those of a failed start (the
    error names them). A model that is not a directory here fails before anything starts.
    """
    cfg = config
    cfg.preflight()
    namespace = cfg.namespace or f"rb{uuid.uuid4().hex[:10]}"
    run_dir = Path(tempfile.mkdtemp(prefix=f"dynamo-{namespace}-"))
    logs = Path(log_dir) if log_dir is not None else run_dir / "logs"
    kv_dir = run_dir / "kv"
    kv_dir.mkdir(parents=True)
    sup = Supervisor(logs, grace=10.0)
    fleet: RunningDynamoFleet | None = None
    try:
        if cfg.start_etcd:
            # etcd (and NATS for a nats plane) under this fleet's supervisor; stopped with the fleet.
            from ._services import EtcdNats

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
        planes = fleet_planes(cfg, kv_dir)
        gpus = [_node(cfg, i, logs, set()).gpu_ids for i in range(cfg.workers)]
        launched = await launch_fleet(
            worker_command(cfg, namespace, planes),
            cfg.workers,
            frontend_command(cfg, namespace, planes),
            Local(host=cfg.host, gpu_ids=gpus if any(gpus) else ()),
            supervisor=sup,
            ready_timeout=cfg.ready_timeout,
            entry_name="frontend",
            progress=progress,
        )
        assert launched.entry_url is not None
        fleet = RunningDynamoFleet(
            config=cfg,
            namespace=namespace,
            frontend_url=launched.entry_url,
            worker_urls=tuple(e.control_url for e in launched.engines),
            rpc_ports={e.control_url: int(e.extra["rpc_port"]) for e in launched.engines},
            worker_names=tuple(e.name for e in launched.engines),
            supervisor=sup,
            run_dir=run_dir,
        )
        yield fleet
    finally:
        try:
            if fleet is not None:
                await fleet.aclose()
            else:
                await sup.aclose()
        finally:
            # The kv dir always goes (a crash may leave it behind); the rest unless asked to keep it,
            # or unless the start failed and wrote logs here: the error names them.
            failed_start = fleet is None and logs.is_relative_to(run_dir) and any(logs.glob("*.log"))
            keep = keep_run_dir or failed_start
            await asyncio.to_thread(shutil.rmtree, kv_dir if keep else run_dir, True)
