"""Launch an SGLang fleet: N workers (real SGLang or reference servers) behind an optional router.

    config = SGLangFleetConfig(model_path="/models/tiny", workers=2, router="smg", router_policy="cache_aware")
    async with launch_sglang_fleet(config) as fleet:
        gen = await fleet.backend.generate(GenerateRequest(input_ids=[1, 2, 3]))
    # every process (workers, router, their children) is gone here

Order (:func:`rollout_backends.launch.launch_fleet`, the start-up loop every fleet shares): every
worker (and an ``smg`` router, which needs none at start) is spawned at once by the shared
:class:`~rollout_backends.launch.Supervisor`; the launcher waits until each worker
answers its health route (progress through ``progress``; on timeout the error names what is not
ready with the tail of its log), registers the workers with the router (``POST /workers`` on
``smg``; ``--worker-urls`` on ``sglang-router``, started after the workers), waits until the
router lists every worker healthy, then connects an ``HttpFleetBackend`` (generation through the
router, control calls fanned out to each worker URL).

Closing the fleet or its backend stops everything: SIGTERM to each process group, then SIGKILL
after the grace (``router_grace_s`` >= 8 s for smg, which keeps its listener open 5 s on SIGTERM).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlencode

import attrs

from rollout_backends import BackendUnavailable, InvalidRequest, RoutingKind
from rollout_backends.kit import HttpFleetBackend
from rollout_backends.launch import (
    EngineCommand,
    EngineInfo,
    Local,
    NodeContext,
    ReadyProgress,
    RunningFleet,
    Supervisor,
    carry,
    launch_fleet,
    port_in_use,
    require_model_dir,
    require_module,
    str_tuple,
)

from ._client import connect, vocab_size_of, worker_id_of
from ._launch import ReferenceServerCommand, SGLangServerCommand, SmgRouter

__all__ = [
    "ROUTER_POLICIES",
    "RunningSGLangFleet",
    "SGLangFleet",
    "SGLangFleetConfig",
    "engine_command",
    "launch_sglang_fleet",
    "router_argv",
    "router_command",
    "start_sglang_fleet",
    "worker_argv",
]

#: Every worker kind, with what it runs: the launch line and ``--worker-kind``'s help read this.
WORKER_KIND_DESCRIPTIONS: Mapping[str, str] = {
    "sglang": "SGLang (python -m sglang.launch_server; GPU)",
    "reference": "the CPU reference engine behind SGLang's native API (not SGLang)",
}
WORKER_KINDS = tuple(WORKER_KIND_DESCRIPTIONS)
ROUTERS = ("none", "smg", "sglang-router")
#: Policies each router accepts (smg 1.13.0 ``--help``; sglang-router 0.3.x).
ROUTER_POLICIES: Mapping[str, tuple[str, ...]] = {
    "smg": (
        "cache_aware",
        "round_robin",
        "random",
        "power_of_two",
        "least_load",
        "manual",
        "consistent_hashing",
        "prefix_hash",
        "passthrough",
    ),
    "sglang-router": ("cache_aware", "round_robin", "random", "power_of_two"),
}
_ROUTING_KIND = {
    "cache_aware": RoutingKind.CACHE_AWARE,
    "round_robin": RoutingKind.ROUND_ROBIN,
    "random": RoutingKind.RANDOM,
}
#: Share of a GPU's memory that all SGLang workers on it may take together when
#: ``mem_fraction_static`` is not given and several workers share one device.
_SHARED_GPU_BUDGET = 0.8


def _opt_tuple(value: Sequence[Any] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(str(v) for v in value)


def _opt_int_tuple(value: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(v) for v in value)


@attrs.frozen(slots=True, kw_only=True)
class SGLangFleetConfig:
    """What to launch. Every field is optional except ``model_path``.

    Ports: ``worker_ports`` (one per worker) or ``worker_base_port`` (worker *i* on base + *i*),
    else free ports chosen now; ``router_port`` and ``router_prometheus_port`` likewise. A port
    already bound fails before anything starts.

    SGLang-only flags (``mem_fraction_static``, backends, CUDA graphs, radix cache, memory saver,
    deterministic inference) are not passed to ``reference`` workers, which are deterministic,
    always report ``cached_tokens`` from a page-granular prefix index and never use a GPU.
    """

    # The defaults here are the command line's too (``launch sglang`` reads them from these fields).
    model_path: str = attrs.field(converter=str)
    #: One worker unless told: each ``sglang`` worker takes a GPU, and how many the host has is the
    #: caller's to say.
    workers: int = 1
    #: ``sglang``: ``python -m sglang.launch_server``; ``reference``: our CPU reference server.
    #: SGLang unless told otherwise: a fleet launched as SGLang's runs SGLang. The reference engine
    #: speaks the same API, so answering in its place it would pass for SGLang (its tokens, speed
    #: and failures are not SGLang's); it is one flag away, and the CLI's first line names the kind.
    worker_kind: str = "sglang"
    host: str = "127.0.0.1"
    worker_ports: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_int_tuple)
    worker_base_port: int | None = None
    #: ``CUDA_VISIBLE_DEVICES`` of each worker (e.g. ``("0", "1")`` or ``("0,1", "2,3")``).
    cuda_visible_devices: tuple[str, ...] | None = attrs.field(default=None, converter=_opt_tuple)
    #: ``--mem-fraction-static``; ``None``: SGLang's default for a worker alone on its GPU(s),
    #: ``0.8 / n`` when ``n`` workers share a device.
    mem_fraction_static: float | None = None
    page_size: int = 16
    attention_backend: str | None = "triton"
    sampling_backend: str | None = "pytorch"
    disable_cuda_graph: bool = True
    disable_radix_cache: bool = False
    enable_memory_saver: bool = False
    deterministic_inference: bool = False
    skip_tokenizer_init: bool = False
    random_seed: int | None = None
    weight_version: str = "default"
    #: sglang workers: publish KV-cache events (``--kv-events-config``, a ZMQ port each).
    kv_events: bool = False
    served_model_name: str | None = None
    api_key: str | None = attrs.field(default=None, repr=False)
    admin_api_key: str | None = attrs.field(default=None, repr=False)
    #: Appended verbatim to every worker's command line.
    extra_server_args: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    #: Extra environment of every worker (on top of the defaults below).
    env: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    #: ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``: off, so router health probes never generate.
    health_endpoint_generation: bool = False
    #: Torch threads of each reference worker.
    reference_threads: int = 1
    router: str = "smg"
    #: smg's own default policy (smg 1.13.0 ``--help``): what its documentation describes.
    router_policy: str = "cache_aware"
    router_port: int | None = None
    router_prometheus_port: int | None = None
    #: Seconds between the router's health probes of each worker (``--health-check-interval-secs``).
    health_check_interval_s: int = 10
    #: Router retries (of requests whose connection failed) on another worker.
    router_retries: bool = True
    #: How workers join the router: ``api`` (``POST /workers``; smg only; the router starts with the
    #: workers), ``cli`` (``--worker-urls``; the router starts once the workers are up), or ``auto``:
    #: ``api`` on smg except for ``power_of_two`` (smg refuses to start it with < 2 workers), else ``cli``.
    router_registration: str = "auto"
    #: Appended verbatim to the router's command line.
    extra_router_args: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    #: Logs of every process (``<name>.log``); ``None``: a fresh temporary directory.
    log_dir: str | None = attrs.field(default=None, converter=attrs.converters.optional(str))
    #: Seconds to wait for the workers; ``None``: 900 for SGLang (first-run kernel JIT), 180 for reference.
    startup_timeout_s: float | None = None
    router_timeout_s: float = 60.0
    #: SIGTERM → SIGKILL grace of workers and of the router.
    worker_grace_s: float = 10.0
    router_grace_s: float = 8.0
    python: str = sys.executable

    def __attrs_post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise InvalidRequest("workers", f"must be an int >= 1, got {self.workers!r}")
        if self.worker_kind not in WORKER_KINDS:
            raise InvalidRequest("worker_kind", f"must be one of {WORKER_KINDS}, got {self.worker_kind!r}")
        if self.router not in ROUTERS:
            raise InvalidRequest("router", f"must be one of {ROUTERS}, got {self.router!r}")
        if self.router != "none" and self.router_policy not in ROUTER_POLICIES[self.router]:
            known = ROUTER_POLICIES[self.router]
            raise InvalidRequest("router_policy", f"{self.router} has no policy {self.router_policy!r} ({known})")
        if self.router_registration not in ("auto", "api", "cli"):
            raise InvalidRequest("router_registration", f"must be auto, api or cli, got {self.router_registration!r}")
        if self.router == "sglang-router" and self.router_registration == "api":
            raise InvalidRequest("router_registration", "sglang-router is given its workers with --worker-urls (cli)")
        if self.worker_ports is not None and self.worker_base_port is not None:
            raise InvalidRequest("worker_ports", "give worker_ports or worker_base_port, not both")
        if self.worker_ports is not None and len(self.worker_ports) != self.workers:
            raise InvalidRequest("worker_ports", f"{len(self.worker_ports)} ports for {self.workers} workers")
        if self.cuda_visible_devices is not None and len(self.cuda_visible_devices) != self.workers:
            raise InvalidRequest(
                "cuda_visible_devices", f"{len(self.cuda_visible_devices)} entries for {self.workers} workers"
            )
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise InvalidRequest("mem_fraction_static", f"must be in (0, 1), got {self.mem_fraction_static}")
        if self.page_size < 1:
            raise InvalidRequest("page_size", f"must be >= 1, got {self.page_size}")
        if self.health_check_interval_s < 1:
            raise InvalidRequest("health_check_interval_s", "must be >= 1 (smg's minimum)")
        if not self.weight_version:
            raise InvalidRequest("weight_version", "must be a non-empty string")
        ports = [p for p in (*(self.worker_ports or ()), self.router_port, self.router_prometheus_port) if p]
        if len(set(ports)) != len(ports):
            raise InvalidRequest("worker_ports", f"ports must be distinct, got {ports}")

    @property
    def registration(self) -> str:
        """``api``, ``cli`` or ``none`` (no router): ``router_registration`` with ``auto`` resolved."""
        if self.router == "none":
            return "none"
        if self.router_registration != "auto":
            return self.router_registration
        return "api" if self.router == "smg" and self.router_policy != "power_of_two" else "cli"

    @property
    def routing_kind(self) -> RoutingKind:
        if self.router == "none":
            return RoutingKind.SINGLE if self.workers == 1 else RoutingKind.OTHER
        return _ROUTING_KIND.get(self.router_policy, RoutingKind.OTHER)

    def describe(self) -> str:
        """One line saying what this config starts (the CLI prints it first)."""
        kind = f"{self.workers} x {self.worker_kind} worker{'s' if self.workers > 1 else ''}"
        entry = "no router" if self.router == "none" else f"router {self.router} (policy {self.router_policy})"
        return f"{kind}: {WORKER_KIND_DESCRIPTIONS[self.worker_kind]}; {entry}; model {self.model_path}"

    def preflight(self) -> None:
        """What can be found wrong on this host before anything starts: the model is a directory
        here, and SGLang is installed for ``sglang`` workers (``InvalidRequest`` naming the field)."""
        require_model_dir(self.model_path)
        if self.worker_kind == "sglang":
            instead = "worker kind 'reference' runs the CPU reference engine instead"
            require_module("sglang", "worker_kind", f"'sglang' workers run SGLang; {instead}", self.python)

    def default_startup_timeout(self) -> float:
        if self.startup_timeout_s is not None:
            return self.startup_timeout_s
        return 900.0 if self.worker_kind == "sglang" else 180.0

    def worker_mem_fraction(self, index: int) -> float | None:
        """The ``--mem-fraction-static`` worker ``index`` gets (see the field)."""
        if self.mem_fraction_static is not None:
            return self.mem_fraction_static
        if self.cuda_visible_devices is None:
            sharing = self.workers
        else:
            mine = set(self.cuda_visible_devices[index].split(","))
            sharing = sum(1 for d in self.cuda_visible_devices if mine & set(d.split(",")))
        return None if sharing <= 1 else round(_SHARED_GPU_BUDGET / sharing, 3)


# -- the fleet as launch commands (the one place its command lines come from) -------------------


def engine_command(config: SGLangFleetConfig, index: int) -> EngineCommand:
    """Worker ``index``'s engine command (same-named config fields carry over; SGLang-only flags
    never reach ``reference`` workers, whose command has no such fields)."""
    c = config
    common: dict[str, Any] = {"extra_args": c.extra_server_args, "grace": c.worker_grace_s}
    if c.worker_kind == "reference":
        return carry(ReferenceServerCommand, c, num_threads=c.reference_threads, **common)
    return carry(SGLangServerCommand, c, mem_fraction_static=c.worker_mem_fraction(index), **common)


def router_command(config: SGLangFleetConfig, policy: str | None = None) -> SmgRouter:
    """The fleet's router (``policy`` overrides the configured one). Workers are passed as
    ``--worker-urls`` only with ``cli`` registration (``api``: ``POST /workers`` once it is up)."""
    c = config if policy is None else attrs.evolve(config, router_policy=policy)
    return carry(
        SmgRouter,
        c,
        policy=c.router_policy,
        register_workers=c.registration == "cli",
        health_failure_threshold=None,  # smg's default (3)
        log_level=None,  # smg's default (info): its log tail explains a failed start
        file_logs=False,  # one log per process in the fleet's log_dir
        retries=c.router_retries,
        extra_args=c.extra_router_args,
        grace=c.router_grace_s,
    )


def _node(
    config: SGLangFleetConfig, index: int, log_dir: str, picked: set[int], fixed: Mapping[str, int] | None = None
) -> NodeContext:
    """This host as the node of worker ``index`` (-1: a router), with its ``cuda_visible_devices``."""
    devices = config.cuda_visible_devices
    gpus = tuple(devices[index].split(",")) if devices is not None and index >= 0 else ()
    return NodeContext.on(index, config.host, log_dir, gpu_ids=gpus, picked=picked, fixed=fixed)


def _engine_info(url: str, index: int) -> EngineInfo:
    return EngineInfo(index=index, name=f"worker-{index}", host="", node_id=None, node_ip=None, pid=0,
                      generate_url=url, control_url=url)  # fmt: skip


def worker_argv(config: SGLangFleetConfig, index: int, port: int) -> list[str]:
    """Worker ``index``'s command line on ``port`` (a view of :func:`engine_command`)."""
    ctx = _node(config, index, config.log_dir or "", set(), {"http": port})
    return list(engine_command(config, index).build(ctx).spec.argv)


def worker_env(config: SGLangFleetConfig, index: int) -> dict[str, str | None]:
    """Worker ``index``'s environment (a view of :func:`engine_command`)."""
    return dict(engine_command(config, index).build(_node(config, index, config.log_dir or "", set())).spec.env)


def router_argv(config: SGLangFleetConfig, port: int, prometheus_port: int, worker_urls: Sequence[str]) -> list[str]:
    """The router's command line (a view of :func:`router_command`). ``worker_urls`` are passed as
    ``--worker-urls`` unless the workers register through ``POST /workers`` (``registration == "api"``)."""
    ctx = _node(config, -1, config.log_dir or "", set(), {"http": port, "prometheus": prometheus_port})
    engines = [_engine_info(u, i) for i, u in enumerate(worker_urls)]
    return list(router_command(config).build(ctx, engines).spec.argv)


# -- the fleet ----------------------------------------------------------------------------------


class RunningSGLangFleet:
    """A launched fleet. Use ``async with launch_sglang_fleet(config) as fleet`` or
    ``fleet = await start_sglang_fleet(config)`` ... ``await fleet.aclose()``.

    ``backend`` is an ``HttpFleetBackend``; closing it also stops the fleet. The processes are
    started by :func:`rollout_backends.launch.launch_fleet` (``Local`` placement), like every fleet's.
    """

    def __init__(
        self,
        config: SGLangFleetConfig,
        *,
        progress: Callable[[ReadyProgress], None] | None = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.config = config
        self.progress = progress
        self.supervisor = supervisor or Supervisor(config.log_dir, grace=config.worker_grace_s)
        self.log_dir: Path = self.supervisor.log_dir
        self.fleet: RunningFleet | None = None
        self._backend: HttpFleetBackend | None = None
        self._started = False
        self._closed = False
        self._close_lock: asyncio.Lock | None = None

    # -- queries --------------------------------------------------------------------------------

    @property
    def backend(self) -> HttpFleetBackend:
        if self._backend is None:
            raise RuntimeError("the fleet is not started (use `async with launch_sglang_fleet(config)`)")
        return self._backend

    @property
    def worker_urls(self) -> tuple[str, ...]:
        return () if self.fleet is None else tuple(e.control_url for e in self.fleet.engines)

    @property
    def router_url(self) -> str | None:
        return None if self.fleet is None else self.fleet.entry_url

    @property
    def router_prometheus_port(self) -> int | None:
        launch = None if self.fleet is None else self.fleet.entry_launch
        return None if launch is None else int(launch.extra["prometheus_port"])

    @property
    def worker_ids(self) -> tuple[str, ...]:
        """``host:port`` of each worker (the backend's worker ids)."""
        return tuple(worker_id_of(u) for u in self.worker_urls)

    @property
    def entry_url(self) -> str:
        """Where generation goes: the router, or the first worker without one."""
        return self.router_url or self.worker_urls[0]

    def connect_url(self) -> str:
        """An ``sglang://`` URL that ``rollout_backends.open_backend`` opens as this fleet's backend
        (its workers, its routing kind, the model's vocabulary size where ``config.json`` gives it).
        Keys are not in it: pass ``api_key`` / ``admin_api_key`` to ``open_backend``."""
        query = {"workers": ",".join(self.worker_ids), "routing": self.config.routing_kind.value}
        vocab = vocab_size_of(self.config.model_path)
        if vocab is not None:
            query["vocab_size"] = str(vocab)
        return f"sglang://{self.entry_url.split('://', 1)[1]}?{urlencode(query, safe=',:')}"

    def worker_name(self, index: int) -> str:
        return f"worker-{index}"

    @property
    def router_name(self) -> str:
        return "router"

    def pids(self) -> dict[str, list[int]]:
        """Every live pid of every process group, by process name."""
        return {n: self.supervisor.group_pids(n) for n in self.supervisor.names}

    # -- start ----------------------------------------------------------------------------------

    def placement(self) -> Local:
        """This host, with the ports the config fixes. Fails before anything starts where
        ``config.preflight()`` does, or where a port is bound."""
        c = self.config
        c.preflight()
        if c.worker_ports is not None:
            workers = list(c.worker_ports)
        elif c.worker_base_port is not None:
            workers = [c.worker_base_port + i for i in range(c.workers)]
        else:
            workers = []
        router = {k: p for k, p in (("http", c.router_port), ("prometheus", c.router_prometheus_port)) if p}
        busy = [p for p in (*workers, *router.values()) if port_in_use(c.host, p)]
        if busy:
            raise BackendUnavailable(f"port(s) {busy} on {c.host} are already in use; nothing was started")
        devices = c.cuda_visible_devices
        return Local(
            host=c.host,
            gpu_ids=[d.split(",") for d in devices] if devices is not None else (),
            engine_ports=[{"http": p} for p in workers],
            entry_ports=router,
        )

    async def start(self) -> RunningSGLangFleet:
        """Start everything and connect the backend; on any failure stop what started and raise."""
        if self._started:
            raise RuntimeError("the fleet was already started")
        self._started = True
        c = self.config
        try:
            self.fleet = await launch_fleet(
                [engine_command(c, i) for i in range(c.workers)],
                c.workers,
                None if c.router == "none" else router_command(c),
                self.placement(),
                supervisor=self.supervisor,
                ready_timeout=c.default_startup_timeout(),
                entry_timeout=c.router_timeout_s,
                entry_name=self.router_name,
                progress=self.progress,
            )
            self._backend = await connect(
                self.entry_url,
                workers=list(self.worker_urls),
                routing=c.routing_kind,
                api_key=c.api_key,
                admin_api_key=c.admin_api_key,
                vocab_size=vocab_size_of(c.model_path),
                on_close=self.aclose,
            )
        except BaseException:
            await self.aclose()
            raise
        return self

    async def add_router(self, policy: str, *, name: str | None = None) -> str:
        """Start one more router of the configured kind, with ``policy``, over the same workers.

        Returns its URL. It is stopped with the fleet. For comparing policies on warm workers.
        """
        c = self.config
        if c.router == "none":
            raise InvalidRequest("router", "this fleet has no router kind to start another of")
        if policy not in ROUTER_POLICIES[c.router]:
            raise InvalidRequest("policy", f"{c.router} has no policy {policy!r}")
        if self.fleet is None or self._backend is None or self._closed:
            raise RuntimeError("the fleet is not running")
        name = name or f"router-{policy}-{len(self.supervisor.names)}"
        launch = await self.fleet.add_entry(
            router_command(c, policy), name, timeout=c.router_timeout_s, fixed={}, progress=self.progress
        )
        return launch.control_url

    # -- stop -----------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the backend's client and stop every process (idempotent; also run by ``backend.aclose``)."""
        if self._close_lock is None:
            self._close_lock = asyncio.Lock()
        async with self._close_lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._backend is not None:
                    await self._backend.client.aclose()
                if self.fleet is not None:
                    await self.fleet.aclose()
            finally:
                await self.supervisor.aclose()

    async def __aenter__(self) -> RunningSGLangFleet:
        if not self._started:
            await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (
            f"<RunningSGLangFleet {self.config.worker_kind} x{self.config.workers} router={self.config.router}"
            f"({self.config.router_policy}) workers={list(self.worker_urls)} router_url={self.router_url}>"
        )


#: The name the fleet had before every engine's running fleet was named ``Running<Engine>Fleet``
#: (docs, tests and user code still use it).
SGLangFleet = RunningSGLangFleet


def launch_sglang_fleet(
    config: SGLangFleetConfig, *, progress: Callable[[ReadyProgress], None] | None = None
) -> RunningSGLangFleet:
    """An async context manager that starts the fleet on entry and stops it on exit."""
    return RunningSGLangFleet(config, progress=progress)


async def start_sglang_fleet(
    config: SGLangFleetConfig, *, progress: Callable[[ReadyProgress], None] | None = None
) -> RunningSGLangFleet:
    """Start the fleet now; stop it with ``await fleet.aclose()`` (or ``await fleet.backend.aclose()``)."""
    return await RunningSGLangFleet(config, progress=progress).start()
