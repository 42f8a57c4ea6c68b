"""Ray placement for fleets: one ``EngineActor`` per engine, one placement-group bundle each.

    pip install 'rollout-backends[ray]'

* :class:`Ray`: the placement ``rollout_backends.launch.launch_fleet`` takes to put engines on Ray.
* :class:`RayFleetConfig` / :class:`RunningRayFleet` (also named ``RayFleetSpec`` / ``RayFleet``):
  place and launch a fleet, hand out the backend and the per-engine actor handles (``docs/multinode.md``).
* :class:`EngineActor`: the actor class (use ``ray.remote(EngineActor)`` to place it yourself).
* :func:`start_local_cluster`: a multi-node Ray cluster on one host (tests, demos).

This is the only part of the package that imports Ray.
"""

from __future__ import annotations

try:
    import ray as _ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("rollout_backends.ray needs Ray: pip install 'rollout-backends[ray]' (or 'ray>=2.30')") from exc

from rollout_backends.launch import EngineCommand, EngineInfo, EntryCommand, Launch, NodeContext

from ._actor import EngineActor
from ._cluster import node_resource, start_local_cluster
from ._fleet import Ray, RayEngines, RayFleet, RayFleetConfig, RayFleetSpec, RunningRayFleet

__all__ = [
    "EngineActor",
    "EngineCommand",
    "EngineInfo",
    "EntryCommand",
    "Launch",
    "NodeContext",
    "Ray",
    "RayEngines",
    "RayFleet",
    "RayFleetConfig",
    "RayFleetSpec",
    "RunningRayFleet",
    "node_resource",
    "start_local_cluster",
]
