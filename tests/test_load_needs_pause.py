"""``Capabilities.load_needs_pause``: engines that take a weight load only while paused (ai-dynamo
1.4.2's ``dynamo.vllm`` weight routes) get one from the fleet outside a transaction, and are never
left paused by it (the H100 GPU tier of 2026-12-05: a direct ``update_weights_from_disk`` was
refused, and the conformance suite's restore of the served weights with it)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

import rollout_backends as rb
from rollout_backends.kit import Pause, Resume, SetVersion, UpdateFromDisk
from rollout_backends.testing import FAKE_CAPABILITIES, FakeFleet, fake_fleet, write_checkpoint

NEEDS_PAUSE = attrs.evolve(FAKE_CAPABILITIES, load_needs_pause=True)


def _steps(fleet: FakeFleet) -> list[list[str]]:
    return [[type(op).__name__ for op in fake.ops] for fake in fleet.fakes]


async def test_a_load_outside_a_transaction_pauses_and_resumes_the_workers(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "w2", 2)
    fleet = fake_fleet(2, capabilities=NEEDS_PAUSE)
    async with fleet:
        await fleet.update_weights_from_disk(ckpt, version="v1")
        assert _steps(fleet) == [["Pause", "UpdateFromDisk", "Resume"]] * 2
        assert all(f.ops[0] == Pause(rb.PauseMode.RETRACT) and f.paused is None and f.seed == 2 for f in fleet.fakes)
        assert await fleet.weight_version() == "v1"
        # A relabel is no load: nothing paused for it.
        await fleet.set_weight_version("v2")
        assert [type(op) for op in fleet.fakes[0].ops[3:]] == [SetVersion]
        health = await fleet.health()
        assert all(w.ready for w in health.workers)


async def test_inside_a_transaction_the_fleet_does_not_pause_again(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "w2", 2)
    fleet = fake_fleet(2, capabilities=NEEDS_PAUSE)
    async with fleet:
        async with fleet.weight_update("v1") as tx:
            await tx.update_from_disk(ckpt)
        for steps in _steps(fleet):
            assert steps.count("Pause") == 1 and steps.count("Resume") == 1, steps
            assert steps.index("Pause") < steps.index("UpdateFromDisk") < steps.index("Resume")


async def test_a_failed_load_still_resumes_every_worker(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "w2", 2)
    fleet = fake_fleet(2, capabilities=NEEDS_PAUSE)
    async with fleet:
        fleet.fakes[1].fail_next(UpdateFromDisk)
        with pytest.raises(rb.ControlFailed, match="fake-1"):
            await fleet.update_weights_from_disk(ckpt, version="v1")
        assert all(f.paused is None and isinstance(f.ops[-1], Resume) for f in fleet.fakes)
        # Outside a transaction a load is not all-or-nothing: the worker that failed keeps its label.
        assert (await fleet.weight_versions())["fake-1"] == "v0"


async def test_undeclared_the_engine_refuses_and_without_a_keeping_pause_mode_the_fleet_does(
    tmp_path: Path,
) -> None:
    ckpt = write_checkpoint(tmp_path / "w2", 2)
    fleet = fake_fleet(1)
    fleet.fakes[0].loads_only_paused = True  # the engine's rule, not declared
    async with fleet:
        with pytest.raises(rb.ControlFailed, match="must be paused"):
            await fleet.update_weights_from_disk(ckpt, version="v1")
    abort_only = attrs.evolve(NEEDS_PAUSE, pause_modes=[rb.PauseMode.ABORT])
    async with fake_fleet(1, capabilities=abort_only) as fleet:
        with pytest.raises(rb.Unsupported, match="loads weights only while paused"):
            await fleet.update_weights_from_disk(ckpt, version="v1")
        assert fleet.fakes[0].ops == [] and fleet.fakes[0].paused is None


async def test_the_weight_checks_pass_on_an_engine_that_declares_it(tmp_path: Path) -> None:
    from rollout_backends.conformance import run_checks
    from tests.conformance.fake_backend import BUGS, fake_factory, fake_harness

    assert "loads_only_paused" in BUGS  # undeclared, disk_update_matches_fresh fails (test_runner)
    report = await run_checks(
        fake_factory(declare=NEEDS_PAUSE, bugs=frozenset({"loads_only_paused"})),
        fake_harness(tmp_path),
        select=["weights"],
    )
    assert report.ok and report.passed, report.summary()
