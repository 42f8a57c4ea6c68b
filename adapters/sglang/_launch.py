"""Launch commands for SGLang-native engines and the smg router (see ``rollout_backends.launch``).

* :class:`SGLangServerCommand`: ``python -m sglang.launch_server`` on the engine's GPUs.
* :class:`SmgRouter`: ``python -m smg.launch_router`` in front of the engines (the fleet's
  generation entry); control calls still go to each engine.
* :func:`connect_engines`: ``connect(entry or engine 0, workers=[every engine])``.

* :class:`ReferenceServerCommand`: our CPU reference server (SGLang's native API over a
  ``ReferenceEngine``); it lives here, with the other SGLang-native servers, so that the SGLang
  launcher needs nothing from the reference adapter (which re-exports it).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rollout_backends import BackendUnavailable, InvalidRequest, RolloutBackendError
from rollout_backends.kit import HttpClient, HttpFleetBackend, HttpRequest
from rollout_backends.launch import EngineInfo, Launch, NodeContext, ProcessSpec, ReadyCheck, env_map, str_tuple

__all__ = [
    "NativeServerCommand",
    "ReferenceServerCommand",
    "SGLangServerCommand",
    "SmgRouter",
    "connect_engines",
    "key_args",
    "kv_events_config",
    "server_env",
]

#: The router modules: ``smg`` (``smg.launch_router``) and ``sglang-router`` (``sglang_router.launch_router``).
ROUTER_MODULES: Mapping[str, str] = {"smg": "smg.launch_router", "sglang-router": "sglang_router.launch_router"}


def key_args(api_key: str | None, admin_api_key: str | None = None) -> list[str]:
    """``--api-key`` / ``--admin-api-key`` of an SGLang-native server or router (redacted in logs)."""
    out: list[str] = []
    if api_key:
        out += ["--api-key", api_key]
    if admin_api_key:
        out += ["--admin-api-key", admin_api_key]
    return out


def kv_events_config(port: int) -> str:
    """SGLang's ``--kv-events-config`` for a ZMQ publisher on ``port`` (every interface)."""
    cfg = {"publisher": "zmq", "topic": "kv-events", "endpoint": f"tcp://*:{port}"}
    return json.dumps(cfg, separators=(",", ":"))


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header a ready check sends to a server started with ``--api-key``."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def server_env(
    ctx: NodeContext, env: Mapping[str, str], *, health_endpoint_generation: bool = False, **more: str
) -> dict[str, str | None]:
    """Environment of an SGLang-native server (SGLang or the reference server) in ``ctx``: offline
    model loading, ``/health`` without a generation (router probes), the context's GPUs, ``more``,
    then the command's own ``env``."""
    out: dict[str, str | None] = {
        # Off: /health answers without running a generation (routers probe it every few seconds).
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "1" if health_endpoint_generation else "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if ctx.gpu_ids:
        out["CUDA_VISIBLE_DEVICES"] = ",".join(ctx.gpu_ids)
    out.update(more)
    out.update(env)
    return out


async def connect_engines(entry_url: str | None, engines: Sequence[EngineInfo], **kwargs: Any) -> HttpFleetBackend:
    """The SGLang backend: generation to ``entry_url`` (a router) or, without one, to engine 0;
    control calls to every engine."""
    from ._client import connect

    urls = [e.generate_url for e in engines]
    if any(u is None for u in urls):
        raise InvalidRequest("engines", "every SGLang-native engine needs a generation URL")
    workers = [u for u in urls if u is not None]
    return await connect(entry_url or workers[0], workers=workers, **kwargs)


@attrs.frozen(kw_only=True)
class NativeServerCommand:
    """What every SGLang-native server command shares (``SGLangServerCommand``, the reference
    server's): keys, environment, the ready check, ``connect``."""

    model_path: str
    served_model_name: str | None = None
    api_key: str | None = attrs.field(default=None, repr=False)
    admin_api_key: str | None = attrs.field(default=None, repr=False)
    #: ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``: off, so router health probes never generate.
    health_endpoint_generation: bool = False
    extra_args: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
    env: Mapping[str, str] = attrs.field(factory=dict, converter=env_map)
    python: str | None = None

    def _common_args(self) -> list[str]:
        """``--served-model-name`` and the keys."""
        names = ["--served-model-name", self.served_model_name] if self.served_model_name else []
        return names + key_args(self.api_key, self.admin_api_key)

    def _env(self, ctx: NodeContext, **more: str) -> dict[str, str | None]:
        return server_env(ctx, self.env, health_endpoint_generation=self.health_endpoint_generation, **more)

    def _ready(self, url: str) -> ReadyCheck:
        return ReadyCheck.http(url, headers=auth_headers(self.api_key), check_timeout=30.0)

    async def connect(self, entry_url: str | None, engines: Sequence[EngineInfo], **kwargs: Any) -> HttpFleetBackend:
        return await connect_engines(entry_url, engines, **kwargs)


@attrs.frozen(kw_only=True)
class SGLangServerCommand(NativeServerCommand):
    """``python -m sglang.launch_server`` for one engine (TP over the GPUs the launcher assigned).

    ``CUDA_VISIBLE_DEVICES`` is set to the context's ``gpu_ids`` (Ray's assignment), so
    ``--base-gpu-id`` stays 0. Defaults are the recipe proven on the H200 (``docs/gpu-tier.md``, "The GPU machine"):
    ``--attention-backend triton --sampling-backend pytorch --disable-cuda-graph --page-size 16``;
    ``None`` / ``False`` leaves a flag out (SGLang's default). ``extra_args`` are passed last, as they are.

    Ready once ``ready_path`` answers 200: ``/health_generate`` runs one forward pass (plain
    ``/health`` answers before the first one). Ports by role (``NodeContext.fixed``): ``http``, ``nccl``.
    """

    tp: int = 1
    page_size: int | None = 16
    attention_backend: str | None = "triton"
    sampling_backend: str | None = "pytorch"
    disable_cuda_graph: bool = True
    #: ``--mem-fraction-static`` (several engines sharing a GPU must split it).
    mem_fraction_static: float | None = None
    disable_radix_cache: bool = False
    enable_memory_saver: bool = False
    deterministic_inference: bool = False
    skip_tokenizer_init: bool = False
    random_seed: int | None = None
    weight_version: str | None = None
    #: Publish KV-cache events (``--kv-events-config``, ZMQ on a port of its own, role ``kv_events``):
    #: what a KV-aware router outside SGLang (Dynamo's) reads.
    kv_events: bool = False
    grace: float = 30.0
    ready_path: str = "/health_generate"

    def build(self, ctx: NodeContext) -> Launch:
        port = ctx.port("http")
        nccl = ctx.port("nccl")
        argv = [
            self.python or sys.executable, "-m", "sglang.launch_server",
            "--model-path", self.model_path,
            "--host", ctx.bind_host, "--port", str(port), "--nccl-port", str(nccl),
            "--tp-size", str(self.tp), "--base-gpu-id", "0",
        ]  # fmt: skip
        if self.page_size is not None:
            argv += ["--page-size", str(self.page_size)]
        if self.weight_version is not None:
            argv += ["--weight-version", self.weight_version]
        argv += self._common_args()
        if self.attention_backend:
            argv += ["--attention-backend", self.attention_backend]
        if self.sampling_backend:
            argv += ["--sampling-backend", self.sampling_backend]
        if self.disable_cuda_graph:
            argv.append("--disable-cuda-graph")
        if self.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.disable_radix_cache:
            argv.append("--disable-radix-cache")
        if self.enable_memory_saver:
            argv.append("--enable-memory-saver")
        if self.deterministic_inference:
            argv.append("--enable-deterministic-inference")
        if self.skip_tokenizer_init:
            argv.append("--skip-tokenizer-init")
        if self.random_seed is not None:
            argv += ["--random-seed", str(self.random_seed)]
        ports = [(ctx.bind_host, port), (ctx.bind_host, nccl)]
        extra: dict[str, Any] = {"nccl_port": nccl}
        if self.kv_events:
            kv = ctx.port("kv_events", any_interface=True)  # SGLang binds tcp://*
            argv += ["--kv-events-config", kv_events_config(kv)]
            extra["kv_events_port"] = kv
        url = ctx.url(port)
        spec = ProcessSpec(
            name=f"sglang-{ctx.index}",
            argv=[*argv, *self.extra_args],
            env=self._env(ctx),
            ready=self._ready(f"{url}{self.ready_path}"),
            ports=ports,
            grace=self.grace,
        )
        return Launch(spec=spec, generate_url=url, control_url=url, extra=extra)


@attrs.frozen(kw_only=True)
class ReferenceServerCommand(NativeServerCommand):
    """One reference server (SGLang-native HTTP API over a ``ReferenceEngine``) per engine.

    ``model_path`` must exist on the engine's node (shared storage), or pass ``make_model_seed``
    to have each server write the seeded tiny model there first (one path per node: two servers
    on one host must not share a path they both create). Port by role (``NodeContext.fixed``): ``http``.
    """

    weight_version: str = "default"
    page_size: int = 16
    num_threads: int = 1
    make_model_seed: int | None = None
    #: ``--no-compute N``: a ``NoComputeEngine`` (no model; N fixed tokens at once); ``model_path``
    #: is then only the name the server reports.
    no_compute: int | None = None
    grace: float = 5.0

    def build(self, ctx: NodeContext) -> Launch:
        port = ctx.port("http")
        url = ctx.url(port)
        argv = [
            self.python or sys.executable, "-m", "rollout_backends.adapters.reference.serve",
            "--model-path", self.model_path,
            "--host", ctx.bind_host, "--port", str(port),
            "--worker-id", f"{ctx.advertise_host}:{port}",
            "--weight-version", self.weight_version,
            "--page-size", str(self.page_size),
            "--num-threads", str(self.num_threads),
        ]  # fmt: skip
        if self.no_compute is not None:
            argv += ["--no-compute", str(self.no_compute)]
        if self.make_model_seed is not None:
            argv += ["--make-model", str(self.make_model_seed)]
        argv += self._common_args()
        spec = ProcessSpec(
            name=f"reference-{ctx.index}",
            argv=[*argv, *self.extra_args],
            env=self._env(ctx, OMP_NUM_THREADS=str(self.num_threads)),
            ready=self._ready(f"{url}/health"),
            ports=[(ctx.bind_host, port)],
            grace=self.grace,
        )
        return Launch(spec=spec, generate_url=url, control_url=url)


@attrs.frozen(kw_only=True)
class SmgRouter:
    """A router in front of the engines (``docs/sglang.md``, "smg 1.13.0, as observed"):
    ``python -m smg.launch_router``, or ``sglang_router.launch_router`` with ``router="sglang-router"``.

    ``register_workers``: pass the engines as ``--worker-urls`` (ready = smg ``/readiness``, i.e. it
    can route); False starts it without workers, to be given them through ``POST /workers`` (ready =
    smg ``/liveness``). ``None`` leaves a flag out. Ports by role: ``http``, ``prometheus``
    (``Launch.extra["prometheus_port"]``).
    """

    policy: str = "round_robin"
    router: str = "smg"
    register_workers: bool = True
    health_check_interval_s: int = 1
    health_failure_threshold: int | None = 1  #: smg only
    log_level: str | None = "warn"  #: smg only
    #: smg only: also write log files under ``<log_dir>/smg`` (the supervisor keeps its console log).
    file_logs: bool = True
    retries: bool = True  #: ``--disable-retries`` when False
    api_key: str | None = attrs.field(default=None, repr=False)
    extra_args: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
    python: str | None = None
    #: smg keeps its listener open ~5 s after SIGTERM (load-balancer settle window).
    grace: float = 8.0

    def __attrs_post_init__(self) -> None:
        if self.router not in ROUTER_MODULES:
            raise InvalidRequest("router", f"must be one of {tuple(ROUTER_MODULES)}, got {self.router!r}")

    def build(self, ctx: NodeContext, engines: Sequence[EngineInfo]) -> Launch:
        port = ctx.port("http")
        prom = ctx.port("prometheus")
        smg = self.router == "smg"
        argv = [
            self.python or sys.executable, "-m", ROUTER_MODULES[self.router],
            "--host", ctx.bind_host, "--port", str(port), "--policy", self.policy,
            "--prometheus-host", ctx.bind_host, "--prometheus-port", str(prom),
            "--health-check-interval-secs", str(self.health_check_interval_s),
        ]  # fmt: skip
        if smg:
            # No tokenizer is needed for token-id traffic; re-probe a registering worker every second.
            argv += ["--disable-tokenizer-autoload", "--worker-startup-check-interval", "1"]
            if self.file_logs:
                argv += ["--log-dir", f"{ctx.log_dir}/smg"]
            if self.log_level:
                argv += ["--log-level", self.log_level]
            if self.health_failure_threshold is not None:
                argv += ["--health-failure-threshold", str(self.health_failure_threshold)]
        workers = [e.generate_url for e in engines if e.generate_url]
        if self.register_workers and workers:
            argv += ["--worker-urls", *workers]
        if not self.retries:
            argv.append("--disable-retries")
        argv += key_args(self.api_key)
        url = ctx.url(port)
        route = ("/readiness" if self.register_workers and workers else "/liveness") if smg else "/health"
        spec = ProcessSpec(
            name="router",
            argv=[*argv, *self.extra_args],
            ready=ReadyCheck.http(f"{url}{route}", headers=auth_headers(self.api_key)),
            ports=[(ctx.bind_host, port), (ctx.bind_host, prom)],
            grace=self.grace,
        )
        return Launch(spec=spec, generate_url=url, control_url=url, extra={"prometheus_port": prom})

    @property
    def starts_with_engines(self) -> bool:
        """Without ``--worker-urls`` it needs no engine to start: it starts with them and is given
        them by :meth:`attach` (``POST /workers``)."""
        return not self.register_workers

    async def attach(self, entry_url: str, engines: Sequence[EngineInfo], *, timeout: float) -> None:
        """Register every engine (``POST /workers``, unless they were on its command line) and wait
        until the router lists each healthy."""
        urls = [e.generate_url for e in engines if e.generate_url]
        client = HttpClient(api_key=self.api_key, control_timeout=10.0)
        try:
            if not self.register_workers:
                for url in urls:
                    body = {"url": url, "worker_type": "regular"}
                    resp = await client.send(HttpRequest("POST", f"{entry_url}/workers", json=body, timeout=10.0))
                    if resp.status not in (200, 201, 202, 409):  # 409: already registered
                        raise BackendUnavailable(
                            f"router {entry_url}: POST /workers {url} answered HTTP {resp.status}: {resp.text[:300]}"
                        )
            deadline = time.monotonic() + timeout
            while True:
                state = await router_worker_state(client, entry_url)
                if all(state.get(u) == "healthy" for u in urls):
                    return
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.1)
            missing = {u: state.get(u, "not listed") for u in urls if state.get(u) != "healthy"}
            raise BackendUnavailable(
                f"router {entry_url} does not list every worker healthy after {timeout:.0f}s: {missing}"
            )
        finally:
            await client.aclose()

    async def connect(self, entry_url: str, engines: Sequence[EngineInfo], **kwargs: Any) -> HttpFleetBackend:
        known = ("round_robin", "random", "cache_aware")
        kwargs.setdefault("routing", self.policy if self.policy in known else "other")
        kwargs.setdefault("api_key", self.api_key)
        return await connect_engines(entry_url, engines, **kwargs)


async def router_worker_state(client: HttpClient, router_url: str) -> dict[str, str]:
    """Each worker a router lists (``GET /workers``, smg and sglang-router): URL -> ``healthy`` or its status."""
    try:
        resp = await client.send(HttpRequest("GET", f"{router_url}/workers", timeout=5.0, idempotent=True))
    except RolloutBackendError as exc:
        return {"<router>": str(exc)}
    if not resp.ok:
        return {}
    data = resp.json()
    entries = data.get("workers", []) if isinstance(data, dict) else data
    state: dict[str, str] = {}
    for e in entries if isinstance(entries, list) else []:
        url = e.get("url") if isinstance(e, dict) else e
        if not isinstance(url, str):
            continue
        healthy = e.get("is_healthy", True) if isinstance(e, dict) else True
        state[url.rstrip("/")] = "healthy" if healthy else str(e.get("status", "unhealthy"))
    return state
