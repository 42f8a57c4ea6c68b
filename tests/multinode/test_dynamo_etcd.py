"""Dynamo across nodes: etcd discovery + NATS event plane, mocker workers placed by Ray on two nodes."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from mnhelpers import pid_alive, require, wait_until

from rollout_backends import GenerateRequest, SamplingParams
from rollout_backends.adapters.dynamo._commands import DynamoFrontend, DynamoWorkerCommand, generate_instances
from rollout_backends.adapters.dynamo._services import EtcdNats

pytestmark = pytest.mark.slow

LEASE_TTL = 3  # seconds a SIGKILLed worker stays registered


async def _get(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
        return await r.json(content_type=None)


async def test_etcd_nats_start_and_stop(tmp_path: Path, spawned: set[int]) -> None:
    """The services come up on loopback, answer, and leave no process or data behind."""
    services = await EtcdNats.start(log_dir=tmp_path / "logs")
    try:
        assert services.supervisor is not None and set(services.started) == {"etcd", "nats"}
        pids = [services.supervisor.process(n).pid for n in services.started]
        spawned.update(pids)
        assert services.etcd_endpoints[0].startswith("http://127.0.0.1:")
        assert services.nats_url is not None and services.nats_url.startswith("nats://127.0.0.1:")
        assert await services.keys() == []
        health = await _get(f"{services.etcd_endpoints[0]}/health")
        assert health["health"] == "true"
        planes = services.planes(lease_ttl=LEASE_TTL)
        assert (planes.discovery, planes.event_plane, planes.nats_url) == ("etcd", "nats", services.nats_url)
        env = planes.env("127.0.0.1")
        assert env["ETCD_ENDPOINTS"] == services.etcd_endpoints[0] and env["ETCD_LEASE_TTL"] == "3"
        data_dir = services._data_dir
        assert data_dir is not None and data_dir.exists()
    finally:
        await services.aclose()
    assert not any(pid_alive(p) for p in pids)
    assert not data_dir.exists()

    # Given endpoints: nothing is started, nothing stopped.
    given = await EtcdNats.start(etcd_endpoints="http://10.0.0.2:2379/", nats_url="nats://10.0.0.2:4222")
    assert given.started == () and given.supervisor is None
    assert given.etcd_endpoints == ("http://10.0.0.2:2379",)
    await given.aclose()


async def test_dynamo_mockers_on_two_nodes(
    ray_cluster: str, tiny_model: Path, tmp_path: Path, spawned: set[int]
) -> None:
    require("ray")
    from rollout_backends.ray import RayFleet, RayFleetSpec

    async with await EtcdNats.start(log_dir=tmp_path / "services") as services:
        assert services.supervisor is not None
        spawned.update(services.supervisor.pids().values())
        planes = services.planes(event_plane="nats", lease_ttl=LEASE_TTL)
        ns = f"mn{uuid.uuid4().hex[:8]}"
        spec = RayFleetSpec(
            engine=DynamoWorkerCommand(
                kind="mocker", model_path=str(tiny_model), namespace=ns, planes=planes, mocker_speedup_ratio=100
            ),
            num_engines=2,
            strategy="STRICT_SPREAD",
            entry=DynamoFrontend(namespace=ns, planes=planes, router_mode="round-robin"),
            bind_host="127.0.0.1",
            log_dir=str(tmp_path / "logs"),
            ready_timeout=90,
        )
        t0 = time.monotonic()
        fleet = await RayFleet.launch(spec)
        print(f"\ndynamo fleet up in {time.monotonic() - t0:.1f}s")
        try:
            assert len({e.node_id for e in fleet.engines}) == 2
            engine_pids = [await a.pids.remote() for a in fleet.actors]
            spawned.update(p for g in engine_pids for p in g)
            spawned.update(fleet.supervisor.pids().values())

            # Both workers registered in etcd (each from its own node) and the frontend sees both.
            def instance_keys(keys: list[str]) -> list[str]:
                return [k for k in keys if k.startswith(f"v1/instances/{ns}/backend/generate/")]

            assert len(instance_keys(await services.keys())) == 2
            assert fleet.entry_url is not None
            health = await _get(f"{fleet.entry_url}/health")
            seen = generate_instances(health, ns)
            ports = sorted(int(i["transport"]["tcp"].split("/")[0].rsplit(":", 1)[1]) for i in seen)
            assert ports == sorted(int(e.extra["rpc_port"]) for e in fleet.engines)

            # The backend generates through the frontend; round-robin reaches both workers.
            backend = await fleet.connect(flavor="mocker")
            assert sorted(backend.workers) == sorted(e.control_url.split("://", 1)[1] for e in fleet.engines)
            assert all(backend.worker(w).instance_id is not None for w in backend.workers)
            req = GenerateRequest(input_ids=(5, 6, 7, 8), sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))
            gens = [await backend.generate(req) for _ in range(4)]
            assert all(len(g.output_ids) == 3 for g in gens)
            assert len({g.worker for g in gens}) == 2, [g.worker for g in gens]

            # Killing engine 0's actor: its worker dies, and its registration goes with its lease.
            fleet.kill_engine(0)
            assert await wait_until(lambda: not any(pid_alive(p) for p in engine_pids[0]), 20)

            async def one_left() -> bool:
                return len(instance_keys(await services.keys())) == 1

            assert await wait_until(one_left, LEASE_TTL + 10), await services.keys()

            async def frontend_sees_one() -> bool:
                return len(generate_instances(await _get(f"{fleet.entry_url}/health"), ns)) == 1

            assert await wait_until(frontend_sees_one, 10)
            after = await backend.generate(req)
            assert len(after.output_ids) == 3
        finally:
            await fleet.aclose()

        # Tear-down: the workers unregistered (or their leases ran out): etcd holds no key.
        async def empty() -> bool:
            return await services.keys() == []

        assert await wait_until(empty, LEASE_TTL + 10), await services.keys()
        assert not any(pid_alive(p) for g in engine_pids for p in g)
        assert not fleet.supervisor.pids()


async def test_single_host_launcher_starts_etcd(tiny_model: Path, tmp_path: Path, spawned: set[int]) -> None:
    """``DynamoFleet(discovery="etcd", start_etcd=True)``: etcd (and NATS for a nats plane) come and go
    with the fleet, and the workers discover through it."""
    from rollout_backends.adapters.dynamo import DynamoFleet, launch_dynamo_fleet

    cfg = DynamoFleet(
        model_path=str(tiny_model), workers=2, worker_kind="mocker", discovery="etcd", start_etcd=True,
        event_plane="nats", ready_timeout=60,
    )  # fmt: skip
    async with launch_dynamo_fleet(cfg, log_dir=tmp_path / "logs") as fleet:
        sup = fleet.supervisor
        assert {"etcd", "nats"} <= set(sup.names)
        spawned.update(sup.pids().values())
        etcd_url = fleet.config.etcd_endpoints[0]
        assert fleet.config.nats_server is not None and fleet.config.nats_server.startswith("nats://127.0.0.1:")
        given = await EtcdNats.start(etcd_endpoints=[etcd_url], nats=False)
        keys = await given.keys(f"v1/instances/{fleet.namespace}/backend/generate/")
        assert len(keys) == 2
        backend = await fleet.connect()
        gen = await backend.generate(GenerateRequest(input_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=2)))
        assert len(gen.output_ids) == 2
        pids = list(sup.pids().values())
    assert not any(pid_alive(p) for p in pids)
