"""``as_completed`` on real reference engines: the same samples as ``generate_group``, and leaving
early leaves nothing running on any engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import rollout_backends as rb
from rollout_backends.adapters.reference import ReferenceBackend


async def test_group_as_completed_equals_generate_group_and_break_frees_the_engines(model_dir: Path) -> None:
    backend = ReferenceBackend.create(model_dir, workers=2)
    try:
        sampling = rb.SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
        whole = await rb.generate_group(backend, (5, 6, 7), 4, sampling, group_id="g")
        async with rb.generate_group_as_completed(backend, (5, 6, 7), 4, sampling, group_id="g") as results:
            streamed = [g async for g in results]
        key = lambda g: g.request_id  # noqa: E731
        assert [(g.request_id, g.output_ids, g.logprobs) for g in sorted(streamed, key=key)] == [
            (g.request_id, g.output_ids, g.logprobs) for g in whole
        ]

        long = rb.SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
        short = rb.SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        requests = [rb.GenerateRequest(input_ids=(1, 2, 3), sampling=short, request_id="quick")] + [
            rb.GenerateRequest(input_ids=(4, 5, i), sampling=long, request_id=f"slow-{i}") for i in range(6)
        ]
        tasks_before = len(asyncio.all_tasks())
        async with rb.as_completed(backend, requests) as results:
            async for gen in results:
                assert gen.request_id == "quick"
                break
        assert sum(e.num_running + e.num_waiting for e in backend.engines) == 0
        assert len(asyncio.all_tasks()) == tasks_before
    finally:
        await backend.aclose()
