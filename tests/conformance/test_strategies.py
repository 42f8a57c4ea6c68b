"""The exported hypothesis strategies draw only valid values, which a conforming backend serves."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

import rollout_backends as rb
from rollout_backends.conformance import CheckContext, Harness, prompts, sampling_params, validate_generation
from rollout_backends.conformance.strategies import prompts as prompts_direct
from tests.conformance.fake_backend import VOCAB, FakeBackend


def test_lazy_exports_are_the_strategies_module_functions() -> None:
    assert prompts is prompts_direct


@given(prompts(vocab_size=VOCAB, max_len=20, min_len=2), sampling_params(max_new_tokens=6, stop_vocab=VOCAB))
@settings(max_examples=40, deadline=None)
def test_drawn_requests_are_valid_and_served(prompt: tuple[int, ...], sampling: rb.SamplingParams) -> None:
    assert 2 <= len(prompt) <= 20 and all(0 <= t < VOCAB for t in prompt)
    assert 1 <= sampling.max_new_tokens <= 6 and sampling.min_new_tokens <= sampling.max_new_tokens
    backend = FakeBackend(token_delay=0.0)
    ctx = CheckContext(backend=backend, factory=lambda: asyncio.sleep(0, backend), harness=Harness(), name="hypo")
    req = rb.GenerateRequest(input_ids=prompt, sampling=sampling)
    gen = asyncio.run(backend.generate(req))
    validate_generation(ctx, req, gen)


@given(sampling_params(greedy=True, seeded=False), sampling_params(greedy=False, seeded=True))
def test_forced_flags(greedy: rb.SamplingParams, seeded: rb.SamplingParams) -> None:
    assert greedy.greedy and greedy.seed is None
    assert not seeded.greedy and seeded.seed is not None


@given(st.data())
def test_prompt_bounds(data: st.DataObject) -> None:
    p = data.draw(prompts(vocab_size=5, max_len=3, min_id=4))
    assert 1 <= len(p) <= 3 and set(p) == {4}
