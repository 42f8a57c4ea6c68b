"""``rollout_backends.testing``: the public in-memory fleet RL code is unit-tested with."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import rollout_backends as rb
from rollout_backends.conformance import Harness, run_checks
from rollout_backends.kit import Fleet, Pause, UpdateFromDisk, UpdateFromTensors
from rollout_backends.testing import (
    FakeFleet,
    fake_factory,
    fake_fleet,
    load_checkpoint,
    permute_checkpoint,
    read_checkpoint,
    write_checkpoint,
)

#: What the suite cannot run on the fake: no process group, one worker, no HF model.
SKIPPED = {
    "distributed_update_matches_fresh",
    "hf_logprob_parity",
    "staleness_visible",
    "min_version_after_partial_update",  # two workers
    "version_spans_quiet",  # the fake reports no per-token versions
    "version_spans_across_update",
    "stream_version_spans_across_update",  # the fake's chunks report no versions
    "version_spans_across_in_place_update",
    "stream_version_spans_across_in_place_update",
}


def _harness(tmp: Path) -> Harness:
    @contextlib.asynccontextmanager
    async def inject(backend: Any, worker: str) -> AsyncIterator[None]:
        fake: FakeFleet = backend
        fake.fake(worker).fail_next(UpdateFromDisk)
        try:
            yield
        finally:
            fake.fake(worker).fail_next()

    return Harness(
        alt_weights_path=write_checkpoint(tmp / "alt", 2),
        base_weights_path=write_checkpoint(tmp / "base", 1),
        fresh_factory_on=lambda path: fake_factory(seed=read_checkpoint(path)),
        inject_failure=inject,
        load_weights=load_checkpoint,
        permute_vocabulary=permute_checkpoint,  # labels_follow_weights: derive from a fake checkpoint
        concurrency=40,
        long_max_new_tokens=200,
        pause_max_new_tokens=120,
        wait_s=0.1,
    )


async def test_the_docstring_example(tmp_path: Path) -> None:
    async with fake_fleet(workers=2) as backend:
        gen = await backend.generate(rb.GenerateRequest(input_ids=[1, 2, 3]))
        async with backend.weight_update("step-1") as tx:
            await tx.update_from_disk(write_checkpoint(tmp_path / "step-1", seed=2))
        assert await backend.weight_version() == "step-1"
        assert [type(op).__name__ for op in backend.fake("fake-0").ops][:2] == ["Pause", "FlushCache"]
    # Default sampling (temperature 1, a random request id) may draw the EOS token before the budget.
    budget = rb.SamplingParams().max_new_tokens
    assert gen.worker == "fake-0" and 1 <= len(gen.output_ids) <= budget
    assert len(gen.output_ids) == budget or gen.finish_reason is rb.FinishReason.STOP
    assert backend.closed and all(f.closed for f in backend.fakes)


async def test_the_fake_is_the_one_fleet_and_passes_the_conformance_suite(tmp_path: Path) -> None:
    backend = await fake_factory()()
    assert isinstance(backend, Fleet) and isinstance(backend, rb.RolloutBackend)
    await backend.aclose()
    report = await run_checks(fake_factory(), _harness(tmp_path), label="testing.fake_fleet")
    bad = [r.line() for r in report.results if not r.ok]
    assert not bad, "\n".join(bad)
    assert {r.name for r in report.skipped} == SKIPPED
    two = await run_checks(fake_factory(2), _harness(tmp_path), select=["staleness_visible", "health_*", "injected_*"])
    assert two.ok and not two.skipped, two.summary()


async def test_a_failing_worker_rolls_the_update_back_and_is_named(tmp_path: Path) -> None:
    backend = fake_fleet(workers=2)
    backend.fake("fake-1").fail_next(UpdateFromDisk)
    with pytest.raises(rb.WeightUpdateFailed) as info:
        async with backend.weight_update("step-1") as tx:
            await tx.update_from_disk(write_checkpoint(tmp_path / "ckpt", seed=2))
    assert info.value.workers == ("fake-1",)
    assert await backend.weight_version() == "v0"
    assert all(f.paused is None for f in backend.fakes)  # everyone resumed
    assert [type(op) for op in backend.fake("fake-1").ops].count(Pause) == 1


async def test_caller_errors_are_invalid_requests_naming_the_field() -> None:
    backend = fake_fleet()
    with pytest.raises(rb.InvalidRequest) as info:
        await backend.generate(rb.GenerateRequest(input_ids=[1, 99]))
    assert info.value.field == "input_ids[1]"
    with pytest.raises(rb.InvalidRequest) as info:
        await backend.update_weights_from_tensors([("bias", 1)])
    assert info.value.field == "named_tensors"
    with pytest.raises(rb.InvalidRequest) as info:
        fake_fleet(workers=0)
    assert info.value.field == "workers"
    none = fake_fleet(capabilities=rb.Capabilities(vocab_size=64))  # declares no top logprobs
    with pytest.raises(rb.InvalidRequest) as info:
        await none.generate(
            rb.GenerateRequest(input_ids=[1], return_logprobs=True, sampling=rb.SamplingParams(top_logprobs=2))
        )
    assert info.value.field == "sampling.top_logprobs" and none.fake("fake-0").requests == []
    with pytest.raises(rb.Unsupported):
        await backend.init_weight_group(rb.WeightGroup(master_address="h", master_port=1, world_size=2))
    # The one op the engine saw is the one it refused (the Unsupported one never left the fleet).
    assert [type(op) for op in backend.fake("fake-0").ops] == [UpdateFromTensors]
