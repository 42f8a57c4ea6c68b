"""Parity compares the top alternatives and the prompt's logprobs where both backends return them."""

from __future__ import annotations

import attrs

from rollout_backends import FinishReason, Generation
from rollout_backends.conformance import check_parity, pair_parity
from rollout_backends.testing import fake_factory

TOL = 1e-3


def _gen(top: tuple[tuple[tuple[int, float], ...], ...] | None, prompt: tuple[float | None, ...] | None) -> Generation:
    return Generation(
        request_id="r",
        output_ids=(4, 5),
        logprobs=(-0.1, -0.2),
        finish_reason=FinishReason.LENGTH,
        prompt_tokens=3,
        weight_version="v0",
        top_logprobs=top,
        prompt_logprobs=prompt,
    )


TOP = (((4, -0.1), (9, -2.0), (8, -3.0)), ((5, -0.2), (7, -1.5), (6, -4.0)))
PROMPT = (None, -1.25, -2.5)


def test_equal_alternatives_and_prompt_pass_and_are_reported() -> None:
    p = pair_parity("a", "b", [_gen(TOP, PROMPT)], [_gen(TOP, PROMPT)], TOL)
    assert p.ok and p.top_logprobs_compared == 3 and p.prompt_logprobs_compared
    m = p.result().measurements
    assert m["max_abs_dtop_logprob"] == 0 and m["max_abs_dprompt_logprob"] == 0


def test_a_different_alternative_fails() -> None:
    other = (TOP[0], ((5, -0.2), (7, -1.5), (3, -2.0)))  # 3 at -2.0 is no tie with 6 at -4.0
    p = pair_parity("a", "b", [_gen(TOP, None)], [_gen(other, None)], TOL)
    assert not p.ok and p.top_mismatch == (0, 1) and "alternatives differ" in p.result().message


def test_a_tie_at_the_cut_off_may_be_cut_either_way() -> None:
    a = (((4, -0.1), (9, -2.0), (8, -3.0)),) * 2
    b = (((4, -0.1), (9, -2.0), (1, -3.0)),) * 2  # 1 and 8 tied at the k-th place
    p = pair_parity("a", "b", [_gen(a, None)], [_gen(b, None)], TOL)
    assert p.ok, p.result().message


def test_shifted_alternative_logprob_fails() -> None:
    off = (((4, -0.1), (9, -2.1), (8, -3.0)), TOP[1])
    p = pair_parity("a", "b", [_gen(TOP, None)], [_gen(off, None)], TOL)
    assert not p.ok and p.max_abs_dtop_logprob > TOL and "top logprob" in p.result().message


def test_prompt_logprob_difference_fails() -> None:
    p = pair_parity("a", "b", [_gen(None, PROMPT)], [_gen(None, (None, -1.25, -2.4))], TOL)
    assert not p.ok and p.prompt_logprobs_compared and "prompt logprob" in p.result().message


def test_nothing_to_compare_on_one_side_is_reported_not_failed() -> None:
    p = pair_parity("a", "b", [_gen(TOP, PROMPT)], [_gen(None, None)], TOL)
    assert p.ok and p.top_logprobs_compared == 0 and not p.prompt_logprobs_compared


async def test_check_parity_asks_fakes_for_alternatives_and_prompt_logprobs() -> None:
    report = await check_parity({"x": fake_factory(), "y": fake_factory()}, max_new_tokens=4)
    gens = report.outputs["x"]
    assert all(g.top_logprobs is not None and len(g.top_logprobs[0]) >= 1 for g in gens)
    assert all(g.prompt_logprobs is not None for g in gens)
    (pair,) = report.pairs
    assert pair.ok and pair.top_logprobs_compared >= 1 and pair.prompt_logprobs_compared
    # A different engine's alternatives are seen: evolve one side's top logprobs.
    moved = [
        attrs.evolve(g, top_logprobs=tuple(((t[0][0], t[0][1] - 0.5),) for t in g.top_logprobs or ())) for g in gens
    ]
    assert not pair_parity("x", "y", gens, moved, TOL).ok
