"""``RayFleet``: a fleet's engines placed on a Ray cluster, one ``EngineActor`` per engine.

::

    ray.init(address="auto")
    spec = RayFleetSpec(
        engine=SGLangServerCommand(model_path="/shared/Qwen3-0.6B", tp=2),
        num_engines=4, gpus_per_engine=2, cpus_per_engine=4,
        entry=SmgRouter(policy="cache_aware"),
    )
    async with await RayFleet.launch(spec) as fleet:
        backend = await fleet.connect()          # closed with the fleet
        ...
        fleet.actors[0]                          # the engine's actor handle

Placement: one placement-group bundle per engine (``{"CPU": cpus, "GPU": gpus, **resources}``)
with ``strategy`` (``PACK``, ``SPREAD``, ``STRICT_SPREAD``...); the engine's actor takes its whole
bundle, so Ray's GPU assignment is the engine's ``CUDA_VISIBLE_DEVICES``. A framework that owns a
placement group (Miles) passes it with ``placement_group`` and ``bundle_indices``.

The entry (router / frontend) runs in this process's node under this process's ``Supervisor``.
Tear-down (``aclose``): backends, then the entry, then each actor's ``stop`` (SIGTERM, grace),
then ``ray.kill`` of every actor, then the placement group (only if the fleet made it).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs

from rollout_backends import BackendUnavailable, InvalidRequest, Unsupported
from rollout_backends.kit import HttpFleetBackend
from rollout_backends.launch import EngineCommand, EngineInfo, EntryCommand, NodeContext, Supervisor

from ._actor import EngineActor

__all__ = ["RayFleet", "RayFleetSpec"]

_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _resources(value: Mapping[str, float] | None) -> Mapping[str, float]:
    return {str(k): float(v) for k, v in (value or {}).items()}


def _indices(value: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(i) for i in value)


@attrs.frozen(kw_only=True)
class RayFleetSpec:
    """What to place and launch."""

    engine: EngineCommand
    num_engines: int
    cpus_per_engine: float = 1.0
    gpus_per_engine: float = 0.0
    #: Extra custom resources per bundle (e.g. ``{"node:10.0.0.5": 0.01}`` to pin a node).
    resources: Mapping[str, float] = attrs.field(factory=dict, converter=_resources)
    strategy: str = "PACK"
    #: The fleet's generation entry (router / Dynamo frontend), started on this node after the engines.
    entry: EntryCommand | None = None
    #: Address engines (and the entry) bind; ``None`` = each node's IP. Tests on one host: ``127.0.0.1``.
    bind_host: str | None = None
    ready_timeout: float = 600.0
    #: Seconds to wait for the placement group's resources.
    placement_timeout: float = 120.0
    #: Log directory on every node (``<log_dir>/engine-<i>``); default a temporary directory per node.
    log_dir: str | None = None
    #: An existing placement group to use instead of creating one (not removed on close).
    placement_group: Any = None
    bundle_indices: tuple[int, ...] | None = attrs.field(default=None, converter=_indices)
    #: Ray actor name prefix (``<prefix>-<i>``); ``None`` = anonymous actors.
    actor_name_prefix: str | None = None
    namespace: str | None = None  #: Ray namespace of named actors

    def __attrs_post_init__(self) -> None:
        if isinstance(self.num_engines, bool) or not isinstance(self.num_engines, int) or self.num_engines < 1:
            raise InvalidRequest("num_engines", f"must be an int >= 1, got {self.num_engines!r}")
        if self.cpus_per_engine < 0 or self.gpus_per_engine < 0:
            raise InvalidRequest("cpus_per_engine", "resources per engine must be >= 0")
        if self.strategy not in _STRATEGIES:
            raise InvalidRequest("strategy", f"must be one of {_STRATEGIES}, got {self.strategy!r}")
        if self.bundle_indices is not None:
            if self.placement_group is None:
                raise InvalidRequest("bundle_indices", "only with placement_group")
            if len(self.bundle_indices) != self.num_engines:
                raise InvalidRequest("bundle_indices", f"one index per engine ({self.num_engines})")

    def bundle(self) -> dict[str, float]:
        b: dict[str, float] = {"CPU": self.cpus_per_engine}
        if self.gpus_per_engine:
            b["GPU"] = self.gpus_per_engine
        b.update(self.resources)
        return b


def _require_ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - the subpackage import already checks
        raise Unsupported("ray", "pip install 'rollout-backends[ray]'") from exc
    if not ray.is_initialized():
        raise BackendUnavailable("Ray is not initialised: call ray.init(address=...) before RayFleet.launch")
    return ray


class RayFleet:
    """A launched fleet: engine infos, actor handles, the entry URL, and ``connect()``."""

    def __init__(
        self,
        spec: RayFleetSpec,
        *,
        actors: Sequence[Any],
        engines: Sequence[EngineInfo],
        placement_group: Any,
        owns_placement_group: bool,
        supervisor: Supervisor,
        entry_url: str | None,
    ) -> None:
        self.spec = spec
        self.actors: tuple[Any, ...] = tuple(actors)
        self.engines: tuple[EngineInfo, ...] = tuple(engines)
        self.placement_group = placement_group
        self._owns_pg = owns_placement_group
        self.supervisor = supervisor
        self.entry_url = entry_url
        self._backends: list[HttpFleetBackend] = []
        self._closed = False

    # -- launch ---------------------------------------------------------------------------------

    @classmethod
    async def launch(cls, spec: RayFleetSpec) -> RayFleet:
        """Reserve the bundles, start one actor per engine, wait for every engine, start the entry.

        On any failure everything started so far is stopped and the error is raised
        (``BackendUnavailable`` with the engine's log tail for a process that did not come up).
        """
        ray = _require_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        owns_pg = spec.placement_group is None
        pg = spec.placement_group
        if pg is None:
            pg = placement_group(
                [spec.bundle() for _ in range(spec.num_engines)],
                strategy=spec.strategy,
                name=f"rollout-fleet-{uuid.uuid4().hex[:8]}",
            )
        bundles = spec.bundle_indices if spec.bundle_indices is not None else tuple(range(spec.num_engines))
        actors: list[Any] = []
        sup = Supervisor(Path(spec.log_dir) / "entry" if spec.log_dir else tempfile.mkdtemp(prefix="rollout-entry-"))
        try:
            try:
                await asyncio.wait_for(pg.ready(), spec.placement_timeout)
            except asyncio.TimeoutError:
                raise BackendUnavailable(
                    f"placement group of {spec.num_engines} x {spec.bundle()} ({spec.strategy}) not placed within "
                    f"{spec.placement_timeout:.0f}s; cluster resources: {ray.available_resources()}"
                ) from None
            remote_cls = ray.remote(EngineActor)
            bundle = spec.bundle()
            extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
            for i, b in enumerate(bundles):
                options: dict[str, Any] = {
                    "num_cpus": spec.cpus_per_engine,
                    "num_gpus": spec.gpus_per_engine,
                    "resources": extra,
                    "max_restarts": 0,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=b
                    ),
                }
                if spec.actor_name_prefix:
                    options["name"] = f"{spec.actor_name_prefix}-{i}"
                    if spec.namespace:
                        options["namespace"] = spec.namespace
                log_dir = f"{spec.log_dir}/engine-{i}" if spec.log_dir else None
                actors.append(
                    remote_cls.options(**options).remote(
                        spec.engine, i, bind_host=spec.bind_host, log_dir=log_dir, ready_timeout=spec.ready_timeout
                    )
                )
            engines: list[EngineInfo] = list(await asyncio.gather(*(a.start.remote() for a in actors)))
            entry_url = None
            if spec.entry is not None:
                entry_url = await _start_entry(spec, sup, engines, ray)
        except BaseException:
            await _teardown(actors, sup, pg if owns_pg else None, remove_placement_group, ray)
            raise
        return cls(
            spec,
            actors=actors,
            engines=engines,
            placement_group=pg,
            owns_placement_group=owns_pg,
            supervisor=sup,
            entry_url=entry_url,
        )

    # -- use ------------------------------------------------------------------------------------

    @property
    def generate_url(self) -> str | None:
        """Where unpinned generation goes: the entry, or engine 0 when there is none."""
        return self.entry_url or self.engines[0].generate_url

    @property
    def control_urls(self) -> tuple[str, ...]:
        return tuple(e.control_url for e in self.engines)

    async def connect(self, **kwargs: Any) -> HttpFleetBackend:
        """The ``RolloutBackend`` over this fleet (the entry's, or the engine command's ``connect``)."""
        target: Any = self.spec.entry if self.spec.entry is not None else self.spec.engine
        connect = getattr(target, "connect", None)
        if connect is None:
            raise Unsupported("connect", f"{type(target).__name__} cannot build a backend; use generate_url/engines")
        backend: HttpFleetBackend = await connect(self.entry_url, self.engines, **kwargs)
        self._backends.append(backend)
        return backend

    async def engine_alive(self, index: int, timeout: float = 10.0) -> bool:
        """Whether engine ``index``'s actor answers and its process runs (False if the actor is dead)."""
        ray = _require_ray()
        try:
            return bool(await asyncio.wait_for(self.actors[index].alive.remote(), timeout))
        except (ray.exceptions.RayActorError, asyncio.TimeoutError):
            return False

    def kill_engine(self, index: int) -> None:
        """``ray.kill`` engine ``index``'s actor (no restart): its process dies with it."""
        ray = _require_ray()
        ray.kill(self.actors[index], no_restart=True)

    # -- close ----------------------------------------------------------------------------------

    async def aclose(self, *, grace: float | None = None) -> None:
        """Close backends, stop the entry, stop every engine (gracefully), kill the actors. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for b in self._backends:
            with contextlib.suppress(Exception):
                await b.aclose()
        ray = _require_ray()
        from ray.util.placement_group import remove_placement_group

        await _teardown(
            self.actors, self.supervisor, self.placement_group if self._owns_pg else None, remove_placement_group, ray,
            grace=grace,
        )  # fmt: skip

    async def __aenter__(self) -> RayFleet:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


async def _start_entry(spec: RayFleetSpec, sup: Supervisor, engines: Sequence[EngineInfo], ray: Any) -> str:
    assert spec.entry is not None
    node_ip = str(ray.util.get_node_ip_address())
    bind = spec.bind_host or node_ip
    node_id = str(ray.get_runtime_context().get_node_id())
    ctx = NodeContext.on(-1, bind, str(sup.log_dir), node_ip=node_ip, node_id=node_id)
    launch = spec.entry.build(ctx, engines)
    await sup.start(launch.spec)
    await sup.wait_ready([launch.spec.name], timeout=spec.ready_timeout)
    url = launch.generate_url or launch.control_url
    return url


async def _teardown(
    actors: Sequence[Any],
    sup: Supervisor,
    pg: Any,
    remove_placement_group: Any,
    ray: Any,
    *,
    grace: float | None = None,
    stop_timeout: float = 60.0,
) -> None:
    errors: list[BaseException] = []
    try:
        await sup.aclose(grace=grace)
    except Exception as exc:  # keep going: the engines must still be stopped
        errors.append(exc)
    if actors:
        # Graceful stop first (the engine gets SIGTERM and its grace); dead actors raise: ignore.
        results = await asyncio.gather(
            *(asyncio.wait_for(_ref(a.stop.remote(grace)), stop_timeout) for a in actors), return_exceptions=True
        )
        del results
        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
    if pg is not None:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
    if errors:
        raise errors[0]


async def _ref(ref: Any) -> Any:
    return await ref
