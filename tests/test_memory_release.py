"""The fleet sends each worker only the memory tags that change its state: SGLang 0.5.16's
scheduler removes every resumed tag from a set (``offload_tags.remove``; ``None`` = every tag,
sglang/srt/managers/scheduler_components/weight_updater.py), so ``resume_memory()`` after
``resume_memory([WEIGHTS])`` would raise KeyError there and leave the rest asleep."""

from __future__ import annotations

from pathlib import Path

import pytest

import rollout_backends as rb
from rollout_backends._fleet import Fleet
from rollout_backends.conformance import Outcome, select_checks
from rollout_backends.kit import Pause, ReleaseMemory, ResumeMemory
from rollout_backends.testing import FAKE_CAPABILITIES, FakeDriver, FakeFleet
from tests.conformance.fake_backend import fake_harness

W, KV, CG = rb.MemoryTag.WEIGHTS, rb.MemoryTag.KV_CACHE, rb.MemoryTag.CUDA_GRAPH


class StrictDriver(FakeDriver):
    """Resumes as SGLang's scheduler does: a tag that is not released is an error."""

    def resume_memory(self, tags: set[rb.MemoryTag]) -> None:
        if not tags <= self.released:
            why = f"KeyError: {sorted(t.value for t in tags - self.released)}"
            raise rb.ControlFailed("resume_memory", [rb.WorkerFailure(self.id, "resume_memory", why)])
        super().resume_memory(tags)


def strict_fleet(workers: int = 1) -> FakeFleet:
    drivers = [StrictDriver(f"fake-{i}") for i in range(workers)]
    return FakeFleet(drivers, capabilities=FAKE_CAPABILITIES)


def memory_ops(fake: FakeDriver) -> list[object]:
    return [op for op in fake.ops if isinstance(op, ReleaseMemory | ResumeMemory)]


async def test_resume_all_after_a_partial_resume_sends_only_what_still_sleeps() -> None:
    fleet = strict_fleet()
    async with fleet:
        await fleet.pause()
        await fleet.release_memory()
        await fleet.resume_memory([W])
        await fleet.resume_memory()
        (fake,) = fleet.fakes
        assert memory_ops(fake) == [ReleaseMemory(None), ResumeMemory((W,)), ResumeMemory((KV, CG))]
        assert fake.released == set()
        await fleet.resume()
        req = rb.GenerateRequest(input_ids=[1, 2, 3], sampling=rb.SamplingParams(temperature=0, max_new_tokens=3))
        out = await fleet.generate(req)  # the fake refuses to generate with its KV cache released
        assert len(out.output_ids) == 3


async def test_repeated_calls_change_nothing_and_send_nothing() -> None:
    fleet = strict_fleet(2)
    async with fleet:
        await fleet.pause()
        await fleet.release_memory([KV])
        await fleet.release_memory([KV])  # already released
        await fleet.release_memory()  # the rest: weights and CUDA graphs, in MemoryTag order
        await fleet.resume_memory()
        await fleet.resume_memory()  # all awake
        await fleet.resume_memory([KV])
        for fake in fleet.fakes:
            assert memory_ops(fake) == [ReleaseMemory((KV,)), ReleaseMemory((W, CG)), ResumeMemory(None)]
            assert fake.released == set()


async def test_one_worker_is_tracked_apart_from_the_others() -> None:
    fleet = strict_fleet(2)
    async with fleet:
        await fleet.pause()
        await fleet.release_memory(workers=["fake-1"])
        # fake-0's state is not known here: sent as asked, and the strict engine refuses it.
        with pytest.raises(rb.ControlFailed) as info:
            await fleet.resume_memory([W, KV])
        assert [f.worker for f in info.value.failures] == ["fake-0"]
        a, b = fleet.fakes
        assert memory_ops(a) == [ResumeMemory((W, KV))]
        assert memory_ops(b) == [ReleaseMemory(None), ResumeMemory((W, KV))]
        await fleet.resume_memory(workers=["fake-1"])
        assert memory_ops(b)[-1] == ResumeMemory((CG,)) and b.released == set()


async def test_a_failed_call_makes_the_state_unknown() -> None:
    fleet = strict_fleet(2)
    async with fleet:
        await fleet.pause()
        await fleet.release_memory()
        a, b = fleet.fakes
        b.fail_next(ResumeMemory)
        with pytest.raises(rb.ControlFailed) as info:
            await fleet.resume_memory([W])
        assert [f.worker for f in info.value.failures] == ["fake-1"]
        # fake-0 is known to sleep without its weights; fake-1 may have done part of it: as asked.
        await fleet.resume_memory([W, KV])
        assert memory_ops(a)[1:] == [ResumeMemory((W,)), ResumeMemory((KV,))]
        assert memory_ops(b)[1:] == [ResumeMemory((W,)), ResumeMemory((W, KV))]
        assert isinstance(a.ops[0], Pause)


@pytest.fixture
def pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet without its record: every call forwarded as asked (as before the guard)."""

    def as_asked(self: Fleet, op: ReleaseMemory | ResumeMemory, worker: str) -> ReleaseMemory | ResumeMemory:
        return op

    monkeypatch.setattr(Fleet, "_memory_op", as_asked)


async def test_the_conformance_check_needs_the_guard_on_a_strict_engine(tmp_path: Path, pass_through: None) -> None:
    (check,) = select_checks(["memory_release_resume"])

    async def make() -> FakeFleet:
        return strict_fleet()

    bare = await check(make, fake_harness(tmp_path))
    assert bare.outcome is Outcome.FAIL and "KeyError" in bare.message, bare.line()


async def test_the_conformance_check_passes_on_a_strict_engine_through_the_fleet(tmp_path: Path) -> None:
    (check,) = select_checks(["memory_release_resume"])

    async def make() -> FakeFleet:
        return strict_fleet()

    r = await check(make, fake_harness(tmp_path))
    assert r.outcome is Outcome.PASS, r.line()
