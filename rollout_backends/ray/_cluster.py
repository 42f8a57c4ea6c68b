"""A local multi-node Ray cluster for tests and demos: ``ray start --block`` per node, under a Supervisor.

::

    async with Supervisor(log_dir) as sup:
        address = await start_local_cluster(sup, nodes=2, num_cpus=1)
        ray.init(address=address)

Every node is a separate ``ray start`` process tree (GCS, raylet, agents, workers) in its own
process group; stopping the supervisor stops them all. Each node gets a custom resource
``rb_node_<i>: 1`` so a placement can target one. The nodes are small: ``num_cpus`` CPUs, an
``object_store_mb`` object store, no dashboard, no usage stats.

Ray does not bind loopback only: it resolves ``127.0.0.1`` to the host's address and its GCS and
raylets listen on all interfaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

from rollout_backends import BackendUnavailable
from rollout_backends.launch import ProcessSpec, Supervisor, free_port

__all__ = ["node_resource", "start_local_cluster"]

_RAY_ENV: Mapping[str, str | None] = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}


def node_resource(index: int) -> str:
    """The custom resource naming node ``index`` of a local cluster."""
    return f"rb_node_{index}"


def _ray_start(extra: list[str], *, num_cpus: int, num_gpus: int, object_store_mb: int, index: int) -> list[str]:
    return [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
        "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus),
        "--object-store-memory", str(object_store_mb * 1024 * 1024),
        "--resources", json.dumps({node_resource(index): 1}),
        "--disable-usage-stats",
        *extra,
    ]  # fmt: skip


async def _port_open(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def start_local_cluster(
    sup: Supervisor,
    *,
    nodes: int = 2,
    num_cpus: int = 1,
    num_gpus: int = 0,
    object_store_mb: int = 80,
    timeout: float = 120.0,
    connect: bool = True,
    grace: float = 5.0,
    env: Mapping[str, str | None] | None = None,
) -> str:
    """Start a head and ``nodes - 1`` worker nodes on this host; return the GCS address ``ip:port``.

    All nodes start at once (workers retry the GCS until it is up). ``connect``: ``ray.init`` this
    process to the cluster and return when ``nodes`` nodes are alive (else return once the GCS
    port accepts connections). ``grace``: seconds a node gets to drain on stop before SIGKILL
    (Ray drains up to 30 s; its workers exit when their raylet goes). Raises ``BackendUnavailable``
    (with log tails) if a node exits or the timeout passes. ``env`` is added to every node's
    environment (``RAY_<config>`` variables reach the raylets).
    """
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    # Ray's own choice of this node's address (it refuses loopback); typed loosely on purpose.
    services: Any = importlib.import_module("ray._private.services")
    ip = str(services.get_node_ip_address())
    port = free_port(ip)
    address = f"{ip}:{port}"
    node_env = {**_RAY_ENV, **(env or {})}
    names = []
    head = _ray_start(
        ["--head", "--port", str(port), "--node-ip-address", ip, "--include-dashboard", "false"],
        num_cpus=num_cpus, num_gpus=num_gpus, object_store_mb=object_store_mb, index=0,
    )  # fmt: skip
    await sup.start(ProcessSpec(name="ray-head", argv=head, env=node_env, ports=[(ip, port)], grace=grace))
    names.append("ray-head")
    for i in range(1, nodes):
        argv = _ray_start(
            ["--address", address, "--node-ip-address", ip],
            num_cpus=num_cpus, num_gpus=num_gpus, object_store_mb=object_store_mb, index=i,
        )  # fmt: skip
        await sup.start(ProcessSpec(name=f"ray-node-{i}", argv=argv, env=node_env, grace=grace))
        names.append(f"ray-node-{i}")
    deadline = time.monotonic() + timeout

    def check_alive() -> None:
        for n in names:
            if not sup.alive(n):
                raise BackendUnavailable(f"{n} exited during start-up; last lines:\n{sup.log_tail(n)}", worker=n)
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {n}:\n{sup.log_tail(n)}" for n in names)
            raise BackendUnavailable(f"local Ray cluster not up after {timeout:.0f}s\n{tails}")

    while not await _port_open(ip, port):
        check_alive()
        await asyncio.sleep(0.2)
    if not connect:
        return address
    ray: Any = importlib.import_module("ray")
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    while sum(1 for n in ray.nodes() if n["Alive"]) < nodes:
        check_alive()
        await asyncio.sleep(0.3)
    return address
