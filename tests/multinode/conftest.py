"""Fixtures for the multi-node tests: a local two-node Ray cluster and a tiny model, once per session.

The cluster is two ``ray start --block`` process trees (head + one worker node, one CPU each)
under a ``Supervisor``; every pid a test learns about (engine servers, actor workers) is recorded
in ``spawned`` and must be gone when the session ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mnhelpers import pid_alive, require

from rollout_backends._supervisor import Supervisor


@pytest.fixture(scope="session")
def spawned() -> Iterator[set[int]]:
    """Pids the tests saw; each must be gone at the end of the session."""
    pids: set[int] = set()
    yield pids
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = sorted(p for p in pids if pid_alive(p))
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout_backends.adapters.reference import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("mn-model") / "tiny", seed=0))


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory, spawned: set[int]) -> Iterator[str]:
    """A two-node local Ray cluster (head + worker node), this process connected as the driver."""
    ray = require("ray")
    from rollout_backends.ray import start_local_cluster

    loop = asyncio.new_event_loop()
    sup = Supervisor(tmp_path_factory.mktemp("ray-logs"), grace=5.0)
    try:
        t0 = time.monotonic()
        # Ray's own clean-up of a dead worker's children is turned off, so the tests see ours
        # (the supervisor's PDEATHSIG and watchdog) at work when an actor dies.
        no_ray_cleanup = {"RAY_kill_child_processes_on_worker_exit": "0", "RAY_process_group_cleanup_enabled": "0"}
        address = loop.run_until_complete(start_local_cluster(sup, nodes=2, num_cpus=1, timeout=90, env=no_ray_cleanup))
        print(f"\nlocal Ray cluster up in {time.monotonic() - t0:.1f}s at {address}")
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        groups = {n: sup.process(n).pgid for n in sup.names}
        loop.run_until_complete(sup.aclose())
        loop.close()
        from rollout_backends._supervisor import group_members

        assert not any(group_members(g) for g in groups.values()), "a Ray node's process group survived"
