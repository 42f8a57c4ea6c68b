"""The reference engine's logprobs beyond the sampled token: top-k alternatives per output token."""

from __future__ import annotations

import math

import pytest

from rollout_backends import GenerateRequest, InvalidRequest, SamplingParams
from rollout_backends.adapters.reference import ReferenceEngine

PROMPT = (5, 6, 7, 8, 9, 10)


async def test_greedy_top_logprobs_lead_with_the_chosen_token(engine: ReferenceEngine) -> None:
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, top_logprobs=4)
    g = await engine.generate(GenerateRequest(input_ids=PROMPT, sampling=sp))
    assert g.top_logprobs is not None and g.logprobs is not None and len(g.top_logprobs) == 8
    for tok, lp, top in zip(g.output_ids, g.logprobs, g.top_logprobs, strict=True):
        assert len(top) == 4 and top[0] == (tok, lp)  # the argmax, bit for bit
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        # the alternatives are a distribution's tail: their mass is below 1
        assert sum(math.exp(v) for _, v in top) <= 1.0 + 1e-6
    plain = await engine.generate(GenerateRequest(input_ids=PROMPT, sampling=sp.replace(top_logprobs=0)))
    assert plain.output_ids == g.output_ids and plain.logprobs == g.logprobs and plain.top_logprobs is None


async def test_sampled_top_logprobs_come_from_the_sampling_distribution(engine: ReferenceEngine) -> None:
    sp = SamplingParams(max_new_tokens=12, temperature=0.7, seed=5, ignore_eos=True, top_logprobs=20)
    g = await engine.generate(GenerateRequest(input_ids=PROMPT, sampling=sp))
    assert g.top_logprobs is not None and g.logprobs is not None
    for tok, lp, top in zip(g.output_ids, g.logprobs, g.top_logprobs, strict=True):
        assert top[0][1] >= lp
        found = dict(top).get(tok)
        assert found is None or found == lp  # the same temperature-scaled tensor
    again = await engine.generate(GenerateRequest(input_ids=PROMPT, sampling=sp.replace(top_logprobs=0)))
    assert again.output_ids == g.output_ids  # asking for them draws nothing extra


def test_limits() -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(top_logprobs=21)
    assert e.value.field == "sampling.top_logprobs"
