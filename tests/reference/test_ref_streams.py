"""``as_completed`` on real reference engines: the same samples as ``generate_group``, and leaving
early leaves nothing running on any engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import attrs

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


async def test_a_stream_is_the_engine_steps_of_generate_and_leaving_it_aborts(model_dir: Path) -> None:
    backend = ReferenceBackend.create(model_dir, workers=1)
    try:
        sp = rb.SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, top_logprobs=2)
        req = rb.GenerateRequest(input_ids=(5, 6, 7), sampling=sp, request_id="st")
        want = await backend.generate(attrs.evolve(req, request_id="g"))
        async with backend.stream(req) as chunks:
            got = [c async for c in chunks]
        final = got[-1].final
        assert final is not None and len(got) >= 2
        assert [c.index for c in got] == [sum(len(c.output_ids) for c in got[:i]) for i in range(len(got))]
        assert tuple(t for c in got for t in c.output_ids) == final.output_ids == want.output_ids
        assert tuple(v for c in got for v in c.logprobs or ()) == final.logprobs == want.logprobs
        assert tuple(t for c in got for t in c.top_logprobs or ()) == final.top_logprobs == want.top_logprobs
        assert (final.weight_version, final.version_spans) == (want.weight_version, want.version_spans)

        engine = backend.engines[0]
        long = attrs.evolve(req, sampling=sp.replace(max_new_tokens=400), request_id="long")
        tasks_before = len(asyncio.all_tasks())
        async with backend.stream(long) as chunks:
            async for _ in chunks:
                assert engine.request_ids == ("long",)
                break
        assert engine.request_ids == () and engine.num_running == 0
        assert len(asyncio.all_tasks()) == tasks_before
        again = await backend.generate(attrs.evolve(long, sampling=sp))  # the id is free at once
        assert again.output_ids == want.output_ids
    finally:
        await backend.aclose()
