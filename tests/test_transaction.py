"""The weight-update transaction over the HTTP fleet core, with failures injected per worker and step."""

from __future__ import annotations

import pytest

import rollout_backends as rb
from tests.fake_sglang import FakeSGLangFleet

STEP_PATHS = {
    "pause": "/pause_generation",
    "flush_cache": "/flush_cache",
    "begin": "/begin_weight_update",
    "set_version": "/update_weight_version",
    "end": "/end_weight_update",
}


async def test_happy_path_sequence_and_version() -> None:
    fleet = FakeSGLangFleet(2)
    async with fleet.backend() as backend:
        async with backend.weight_update("v1", mode=rb.PauseMode.RETRACT) as tx:
            await tx.update_from_disk("/ckpt/v1")
        assert await backend.weight_version() == "v1"
    for url, w in fleet.workers.items():
        assert w.paused is None and not w.in_session and w.version == "v1"
        seq = [p for p in fleet.paths(url) if p != "/model_info"]
        assert seq == [
            "/pause_generation", "/flush_cache", "/begin_weight_update", "/update_weights_from_disk",
            "/update_weight_version", "/end_weight_update", "/continue_generation",
        ]  # fmt: skip
    # The disk loader inside a transaction neither labels nor flushes by itself.
    disk = [b for _, p, b in fleet.calls if p == "/update_weights_from_disk"]
    assert all("weight_version" not in b and b["flush_cache"] is False for b in disk)


async def test_in_place_mode_flushes_when_it_can_and_tolerates_a_refusal() -> None:
    fleet = FakeSGLangFleet(2)
    async with fleet.backend() as backend, backend.weight_update("v1", mode=rb.PauseMode.IN_PLACE) as tx:
        assert tx.cache_flushed  # nothing frozen: stale prefixes are dropped
        await tx.update_from_disk("/ckpt/v1")
    assert all(w.flushed == 1 for w in fleet.workers.values())
    # A worker with frozen requests refuses the flush: the update still goes through, and says so.
    next(iter(fleet.workers.values())).fail.add("/flush_cache")
    async with fleet.backend() as backend, backend.weight_update("v2", mode=rb.PauseMode.IN_PLACE) as tx:
        assert not tx.cache_flushed
        await tx.update_from_disk("/ckpt/v2")
    assert all(w.version == "v2" and w.paused is None for w in fleet.workers.values())
    assert {b["mode"] for _, p, b in fleet.calls if p == "/pause_generation"} == {"in_place"}


@pytest.mark.parametrize("step", list(STEP_PATHS))
@pytest.mark.parametrize("bad", [0, 1])
async def test_failure_at_each_step_resumes_all_and_keeps_version(step: str, bad: int) -> None:
    fleet = FakeSGLangFleet(2)
    bad_url = list(fleet.workers)[bad]
    fleet.workers[bad_url].fail.add(STEP_PATHS[step])
    async with fleet.backend() as backend:
        with pytest.raises(rb.WeightUpdateFailed) as info:
            async with backend.weight_update("v1") as tx:
                await tx.update_from_disk("/ckpt/v1")
        err = info.value
        assert (f"w{bad}", step) in {(f.worker, f.step) for f in err.failures}
        assert err.version == "v1" and err.previous == "v0"
        assert step in str(err) and f"w{bad}" in str(err)
        # Every worker resumed, no session left open, no worker advertises the new version.
        for url, w in fleet.workers.items():
            assert w.paused is None
            # A session stays open only where closing it is the step that failed.
            assert w.in_session == (step == "end" and url == bad_url)
            assert w.version == "v0"
        assert await backend.weight_version() == "v0"
        # No worker is reported stale: once labels moved, the rollback declares the old version;
        # before that nothing was labelled or declared, so nothing is expected.
        report = await backend.health()
        assert report.expected_version == ("v0" if step in ("set_version", "end") else None)
        assert report.stale_workers == ()


async def test_failure_in_body_resumes_and_names_update_step() -> None:
    fleet = FakeSGLangFleet(2)
    list(fleet.workers.values())[1].fail.add("/update_weights_from_disk")
    async with fleet.backend() as backend:
        with pytest.raises(rb.WeightUpdateFailed) as info:
            async with backend.weight_update("v1") as tx:
                await tx.update_from_disk("/ckpt/v1")
        assert info.value.steps == ("update",)
        assert info.value.workers == ("w1",)
    assert all(w.paused is None and w.version == "v0" and not w.in_session for w in fleet.workers.values())


async def test_trainer_side_exception_in_body_is_wrapped_and_resumes() -> None:
    fleet = FakeSGLangFleet(2)
    async with fleet.backend() as backend:
        with pytest.raises(rb.WeightUpdateFailed) as info:
            async with backend.weight_update("v1"):
                raise RuntimeError("NCCL broadcast timed out")
        assert isinstance(info.value.__cause__, RuntimeError)
    assert all(w.paused is None and w.version == "v0" for w in fleet.workers.values())


async def test_unreachable_worker_is_named_and_others_resumed() -> None:
    fleet = FakeSGLangFleet(3)
    list(fleet.workers.values())[2].down = True
    async with fleet.backend() as backend:
        with pytest.raises(rb.WeightUpdateFailed) as info:
            async with backend.weight_update("v1") as tx:
                await tx.update_from_disk("/ckpt")
        assert "w2" in info.value.workers
    ups = list(fleet.workers.values())[:2]
    assert all(w.paused is None and w.version == "v0" for w in ups)


async def test_cancellation_still_resumes() -> None:
    import asyncio

    fleet = FakeSGLangFleet(2)
    async with fleet.backend() as backend:

        async def body() -> None:
            async with backend.weight_update("v1"):
                await asyncio.sleep(10)

        task = asyncio.create_task(body())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert all(w.paused is None and w.version == "v0" for w in fleet.workers.values())


async def test_no_begin_end_on_servers_without_sessions() -> None:
    fleet = FakeSGLangFleet(1, begin_end=False)
    async with fleet.backend() as backend, backend.weight_update("v9") as tx:
        await tx.update_from_disk("/x")
    paths = [p for _, p, _ in fleet.calls]
    assert "/begin_weight_update" not in paths and "/end_weight_update" not in paths
    assert next(iter(fleet.workers.values())).version == "v9"


async def test_invalid_version_and_unsupported_mode() -> None:
    fleet = FakeSGLangFleet(1)
    async with fleet.backend() as backend:
        with pytest.raises(rb.InvalidRequest) as info:
            async with backend.weight_update(""):
                pass
        assert info.value.field == "version"
    assert all(w.paused is None for w in fleet.workers.values())
