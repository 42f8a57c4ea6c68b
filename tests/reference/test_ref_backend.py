"""ReferenceBackend: the protocol over N engines, routing, the weight-update transaction."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from refhelpers import GREEDY, PROMPTS, outputs, req, run_all, wait_for_tokens

from rollout_backends._errors import ControlFailed, InvalidRequest, StaleWeights, WeightUpdateFailed
from rollout_backends._protocol import RolloutBackend
from rollout_backends._types import (
    FinishReason,
    PauseMode,
    RoutingKind,
    VersionSource,
    WeightBucket,
    WeightGroup,
    WeightTransport,
)
from rollout_backends.adapters.reference import (
    EngineError,
    ReferenceBackend,
    ReferenceEngine,
    WeightSender,
    free_port,
    open_from_url,
)


@pytest.fixture
async def backend(model_dir: Path) -> AsyncIterator[ReferenceBackend]:
    b = ReferenceBackend.create(model_dir, workers=2)
    yield b
    await b.aclose()


def _tensors(model_dir: Path) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    return sorted(load_file(str(model_dir / "model.safetensors")).items())


async def _pinned(backend: ReferenceBackend, worker: str) -> list[Any]:
    return [await backend.generate(req(p, worker=worker)) for p in PROMPTS]


async def test_protocol_and_capabilities(backend: ReferenceBackend) -> None:
    assert isinstance(backend, RolloutBackend)
    caps = backend.capabilities
    assert caps.pause_modes == frozenset(PauseMode)
    assert caps.weight_transports == frozenset(WeightTransport)
    assert caps.memory_release and caps.seeded_sampling and caps.begin_end_update and caps.worker_pinning
    assert caps.version_source is VersionSource.RESPONSE
    assert caps.routing is RoutingKind.ROUND_ROBIN
    assert (caps.vocab_size, caps.max_context) == (512, 4096)
    assert backend.workers == ("ref-0", "ref-1")


async def test_round_robin_and_pinning(backend: ReferenceBackend) -> None:
    served = [(await backend.generate(req(PROMPTS[0]))).worker for _ in range(4)]
    assert served == ["ref-0", "ref-1", "ref-0", "ref-1"]
    assert {(await backend.generate(req(PROMPTS[0], worker="ref-1"))).worker for _ in range(3)} == {"ref-1"}
    with pytest.raises(InvalidRequest) as info:
        await backend.generate(req(PROMPTS[0], worker="ref-9"))
    assert info.value.field == "worker"
    # Same weights, same numbers on every worker.
    assert outputs(await _pinned(backend, "ref-0")) == outputs(await _pinned(backend, "ref-1"))


async def test_transaction_updates_every_worker(
    backend: ReferenceBackend, model_dir_b: Path, make_engine: Callable[..., ReferenceEngine]
) -> None:
    long = GREEDY.replace(max_new_tokens=60)
    inflight = asyncio.ensure_future(backend.generate(req(PROMPTS[0], long, worker="ref-0")))
    await wait_for_tokens(backend.engine("ref-0"), 3)
    async with backend.weight_update("v2") as tx:
        await tx.update_from_disk(str(model_dir_b))
    assert await backend.weight_versions() == {"ref-0": "v2", "ref-1": "v2"}
    assert await backend.weight_version() == "v2"
    gen = await inflight  # retracted, recomputed on the new weights, finished
    assert gen.finish_reason is FinishReason.LENGTH and gen.weight_version == "v2"
    fresh = outputs(await run_all(make_engine(model_dir_b)))
    for w in backend.workers:
        assert outputs(await _pinned(backend, w)) == fresh
        assert backend.engine(w).paused is None
        assert backend.engine(w).health().update_session is None


async def test_transaction_with_tensors_in_place(backend: ReferenceBackend, model_dir_b: Path) -> None:
    async with backend.weight_update("v3", mode=PauseMode.IN_PLACE) as tx:
        await tx.update_from_tensors(_tensors(model_dir_b))
    assert await backend.weight_version() == "v3"
    assert all(e.paused is None for e in backend.engines)


_STEP_METHODS = {
    "pause": "pause",
    "flush_cache": "flush_cache",
    "begin": "begin_weight_update",
    "update": "update_weights_from_tensors",
    "set_version": "set_weight_version",
    "end": "end_weight_update",
}


@pytest.mark.parametrize("step", list(_STEP_METHODS))
async def test_failure_at_each_step_rolls_back(
    backend: ReferenceBackend, model_dir: Path, model_dir_b: Path, step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = backend.engine("ref-1")
    calls: list[str] = []

    async def broken(*args: Any, **kwargs: Any) -> None:
        calls.append(step)
        raise EngineError(f"ref-1: injected failure in {step}")

    monkeypatch.setattr(bad, _STEP_METHODS[step], broken)
    before = outputs(await _pinned(backend, "ref-0"))
    long = GREEDY.replace(max_new_tokens=200)
    inflight = asyncio.ensure_future(backend.generate(req(PROMPTS[1], long, worker="ref-0")))
    await wait_for_tokens(backend.engine("ref-0"), 3 + sum(len(g[0]) for g in before))
    with pytest.raises(WeightUpdateFailed) as info:
        async with backend.weight_update("v2") as tx:
            await tx.update_from_tensors(_tensors(model_dir_b))
    err = info.value
    assert calls, "the injected step was never reached"
    assert step in err.steps
    assert "ref-1" in err.workers
    assert f"ref-1 [{step}]" in str(err)
    assert err.version == "v2" and err.previous == "default"
    monkeypatch.undo()
    # Every worker resumed, no label moved, no session left open, and both still serve.
    assert await backend.weight_versions() == {"ref-0": "default", "ref-1": "default"}
    assert all(e.paused is None for e in backend.engines)
    # (An injected ``end`` failure leaves that worker's session open: that is what failed.)
    assert all(e.health().update_session is None for e in backend.engines if not (step == "end" and e is bad))
    report = await backend.health(probe=True)
    assert report.ready and all(w.making_progress for w in report.workers)
    gen = await asyncio.wait_for(inflight, 30)
    assert gen.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    if step in ("pause", "flush_cache", "begin"):  # failed before any weight moved
        assert outputs(await _pinned(backend, "ref-0")) == before


async def test_gloo_update_over_the_fleet(
    backend: ReferenceBackend, model_dir_b: Path, make_engine: Callable[..., ReferenceEngine]
) -> None:
    port = free_port()
    group = WeightGroup(master_address="127.0.0.1", master_port=port, world_size=3, backend="gloo")
    sender = WeightSender("127.0.0.1", port, world_size=3, timeout_s=30)
    try:
        await asyncio.gather(asyncio.to_thread(sender.connect), backend.init_weight_group(group))
        named = _tensors(model_dir_b)
        bucket = WeightBucket.from_named_tensors(named)
        async with backend.weight_update("g1") as tx:
            await asyncio.gather(asyncio.to_thread(sender.broadcast, named), tx.update_from_distributed(bucket))
    finally:
        await backend.destroy_weight_group()
        await backend.destroy_weight_group()
        sender.close()
    fresh = outputs(await run_all(make_engine(model_dir_b)))
    assert await backend.weight_version() == "g1"
    for w in backend.workers:
        assert outputs(await _pinned(backend, w)) == fresh


async def test_group_must_fit(backend: ReferenceBackend) -> None:
    group = WeightGroup(master_address="127.0.0.1", master_port=free_port(), world_size=2, backend="gloo")
    with pytest.raises(InvalidRequest) as info:
        await backend.init_weight_group(group)
    assert info.value.field == "group.world_size"


async def test_control_failures_name_the_worker(backend: ReferenceBackend) -> None:
    task = asyncio.ensure_future(backend.generate(req(PROMPTS[0], GREEDY.replace(max_new_tokens=3000), worker="ref-0")))
    await wait_for_tokens(backend.engine("ref-0"), 3)
    await backend.pause(PauseMode.IN_PLACE)
    with pytest.raises(ControlFailed) as info:
        await backend.flush_cache()
    assert info.value.workers == ("ref-0",)
    await backend.flush_cache(workers=["ref-1"])  # the idle one may flush
    with pytest.raises(InvalidRequest):
        await backend.flush_cache(workers=["nope"])
    await backend.resume()
    await backend.abort(task_id := "missing")  # unknown ids are ignored
    del task_id
    await backend.abort_all()
    assert (await task).finish_reason is FinishReason.ABORT


async def test_health_and_staleness(backend: ReferenceBackend) -> None:
    report = await backend.health(probe=True)
    assert report.ready and report.expected_version == "default" and not report.stale_workers
    await backend.pause(PauseMode.ABORT, workers=["ref-1"])
    report = await backend.health(probe=True)
    assert not report.ready and report.unhealthy_workers == ("ref-1",)
    assert report.worker("ref-1").making_progress is False
    assert "paused" in (report.worker("ref-1").error or "")
    await backend.resume()
    await backend.set_weight_version("v9", workers=["ref-0"])
    # Nothing was declared ("default" was the labels' common version): now they disagree, so no
    # version is expected and no worker is stale, as on every fleet (tests/test_versions.py).
    report = await backend.health()
    assert report.expected_version is None and report.stale_workers == ()
    backend.expect_version("default")
    report = await backend.health()
    assert report.stale_workers == ("ref-0",)
    with pytest.raises(StaleWeights) as info:
        await backend.weight_version()
    assert info.value.expected == "default"
    await backend.set_weight_version("v9")
    assert await backend.weight_version() == "v9"
    assert not (await backend.health()).stale_workers


async def test_memory_release_over_the_fleet(backend: ReferenceBackend) -> None:
    before = outputs(await _pinned(backend, "ref-1"))
    await backend.pause(PauseMode.RETRACT)
    await backend.release_memory(["weights", "kv_cache"])
    assert not (await backend.health()).any_ready
    with pytest.raises(InvalidRequest):
        await backend.release_memory(["gpu"])
    await backend.resume_memory()
    await backend.resume()
    assert outputs(await _pinned(backend, "ref-1")) == before


async def test_open_from_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path) -> None:
    monkeypatch.setenv("ROLLOUT_BACKENDS_CACHE", str(tmp_path / "cache"))
    b = open_from_url("reference://?workers=2&seed=0")
    try:
        assert b.workers == ("ref-0", "ref-1")
        made = tmp_path / "cache" / "models" / "tiny-seed0" / "model.safetensors"
        assert made.read_bytes() == (model_dir / "model.safetensors").read_bytes()
        mtime = made.stat().st_mtime_ns
        again = open_from_url("reference://?seed=0")
        assert made.stat().st_mtime_ns == mtime  # reused from the cache
        await again.aclose()
    finally:
        await b.aclose()
    by_path = open_from_url(f"reference://{model_dir}?workers=1&weight_version=w0")
    try:
        assert by_path.workers == ("ref-0",)
        assert await by_path.weight_version() == "w0"
        assert by_path.capabilities.routing is RoutingKind.SINGLE
    finally:
        await by_path.aclose()
    with pytest.raises(InvalidRequest):
        open_from_url("reference://?colour=blue")
    with pytest.raises(InvalidRequest):
        open_from_url("sglang://host:30000")
