"""Helpers shared by the reference tests (a uniquely named module, not ``conftest``)."""

from __future__ import annotations

import asyncio
from typing import Any

from rollout_backends._types import GenerateRequest, Generation, SamplingParams
from rollout_backends.adapters.reference import ReferenceEngine

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS: list[tuple[int, ...]] = [
    (1, 17, 42, 99, 300, 7),
    (5, 6, 7, 8, 9, 10, 11, 12),
    tuple(range(20, 60)),
    (400, 3, 250),
]


def req(prompt: tuple[int, ...] | list[int], sampling: SamplingParams = GREEDY, **kw: Any) -> GenerateRequest:
    return GenerateRequest(input_ids=tuple(prompt), sampling=sampling, **kw)


async def run_all(engine: Any, sampling: SamplingParams = GREEDY) -> list[Generation]:
    """Each prompt of PROMPTS, one after another."""
    return [await engine.generate(req(p, sampling)) for p in PROMPTS]


async def wait_for_tokens(engine: ReferenceEngine, n: int, timeout: float = 10.0) -> None:
    """Wait until the engine has produced at least ``n`` tokens in total."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.health().tokens_generated < n:
        if loop.time() > deadline:
            raise AssertionError(f"engine produced {engine.health().tokens_generated} < {n} tokens")
        await asyncio.sleep(0.002)


def outputs(gens: list[Generation]) -> list[tuple[tuple[int, ...], tuple[float, ...] | None]]:
    return [(g.output_ids, g.logprobs) for g in gens]
