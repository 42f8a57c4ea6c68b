"""Ray placement: a fleet's engines on a Ray cluster, one ``EngineActor`` per engine.

``Ray(...)`` is a placement for :func:`rollout_backends.launch.launch_fleet`, like ``Local()``::

    fleet = await launch_fleet(SGLangServerCommand(model_path=...), 4, SmgRouter(), Ray(gpus_per_engine=2))

``RunningRayFleet.launch(config)`` does the same from one ``RayFleetConfig`` and hands out the actors::

    ray.init(address="auto")
    spec = RayFleetConfig(
        engine=SGLangServerCommand(model_path="/shared/Qwen3-0.6B", tp=2),
        num_engines=4, gpus_per_engine=2, cpus_per_engine=4,
        entry=SmgRouter(policy="cache_aware"),
    )
    async with await RunningRayFleet.launch(spec) as fleet:
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
(``RayFleet`` and ``RayFleetSpec``, the names docs and examples use, are the same classes.)
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs

from rollout_backends import BackendUnavailable, InvalidRequest, Unsupported
from rollout_backends.kit import HttpFleetBackend
from rollout_backends.launch import (
    EngineCommand,
    EngineInfo,
    EntryCommand,
    NodeContext,
    ReadyProgress,
    RunningFleet,
    Supervisor,
    launch_fleet,
)

from ._actor import EngineActor

__all__ = ["Ray", "RayEngines", "RayFleet", "RayFleetConfig", "RayFleetSpec", "RunningRayFleet"]

_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _resources(value: Mapping[str, float] | None) -> Mapping[str, float]:
    return {str(k): float(v) for k, v in (value or {}).items()}


def _indices(value: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(i) for i in value)


@attrs.frozen(kw_only=True)
class Ray:
    """A placement (``rollout_backends.launch.Placement``): one placement-group bundle and one
    ``EngineActor`` per engine; the actor builds and starts its engine on its node and waits
    until it is ready. ``ray.init`` must have been called."""

    cpus_per_engine: float = 1.0
    gpus_per_engine: float = 0.0
    #: Extra custom resources per bundle (e.g. ``{"node:10.0.0.5": 0.01}`` to pin a node).
    resources: Mapping[str, float] = attrs.field(factory=dict, converter=_resources)
    strategy: str = "PACK"
    #: Address engines (and the entry) bind; ``None`` = each node's IP. Tests on one host: ``127.0.0.1``.
    bind_host: str | None = None
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
        if self.cpus_per_engine < 0 or self.gpus_per_engine < 0:
            raise InvalidRequest("cpus_per_engine", "resources per engine must be >= 0")
        if self.strategy not in _STRATEGIES:
            raise InvalidRequest("strategy", f"must be one of {_STRATEGIES}, got {self.strategy!r}")
        if self.bundle_indices is not None and self.placement_group is None:
            raise InvalidRequest("bundle_indices", "only with placement_group")

    def bundle(self) -> dict[str, float]:
        b: dict[str, float] = {"CPU": self.cpus_per_engine}
        if self.gpus_per_engine:
            b["GPU"] = self.gpus_per_engine
        b.update(self.resources)
        return b

    async def place(
        self,
        commands: Sequence[EngineCommand],
        supervisor: Supervisor,
        *,
        ready_timeout: float,
        progress: Callable[[ReadyProgress], None] | None = None,
    ) -> RayEngines:
        """Reserve the bundles, start one actor per engine, wait until every engine is ready.

        On any failure what started is stopped and the error is raised (``BackendUnavailable``
        with the engine's log tail for a process that did not come up).
        """
        ray = _require_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = len(commands)
        if self.bundle_indices is not None and len(self.bundle_indices) != n:
            raise InvalidRequest("bundle_indices", f"one index per engine ({n})")
        owns_pg = self.placement_group is None
        pg = self.placement_group
        if pg is None:
            pg = placement_group(
                [self.bundle() for _ in range(n)], strategy=self.strategy, name=f"rollout-fleet-{uuid.uuid4().hex[:8]}"
            )
        placed = RayEngines(placement=self, placement_group=pg, owns_placement_group=owns_pg)
        bundles = self.bundle_indices if self.bundle_indices is not None else tuple(range(n))
        try:
            try:
                await asyncio.wait_for(pg.ready(), self.placement_timeout)
            except asyncio.TimeoutError:
                raise BackendUnavailable(
                    f"placement group of {n} x {self.bundle()} ({self.strategy}) not placed within "
                    f"{self.placement_timeout:.0f}s; cluster resources: {ray.available_resources()}"
                ) from None
            remote_cls = ray.remote(EngineActor)
            extra = {k: v for k, v in self.bundle().items() if k not in ("CPU", "GPU")}
            for i, (command, b) in enumerate(zip(commands, bundles, strict=True)):
                options: dict[str, Any] = {
                    "num_cpus": self.cpus_per_engine,
                    "num_gpus": self.gpus_per_engine,
                    "resources": extra,
                    "max_restarts": 0,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=b
                    ),
                }
                if self.actor_name_prefix:
                    options["name"] = f"{self.actor_name_prefix}-{i}"
                    if self.namespace:
                        options["namespace"] = self.namespace
                log_dir = f"{self.log_dir}/engine-{i}" if self.log_dir else None
                placed.actors.append(
                    remote_cls.options(**options).remote(
                        command, i, bind_host=self.bind_host, log_dir=log_dir, ready_timeout=ready_timeout
                    )
                )
            placed.engines.extend(await asyncio.gather(*(a.start.remote() for a in placed.actors)))
        except BaseException:
            await placed.aclose()
            raise
        return placed


@attrs.define(kw_only=True, eq=False)
class RayEngines:
    """Engines :class:`Ray` placed: their infos, actor handles and placement group."""

    placement: Ray
    placement_group: Any
    owns_placement_group: bool
    actors: list[Any] = attrs.field(factory=list)
    engines: list[EngineInfo] = attrs.field(factory=list)
    #: Ray's actors waited for their engines: nothing is pending in the launcher's supervisor.
    pending: tuple[str, ...] = ()
    _closed: bool = False

    def entry_node(self, log_dir: str, fixed: Mapping[str, int] | None = None) -> NodeContext:
        ray = _require_ray()
        node_ip = str(ray.util.get_node_ip_address())
        bind = self.placement.bind_host or node_ip
        node_id = str(ray.get_runtime_context().get_node_id())
        return NodeContext.on(-1, bind, log_dir, node_ip=node_ip, node_id=node_id, fixed=fixed)

    async def aclose(self, *, grace: float | None = None, stop_timeout: float = 60.0) -> None:
        """Each actor's ``stop`` (SIGTERM, grace; dead actors are ignored), ``ray.kill`` of every
        actor, then the placement group if it was made here. Idempotent."""
        if self._closed:
            return
        self._closed = True
        ray = _require_ray()
        from ray.util.placement_group import remove_placement_group

        if self.actors:
            await asyncio.gather(
                *(asyncio.wait_for(_ref(a.stop.remote(grace)), stop_timeout) for a in self.actors),
                return_exceptions=True,
            )
            for a in self.actors:
                with contextlib.suppress(Exception):
                    ray.kill(a, no_restart=True)
        if self.owns_placement_group:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)


@attrs.frozen(kw_only=True)
class RayFleetConfig:
    """What to place and launch: the engine command, how many, the entry, and the :class:`Ray`
    placement's fields."""

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
        placement = self.placement()  # its own checks
        if self.bundle_indices is not None and len(self.bundle_indices) != self.num_engines:
            raise InvalidRequest("bundle_indices", f"one index per engine ({self.num_engines})")
        del placement

    def placement(self) -> Ray:
        """The :class:`Ray` placement of these fields."""
        names = [a.name for a in attrs.fields(Ray)]
        return Ray(**{n: getattr(self, n) for n in names})

    def bundle(self) -> dict[str, float]:
        return self.placement().bundle()


def _require_ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - the subpackage import already checks
        raise Unsupported("ray", "pip install 'rollout-backends[ray]'") from exc
    if not ray.is_initialized():
        raise BackendUnavailable("Ray is not initialised: call ray.init(address=...) before launching on Ray")
    return ray


class RunningRayFleet:
    """A launched fleet: engine infos, actor handles, the entry URL, and ``connect()``."""

    def __init__(self, spec: RayFleetConfig, fleet: RunningFleet) -> None:
        placed = fleet.placed
        if not isinstance(placed, RayEngines):
            raise InvalidRequest("fleet", "a RunningRayFleet is a fleet placed by Ray(...)")
        self.spec = spec
        self.fleet = fleet
        self._placed = placed

    # -- launch ---------------------------------------------------------------------------------

    @classmethod
    async def launch(cls, spec: RayFleetConfig) -> RunningRayFleet:
        """Reserve the bundles, start one actor per engine, wait for every engine, start the entry
        (:func:`rollout_backends.launch.launch_fleet` with :meth:`RayFleetConfig.placement`).

        On any failure everything started so far is stopped and the error is raised
        (``BackendUnavailable`` with the engine's log tail for a process that did not come up).
        """
        _require_ray()
        log_dir = str(Path(spec.log_dir) / "entry") if spec.log_dir else tempfile.mkdtemp(prefix="rollout-entry-")
        placement = spec.placement()
        fleet = await launch_fleet(
            spec.engine, spec.num_engines, spec.entry, placement, log_dir=log_dir, ready_timeout=spec.ready_timeout
        )
        return cls(spec, fleet)

    # -- use ------------------------------------------------------------------------------------

    @property
    def actors(self) -> tuple[Any, ...]:
        return tuple(self._placed.actors)

    @property
    def engines(self) -> tuple[EngineInfo, ...]:
        return self.fleet.engines

    @property
    def placement_group(self) -> Any:
        return self._placed.placement_group

    @property
    def supervisor(self) -> Supervisor:
        """The supervisor of the entry (on this node)."""
        return self.fleet.supervisor

    @property
    def entry_url(self) -> str | None:
        return self.fleet.entry_url

    @property
    def generate_url(self) -> str | None:
        """Where unpinned generation goes: the entry, or engine 0 when there is none."""
        return self.fleet.generate_url

    @property
    def control_urls(self) -> tuple[str, ...]:
        return tuple(e.control_url for e in self.engines)

    async def connect(self, **kwargs: Any) -> HttpFleetBackend:
        """The ``RolloutBackend`` over this fleet (the entry's, or the engine command's ``connect``)."""
        return await self.fleet.connect(**kwargs)

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
        await self.fleet.aclose(grace=grace)

    async def __aenter__(self) -> RunningRayFleet:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


#: The names docs, examples and tests use (before every engine's were ``<X>FleetConfig`` / ``Running<X>Fleet``).
RayFleetSpec = RayFleetConfig
RayFleet = RunningRayFleet


async def _ref(ref: Any) -> Any:
    return await ref
