"""examples/grpo/grpo.py on CPU: the reward rises, every sample's version is its step's, and the
engines end on exactly the trainer's weights, in every placement (in-process reference engine; one
launched reference worker behind ``sglang://`` for tensors over shared memory, disk and gloo)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import pytest_asyncio
import torch

import rollout_backends as rb
from rollout_backends.adapters.reference import ReferenceBackend, cached_tiny_model

ROOT = Path(__file__).resolve().parents[1]
GREEDY = rb.SamplingParams(max_new_tokens=8, temperature=0.0)
PROBES = [(3, 4, 5, 6), (100, 200, 300)]


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grpo_example", ROOT / "examples" / "grpo" / "grpo.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


grpo = load_example()


@pytest.fixture(scope="module")
def model() -> Path:
    return cached_tiny_model(seed=0)


async def _serves_the_trainers_weights(backend: rb.RolloutBackend, loop: Any, tmp: Path) -> None:
    """The engines answer as a fresh engine started on the trainer's weights (its bf16 checkpoint)."""
    loop.policy.save(tmp)
    fresh = ReferenceBackend.create(tmp, workers=1)
    try:
        for p in PROBES:
            want = await fresh.generate(rb.GenerateRequest(input_ids=p, sampling=GREEDY))
            got = await backend.generate(rb.GenerateRequest(input_ids=p, sampling=GREEDY))
            assert (got.output_ids, got.logprobs) == (want.output_ids, want.logprobs)
    finally:
        await fresh.aclose()


async def test_colocated_loop_learns_and_keeps_versions_in_step(model: Path, tmp_path: Path) -> None:
    cfg = grpo.Config(backend=f"reference://{model}", model=str(model), steps=6, seed=0)
    async with grpo.opened(cfg) as loop:
        assert loop.backend.capabilities.memory_release  # the release -> train -> resume path runs
        # the float32 trainer pushes the engines' bfloat16: its flat buffers hold 2 bytes a weight
        weights = sum(p.numel() for _, p in loop.policy.named_weights())
        assert loop.policy.engine_dtype == torch.bfloat16
        assert 2 * weights <= loop.sync.buckets.allocated_bytes < 2 * weights + 256 * 64
        before = await loop.backend.generate(rb.GenerateRequest(input_ids=PROBES[0], sampling=GREEDY))
        records = [await loop.step() for _ in range(cfg.steps)]
        assert [r.version for r in records] == ["initial", *(f"step-{k}" for k in range(1, cfg.steps))]
        assert await loop.backend.weight_version() == f"step-{cfg.steps}"
        assert all(len(r.rewards) == cfg.prompts * cfg.group for r in records)
        assert all(r.memory_s > 0 and r.sync_s > 0 for r in records)
        after = await loop.backend.generate(rb.GenerateRequest(input_ids=PROBES[0], sampling=GREEDY))
        assert after.output_ids != before.output_ids  # the weights did move
        await _serves_the_trainers_weights(loop.backend, loop, tmp_path / "trainer")
    # Deterministic on CPU (seeded engine sampling, a CPU trainer): 0.125, 0.148, 0.170, 0.182, 0.279,
    # 0.342 over the six steps (torch 2.13 CPU, 2026-12); the margin leaves room for another build.
    first, last = records[0].mean_reward, (records[-1].mean_reward + records[-2].mean_reward) / 2
    assert abs(first - 1 / grpo.TARGET_EVERY) < 0.05 and last > first + 0.08, [r.mean_reward for r in records]


async def test_a_sample_from_other_weights_stops_the_loop(model: Path) -> None:
    cfg = grpo.Config(backend=f"reference://{model}", model=str(model), steps=1, prompts=1, group=2)
    async with grpo.opened(cfg) as loop:
        await loop.backend.set_weight_version("someone-else")  # weights changed behind the loop's back
        with pytest.raises(grpo.StaleSample, match="someone-else"):
            await loop.step()


def test_group_normalised_advantages() -> None:
    s = [grpo.Sample(g, (1,), (2,), (0.0,), r, "v") for g, r in ((0, 0.0), (0, 1.0), (1, 0.5), (1, 0.5))]
    a = grpo.advantages(s)
    assert a[0] == pytest.approx(-1.0, abs=1e-5) and a[1] == pytest.approx(1.0, abs=1e-5)
    assert a[2] == a[3] == 0.0  # a group with one reward teaches nothing
    assert grpo.reward([8, 16, 3, 5]) == 0.5


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(model: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    from rollout_backends.adapters.sglang import SGLangFleetConfig, launch_sglang_fleet

    cfg = SGLangFleetConfig(
        model_path=str(model),
        workers=1,
        worker_kind="reference",
        router="none",
        log_dir=str(tmp_path_factory.mktemp("grpo-worker")),
        startup_timeout_s=120,
    )
    async with launch_sglang_fleet(cfg) as fleet:
        yield f"sglang://{fleet.worker_urls[0].removeprefix('http://')}"


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("placement", ["colocated", "disk", "distributed"])
async def test_every_placement_through_a_launched_worker(
    worker: str, model: Path, placement: str, tmp_path: Path
) -> None:
    cfg = grpo.Config(backend=worker, model=str(model), placement=placement, steps=2, prompts=2, group=4, seed=1)
    async with grpo.opened(cfg) as loop:
        assert loop.backend.capabilities.flattened_buckets
        records = [await loop.step() for _ in range(cfg.steps)]
        assert [r.version for r in records] == ["initial", "step-1"]
        assert await loop.backend.weight_version() == "step-2"
        await _serves_the_trainers_weights(loop.backend, loop, tmp_path / "trainer")
    assert dataclasses.asdict(records[0])["rollout_s"] > 0
