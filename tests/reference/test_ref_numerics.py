"""Numbers: greedy = argmax, logprobs = log_softmax, reproducible across processes and concurrency."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from refhelpers import GREEDY, PROMPTS, outputs, req, run_all

from rollout_backends._types import FinishReason, SamplingParams
from rollout_backends.adapters.reference import ReferenceEngine

SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, top_k=100, seed=1234, ignore_eos=True)

_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    from rollout_backends._types import GenerateRequest, SamplingParams
    from rollout_backends.adapters.reference import ReferenceEngine

    async def main():
        engine = ReferenceEngine(sys.argv[1], num_threads=int(sys.argv[2]))
        out = []
        for params in json.loads(sys.argv[3]):
            for prompt in json.loads(sys.argv[4]):
                g = await engine.generate(GenerateRequest(input_ids=prompt, sampling=SamplingParams(**params)))
                out.append([list(g.output_ids), [float(x).hex() for x in g.logprobs]])
        await engine.aclose()
        print(json.dumps(out))

    asyncio.run(main())
    """
)


def _child(model_dir: Path, num_threads: int) -> list[list[object]]:
    params = [
        {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True},
        {"max_new_tokens": 10, "temperature": 0.8, "top_p": 0.95, "top_k": 100, "seed": 1234, "ignore_eos": True},
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model_dir), str(num_threads), json.dumps(params), json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result: list[list[object]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


async def test_two_processes_agree_bit_for_bit(model_dir: Path, engine: ReferenceEngine) -> None:
    first, second = await asyncio.gather(
        asyncio.to_thread(_child, model_dir, 1), asyncio.to_thread(_child, model_dir, 1)
    )
    assert first == second
    # ... and this process (same thread count) agrees with them too.
    greedy10 = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    here = [
        [list(g.output_ids), [float(x).hex() for x in g.logprobs or ()]]
        for params in (greedy10, SAMPLED.replace(max_new_tokens=10))
        for g in [await engine.generate(req(p, params)) for p in PROMPTS]
    ]
    assert here == first


async def test_greedy_is_argmax_and_logprobs_are_log_softmax(model_dir: Path, engine: ReferenceEngine) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    hf = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    for gen, prompt in zip(await run_all(engine), PROMPTS, strict=True):
        seq = torch.tensor([list(prompt) + list(gen.output_ids)])
        with torch.no_grad():
            logits = hf(input_ids=seq).logits[0].float()
        n = len(prompt)
        step_logits = logits[n - 1 : n - 1 + len(gen.output_ids)]
        assert step_logits.argmax(-1).tolist() == list(gen.output_ids)
        ref = torch.log_softmax(step_logits, -1).gather(1, torch.tensor(gen.output_ids).view(-1, 1)).view(-1)
        assert gen.logprobs is not None
        torch.testing.assert_close(torch.tensor(gen.logprobs), ref, atol=1e-4, rtol=0)


async def test_sampled_logprobs_are_temperature_scaled(model_dir: Path, engine: ReferenceEngine) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    hf = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    prompt = PROMPTS[0]
    gen = await engine.generate(req(prompt, SAMPLED))
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([list(prompt) + list(gen.output_ids)])).logits[0]
    step = logits[len(prompt) - 1 : len(prompt) - 1 + len(gen.output_ids)] / SAMPLED.temperature
    ref = torch.log_softmax(step, -1).gather(1, torch.tensor(gen.output_ids).view(-1, 1)).view(-1)
    torch.testing.assert_close(torch.tensor(gen.logprobs), ref, atol=1e-4, rtol=0)
    # Every sampled token lies inside the top-k (here: the top 100) of its step.
    ranks = (step > step.gather(1, torch.tensor(gen.output_ids).view(-1, 1))).sum(-1)
    assert int(ranks.max()) < SAMPLED.top_k


async def test_seeded_sampling_is_reproducible_and_seed_dependent(engine: ReferenceEngine) -> None:
    a = await engine.generate(req(PROMPTS[1], SAMPLED))
    b = await engine.generate(req(PROMPTS[1], SAMPLED))
    c = await engine.generate(req(PROMPTS[1], SAMPLED.replace(seed=99)))
    greedy = await engine.generate(req(PROMPTS[1]))
    assert (a.output_ids, a.logprobs) == (b.output_ids, b.logprobs)
    assert a.output_ids != c.output_ids
    assert a.output_ids != greedy.output_ids


async def test_top_k_one_is_greedy(engine: ReferenceEngine) -> None:
    greedy = await engine.generate(req(PROMPTS[2]))
    k1 = await engine.generate(req(PROMPTS[2], SAMPLED.replace(top_k=1, temperature=1.0)))
    assert k1.output_ids == greedy.output_ids
    assert k1.logprobs == greedy.logprobs  # T=1: the same log_softmax


async def test_concurrent_requests_equal_sequential(engine: ReferenceEngine) -> None:
    mixed = [(p, s) for p in PROMPTS for s in (GREEDY, SAMPLED)]
    sequential = [await engine.generate(req(p, s)) for p, s in mixed]
    concurrent = await asyncio.gather(*(engine.generate(req(p, s)) for p, s in mixed))
    assert len(mixed) == 8
    assert outputs(list(concurrent)) == outputs(sequential)


async def test_penalties_change_greedy_choices(engine: ReferenceEngine) -> None:
    # A long greedy run from a random model repeats tokens; penalties must steer away from them.
    long = GREEDY.replace(max_new_tokens=40)
    plain = await engine.generate(req(PROMPTS[0], long))
    assert len(set(plain.output_ids)) < 40, "test premise: the plain run repeats a token"
    for params in (
        long.replace(repetition_penalty=1.8),
        long.replace(frequency_penalty=2.0),
        long.replace(presence_penalty=2.0),
    ):
        pen = await engine.generate(req(PROMPTS[0], params))
        assert len(set(pen.output_ids)) > len(set(plain.output_ids)), params


async def test_stop_token_ids_min_new_tokens_ignore_eos(engine: ReferenceEngine) -> None:
    base = await engine.generate(req(PROMPTS[0]))
    stop = base.output_ids[3]
    first = base.output_ids.index(stop)
    g = await engine.generate(req(PROMPTS[0], GREEDY.replace(ignore_eos=False, stop_token_ids=(stop,))))
    assert g.finish_reason is FinishReason.STOP
    assert g.matched_stop == stop
    assert g.output_ids == base.output_ids[: first + 1]  # the stop token is included
    ignored = await engine.generate(req(PROMPTS[0], GREEDY.replace(ignore_eos=True, stop_token_ids=(stop,))))
    assert ignored.output_ids == base.output_ids
    assert ignored.finish_reason is FinishReason.LENGTH
    # min_new_tokens masks the stop token until enough tokens were made.
    masked = await engine.generate(
        req(PROMPTS[0], GREEDY.replace(ignore_eos=False, stop_token_ids=(stop,), min_new_tokens=first + 2))
    )
    assert stop not in masked.output_ids[: first + 2]
    assert len(masked.output_ids) >= first + 2


async def test_eos_from_config_stops(engine: ReferenceEngine) -> None:
    assert engine.eos_token_ids == (0,)
    base = await engine.generate(req(PROMPTS[1]))
    # Make the first greedy token "the" EOS by pointing the stop list at it, via stop_token_ids
    # being absent and ignore_eos False: without an EOS in the output, finish is LENGTH.
    g = await engine.generate(req(PROMPTS[1], GREEDY.replace(ignore_eos=False)))
    expected = FinishReason.STOP if 0 in base.output_ids else FinishReason.LENGTH
    assert g.finish_reason is expected


@pytest.mark.parametrize("num_threads", [1, 2])
async def test_thread_count_is_configurable(model_dir: Path, num_threads: int, make_engine: object) -> None:
    engine = ReferenceEngine(model_dir, num_threads=num_threads)
    try:
        a = await run_all(engine)
        b = await run_all(engine)
        assert outputs(a) == outputs(b)
    finally:
        await engine.aclose()
