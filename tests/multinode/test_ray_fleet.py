"""A Ray fleet over two nodes: placement, generation through the router, actor death, tear-down."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mnhelpers import pid_alive, require, wait_until

from rollout_backends import GenerateRequest, SamplingParams
from rollout_backends.adapters.reference import ReferenceServerCommand
from rollout_backends.adapters.sglang import SmgRouter

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


async def test_reference_fleet_on_two_nodes(
    ray_cluster: str, tiny_model: Path, tmp_path: Path, spawned: set[int]
) -> None:
    ray = require("ray")
    from rollout_backends.ray import RayFleet, RayFleetSpec

    spec = RayFleetSpec(
        engine=ReferenceServerCommand(model_path=str(tiny_model)),
        num_engines=2,
        cpus_per_engine=1,
        strategy="STRICT_SPREAD",  # one bundle per node
        entry=SmgRouter(policy="round_robin"),
        bind_host="127.0.0.1",
        log_dir=str(tmp_path / "logs"),
        ready_timeout=120,
    )
    t0 = time.monotonic()
    fleet = await RayFleet.launch(spec)
    print(f"\nreference fleet up in {time.monotonic() - t0:.1f}s")
    try:
        # Placement: one engine per node, each engine's actor on the node its bundle is on.
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len({e.node_id for e in fleet.engines}) == 2
        assert {e.node_id for e in fleet.engines} <= nodes
        table = ray.util.placement_group_table(fleet.placement_group)
        assert table["strategy"] == "STRICT_SPREAD" and len(table["bundles"]) == 2
        assert sorted(table["bundles_to_node_id"].values()) == sorted(e.node_id for e in fleet.engines)

        # Each engine's process runs, under its actor (a different process than the server).
        engine_pids = [await a.pids.remote() for a in fleet.actors]
        actor_pids = [await a.actor_pid.remote() for a in fleet.actors]
        spawned.update(p for group in engine_pids for p in group)
        spawned.update(actor_pids)
        assert all(engine_pids) and all(pid_alive(p) for g in engine_pids for p in g)
        assert [e.pid for e in fleet.engines] == [g[0] for g in engine_pids]
        assert not set(actor_pids) & {p for g in engine_pids for p in g}

        backend = await fleet.connect()
        assert fleet.entry_url is not None and fleet.generate_url == fleet.entry_url
        w0, w1 = backend.workers
        assert [f"http://{w}" for w in (w0, w1)] == [e.generate_url for e in fleet.engines]

        # Control calls reach each engine (fan-out across nodes): tell them apart by version.
        await backend.set_weight_version("v-node-a", workers=[w0])
        await backend.set_weight_version("v-node-b", workers=[w1])
        assert await backend.weight_versions() == {w0: "v-node-a", w1: "v-node-b"}

        # Generation through the router reaches both engines; same model, same greedy tokens.
        prompt = (5, 6, 7, 8, 9)
        gens = [await backend.generate(GenerateRequest(input_ids=prompt, sampling=GREEDY)) for _ in range(4)]
        assert {g.weight_version for g in gens} == {"v-node-a", "v-node-b"}
        pinned = {
            w: await backend.generate(GenerateRequest(input_ids=prompt, sampling=GREEDY, worker=w)) for w in (w0, w1)
        }
        assert len({g.output_ids for g in [*gens, *pinned.values()]}) == 1
        assert len(gens[0].output_ids) == 4

        # Killing engine 0's actor takes its server down (PDEATHSIG + the supervisor's watchdog).
        fleet.kill_engine(0)
        assert await wait_until(lambda: not any(pid_alive(p) for p in engine_pids[0]), 20), "engine 0 survived"
        assert await wait_until(lambda: not pid_alive(actor_pids[0]), 20)
        assert not await fleet.engine_alive(0)
        assert await fleet.engine_alive(1)
        report = await backend.health()
        by_worker = {h.worker: h for h in report.workers}
        assert not by_worker[w0].live and by_worker[w1].live
        again = await backend.generate(GenerateRequest(input_ids=prompt, sampling=GREEDY, worker=w1))
        assert again.output_ids == gens[0].output_ids
    finally:
        pg = fleet.placement_group
        await fleet.aclose()

    # Tear-down: every engine process, the router and the actors are gone; the bundles are freed.
    assert await wait_until(lambda: not any(pid_alive(p) for g in engine_pids for p in g), 20)
    assert await wait_until(lambda: not any(pid_alive(p) for p in actor_pids), 20)
    assert not fleet.supervisor.pids()
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    assert await wait_until(lambda: ray.available_resources().get("CPU", 0) >= 2, 20)


async def test_launch_failure_cleans_up(ray_cluster: str, tiny_model: Path) -> None:
    """An engine that cannot start fails the launch with its log tail; nothing stays placed or running."""
    ray = require("ray")
    from rollout_backends.ray import RayFleet, RayFleetSpec

    spec = RayFleetSpec(
        engine=ReferenceServerCommand(model_path=str(tiny_model), extra_args=["--no-such-flag"]),
        num_engines=2,
        strategy="STRICT_SPREAD",
        bind_host="127.0.0.1",
        ready_timeout=60,
    )
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        await RayFleet.launch(spec)
    text = str(info.value)
    assert "reference-" in text and "exited with code 2" in text and "--no-such-flag" in text, text
    assert time.monotonic() - t0 < 30
    assert await wait_until(lambda: ray.available_resources().get("CPU", 0) >= 2, 20)
