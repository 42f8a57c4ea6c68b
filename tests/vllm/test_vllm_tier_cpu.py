"""The vLLM GPU tier's CPU-side parts: cross-engine parity (greedy tokens of two engines on the same
weights; where they part, both engines' top logprobs and whether it is a near tie)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import rollout_backends as rb
from rb_bench.vllm_tier import _divergence, cross_engine_parity
from rollout_backends import FinishReason, Generation
from rollout_backends.adapters.reference import ReferenceBackend
from rollout_backends.conformance import default_parity_prompts


def _on(path: Path) -> rb.conformance.BackendFactory:
    async def make() -> rb.RolloutBackend:
        return ReferenceBackend.create(path, workers=1)

    return make


def test_cross_engine_parity(tiny_model: Path, tiny_model_b: Path) -> None:
    prompts = default_parity_prompts(512, n=4)
    same = asyncio.run(
        cross_engine_parity({"a": _on(tiny_model), "b": _on(tiny_model)}, prompts, max_new_tokens=8, near_tie=0.05)
    )
    assert same["identical"] == 4 and same["max_abs_dlogprob"] == 0.0 and same["other_divergences"] == 0
    other = asyncio.run(
        cross_engine_parity({"a": _on(tiny_model), "b": _on(tiny_model_b)}, prompts, max_new_tokens=8, near_tie=0.05)
    )
    assert other["identical"] < 4 and other["other_divergences"] >= 1  # other weights: not near ties
    case = next(c for c in other["cases"] if not c["identical"])
    assert len(case["top"]) == 2 and case["tokens"][0] != case["tokens"][1] and len(case["gaps"]) == 2


def _gen(ids: tuple[int, ...], tops: tuple[tuple[tuple[int, float], ...], ...]) -> Generation:
    return Generation(
        request_id="r",
        output_ids=ids,
        logprobs=tuple(t[0][1] if t[0][0] == i else -5.0 for i, t in zip(ids, tops, strict=True)),
        finish_reason=FinishReason.LENGTH,
        weight_version=None,
        prompt_tokens=1,
        top_logprobs=tops,
    )


def test_a_divergence_is_a_near_tie_only_where_both_sides_say_so() -> None:
    tie_a = _gen((5, 6), (((5, -0.1),), ((6, -0.70), (7, -0.72))))
    tie_b = _gen((5, 7), (((5, -0.1),), ((7, -0.70), (6, -0.71))))
    assert _divergence(tie_a, tie_b, 0.05)["near_tie"] is True
    far_b = _gen((5, 7), (((5, -0.1),), ((7, -0.1), (6, -2.0))))
    assert _divergence(tie_a, far_b, 0.05)["near_tie"] is False  # b's pick is not near a's
    assert _divergence(tie_a, tie_a, 0.05) == {"identical": True, "max_abs_dlogprob": 0.0}


def test_a_three_way_tie_is_judged_from_top_logprobs_past_the_second() -> None:
    # The H100 case of 2026-12-05 (prompt 4): SGLang picked 436 with 388 and 155 next, vLLM tied 155 and 436.
    a = _gen((5, 436), (((5, -0.1),), ((436, -2.0098), (388, -2.0723), (155, -2.0750))))
    b = _gen((5, 155), (((5, -0.1),), ((155, -2.0275), (436, -2.0275), (388, -2.5))))
    case = _divergence(a, b, 0.1)
    assert case["near_tie"] is True and case["gaps"] == [pytest.approx(0.0652), 0.0], case
    assert _divergence(a, b, 0.05)["near_tie"] is False  # SGLang's gap 0.065 is over 0.05


def test_the_near_tie_gap_defaults_to_the_engines_measured_disagreement(tiny_model: Path) -> None:
    prompts = default_parity_prompts(512, n=2)
    same = asyncio.run(cross_engine_parity({"a": _on(tiny_model), "b": _on(tiny_model)}, prompts, max_new_tokens=4))
    assert same["near_tie_gap"] == 0.05 and same["top_logprobs"] == 5  # identical engines: the floor
