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


async def test_prompt_logprobs_and_zero_budget_rescoring(engine: ReferenceEngine) -> None:
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    g = await engine.generate(GenerateRequest(input_ids=PROMPT, sampling=greedy))
    seq = PROMPT + g.output_ids
    start = len(PROMPT) - 1
    zero = SamplingParams(max_new_tokens=0)
    r = await engine.generate(GenerateRequest(input_ids=seq, sampling=zero, prompt_logprobs_start=start))
    assert r.output_ids == () and r.logprobs == () and r.prompt_tokens == len(seq)
    assert r.prompt_logprobs is not None and len(r.prompt_logprobs) == len(seq) - start
    assert r.prompt_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(r.prompt_logprobs[1:], g.logprobs or (), strict=True)) < 1e-4  # type: ignore[operator]
    # With a generation: its own numbers are those of a request without prompt logprobs, bit for bit.
    both = await engine.generate(GenerateRequest(input_ids=PROMPT, sampling=greedy, prompt_logprobs_start=0))
    assert both.output_ids == g.output_ids and both.logprobs == g.logprobs
    assert both.prompt_logprobs is not None and len(both.prompt_logprobs) == len(PROMPT)
    whole = await engine.generate(GenerateRequest(input_ids=seq, sampling=zero, prompt_logprobs_start=0))
    assert whole.prompt_logprobs is not None

    # Other sequence lengths: the same numbers up to float32 rounding (other matmul shapes).
    def close(a: tuple[float | None, ...], b: tuple[float | None, ...]) -> bool:
        pairs = list(zip(a, b, strict=True))
        both_none = all((x is None) == (y is None) for x, y in pairs)
        return both_none and all(abs(x - y) < 1e-5 for x, y in pairs if x is not None and y is not None)

    assert close(both.prompt_logprobs, whole.prompt_logprobs[: len(PROMPT)])
    assert close(whole.prompt_logprobs[start:][1:], r.prompt_logprobs[1:])


async def test_stop_strings_as_sglang(engine: ReferenceEngine) -> None:
    """SGLang 0.5.16's rule: the tail window's text; the completing token kept; ignore_eos keeps them;
    the text cut before the string (after it with no_stop_trim)."""
    assert engine.has_tokenizer
    never = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, stop=("\u2603" * 8,))
    free = await engine.generate(GenerateRequest(input_ids=PROMPT, sampling=never))
    assert free.text is not None and free.finish_reason.value == "length"
    sub = next(free.text[i : i + 2] for i in range(2, len(free.text) - 1) if free.text[i : i + 2].isalpha())
    pos = free.text.find(sub)
    for keep in (False, True):
        g = await engine.generate(
            GenerateRequest(input_ids=PROMPT, sampling=never.replace(stop=(sub,), no_stop_trim=keep))
        )
        assert g.finish_reason.value == "stop" and g.matched_stop == sub
        assert free.output_ids[: len(g.output_ids)] == g.output_ids
        assert g.text == (free.text[: pos + len(sub)] if keep else free.text[:pos])
    plain = await engine.generate(GenerateRequest(input_ids=PROMPT, sampling=never.replace(stop=())))
    assert plain.output_ids == free.output_ids and plain.text is None  # text only with stop strings


def test_stop_limits() -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(stop=[f"s{i}" for i in range(33)])
    assert e.value.field == "sampling.stop"
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(stop=["x" * 513])
    assert e.value.field == "sampling.stop[0]"
