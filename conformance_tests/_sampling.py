"""Sampling parameters: each one shown to change or bound the output (issue 29 item 1).

``temperature``, ``top_k``, ``top_p``, ``min_p``, ``min_new_tokens`` and the three penalties are
sent with every request (``SamplingParams``); an engine that drops one answers as if it had not
been asked, and nothing else in the suite would tell. Each check here asks something whose
answer is known without a harness:

* **filters** (``top_k=1``, ``top_p`` tiny, ``min_p=1``) at temperature 1 keep only the most likely
  token, so the sampled run *is* the greedy run. Were the filter ignored, temperature-1 sampling
  would reproduce the greedy tokens only with probability ``exp(sum of their logprobs)`` (the
  greedy logprobs are the temperature-1 distribution's); the check runs only where that is below
  ``_CHANCE`` and reports it (``log10_chance_if_ignored``);
* **temperature** 1 gives other tokens than greedy, judged by the same probability;
* **min_new_tokens** masks stop tokens until that many tokens are out: a stop token the greedy run
  stops at must not end the run before it;
* **penalties** (repetition, frequency, presence, at 2.0) lower the logits of tokens already
  generated (not the prompt's: SGLang's penalizers, ``sglang/srt/sampling/penaltylib``), so on a
  greedy run that repeats a token it was not sure of (probability <= 0.9) the penalised run takes
  another token there or gives it a lower logprob, and a token generated for the first time never
  gets a lower logprob (the others' mass shrinks).

A parameter the backend refuses with ``Unsupported`` is skipped with its message: declared
refusal, not silent neglect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rollout_backends import FinishReason, Generation, SamplingParams, Unsupported

from ._core import CheckContext, CheckFailed, check, compare, expect, requires

__all__ = [
    "check_frequency_penalty",
    "check_min_new_tokens",
    "check_min_p",
    "check_presence_penalty",
    "check_repetition_penalty",
    "check_temperature",
    "check_top_k",
    "check_top_p",
]

#: Largest probability accepted that an ignored parameter still gives what the check wants.
_CHANCE = 1e-6
#: Tokens per run of the filter and temperature checks.
_TOKENS = 8
#: The penalty the penalty checks ask for (SamplingParams' largest).
_PENALTY = 2.0
#: A repeat the model was surer of than this is not used as evidence (the penalty may not move it).
_SURE = math.log(0.9)
#: Greedy runs looked at for a repeat, and their length (the tiny reference model repeats a token
#: within 24 in about half of its runs; within 16 in fewer than one in eight for some seeds).
_CANDIDATES, _RUN = 12, 24

#: A model's tokens, with logprobs to judge them by.
_model = requires(greedy_decoding=True, logprobs=True)


async def _run(
    ctx: CheckContext, prompts: Sequence[tuple[int, ...]], sp: SamplingParams, what: str
) -> list[Generation]:
    """``prompts`` one by one with ``sp`` (seeds 1000, 1001, ... where ``sp`` is sampled); a
    parameter refused with ``Unsupported`` skips the check."""
    out = []
    for i, p in enumerate(prompts):
        one = sp if sp.greedy else sp.replace(seed=1000 + i)
        try:
            out.append(await ctx.generate(p, one))
        except Unsupported as exc:
            ctx.skip(f"{what}: the backend refuses it ({exc})")
    return out


def _top(ctx: CheckContext) -> dict[str, Any]:
    return {"top_logprobs": 2} if ctx.near_ties() else {}


async def _greedy_runs(ctx: CheckContext, seed: int) -> tuple[list[tuple[int, ...]], list[Generation], float]:
    """Greedy runs of a few prompts, and the natural log of the chance that temperature-1 sampling
    gives them all (skips where it is not below ``_CHANCE``: a sampled run cannot be told from it)."""
    prompts = ctx.prompts(4, min_len=2, max_len=16, seed=seed)
    greedy = await _run(ctx, prompts, ctx.greedy(_TOKENS, ignore_eos=True, **_top(ctx)), "greedy")
    chance = sum(sum(g.logprobs or ()) for g in greedy)
    ctx.measure("log10_chance_if_ignored", round(chance / math.log(10), 1))
    if chance > math.log(_CHANCE):
        ctx.skip(
            f"temperature-1 sampling gives the greedy tokens with probability {math.exp(chance):.2g} "
            f"(> {_CHANCE:g}): the model is too sure of them to tell sampling from greedy"
        )
    return prompts, greedy, chance


async def _filter_keeps_only_the_top(ctx: CheckContext, what: str, **param: Any) -> None:
    prompts, greedy, _ = await _greedy_runs(ctx, seed=301)
    sp = SamplingParams(temperature=1.0, max_new_tokens=_TOKENS, ignore_eos=True, **param, **_top(ctx))
    sampled = await _run(ctx, prompts, sp, what)
    compare(
        sampled,
        greedy,
        what=f"{what} at temperature 1 (only the most likely token is kept) vs greedy",
        tolerance=ctx.harness.logprob_tolerance,
        ctx=ctx,
        near_ties=ctx.near_ties(),
    )


@check("sampling")
@_model
async def check_temperature(ctx: CheckContext) -> None:
    """Sampling at temperature 1 does not give the greedy tokens of every run (where that would
    have a chance below 1e-6): the temperature is applied."""
    prompts, greedy, chance = await _greedy_runs(ctx, seed=301)
    sp = SamplingParams(temperature=1.0, max_new_tokens=_TOKENS, ignore_eos=True)
    sampled = await _run(ctx, prompts, sp, "temperature=1.0")
    same = sum(s.output_ids == g.output_ids for s, g in zip(sampled, greedy, strict=True))
    ctx.measure("runs_equal_to_greedy", same)
    expect(
        same < len(prompts),
        f"temperature=1.0 gave the greedy tokens in all {len(prompts)} runs of {_TOKENS} tokens, which sampling "
        f"does with probability 10^{chance / math.log(10):.1f}: the temperature is not applied",
    )


@check("sampling")
@_model
async def check_top_k(ctx: CheckContext) -> None:
    """``top_k=1`` at temperature 1 gives the greedy tokens (only the most likely one is kept)."""
    await _filter_keeps_only_the_top(ctx, "top_k=1", top_k=1)


@check("sampling")
@_model
async def check_top_p(ctx: CheckContext) -> None:
    """``top_p=1e-6`` at temperature 1 gives the greedy tokens (only the most likely one is kept)."""
    await _filter_keeps_only_the_top(ctx, "top_p=1e-06", top_p=1e-6)


@check("sampling")
@_model
async def check_min_p(ctx: CheckContext) -> None:
    """``min_p=1.0`` at temperature 1 gives the greedy tokens (only tokens as likely as the most
    likely one are kept)."""
    await _filter_keeps_only_the_top(ctx, "min_p=1.0", min_p=1.0)


@check("sampling")
@requires(greedy_decoding=True)
async def check_min_new_tokens(ctx: CheckContext) -> None:
    """``min_new_tokens`` holds a stop token back: where a greedy run stops at a stop token, asking
    for more tokens first runs on past it (same tokens before it; no stop token among the first
    ``min_new_tokens``)."""
    for seed in range(8):
        prompt = ctx.prompts(1, min_len=2, max_len=16, seed=310 + seed)[0]
        free = await ctx.generate(prompt, ctx.greedy(12))
        # A token at position 1..3 that first appears there, before any EOS: the greedy run with it
        # as a stop token stops there.
        ids = free.output_ids[:-1] if free.finish_reason is FinishReason.STOP else free.output_ids
        j = next((k for k in range(1, min(4, len(ids))) if ids[k] not in ids[:k]), None)
        if j is not None:
            break
    else:
        raise CheckFailed("8 greedy runs of 12 tokens have no new token at positions 1..3 (cannot pick a stop token)")
    stop = free.output_ids[j]
    stopped = await ctx.generate(prompt, ctx.greedy(16, stop_token_ids=(stop,)))
    expect(
        stopped.finish_reason is FinishReason.STOP and stopped.output_ids == free.output_ids[: j + 1],
        f"with stop token {stop} the greedy run gives {list(stopped.output_ids)} ({stopped.finish_reason.value}), "
        f"want it to stop at position {j}",
    )
    least = j + 4
    try:
        held = await ctx.generate(prompt, ctx.greedy(least + 4, stop_token_ids=(stop,), min_new_tokens=least))
    except Unsupported as exc:
        ctx.skip(f"min_new_tokens={least}: the backend refuses it ({exc})")
    ctx.measure("stop_position", j)
    ctx.measure("tokens", len(held.output_ids))
    out = held.output_ids
    expect(
        len(out) >= least,
        f"min_new_tokens={least} with stop token {stop}: the run ended after {len(out)} tokens "
        f"({held.finish_reason.value}, {list(out)}): min_new_tokens is not applied",
    )
    expect(stop not in out[:least], f"min_new_tokens={least}: stop token {stop} among the first {least}: {list(out)}")
    expect(out[:j] == free.output_ids[:j], f"min_new_tokens changed the tokens before the stop token: {list(out)}")


async def _penalty_changes_repeats(ctx: CheckContext, name: str) -> None:
    """Greedy with ``name`` = 2.0 against greedy without, on runs that repeat a token they were not
    sure of: the first repeat must move (another token, or a lower logprob); no token generated for
    the first time gets a lower logprob before the runs part."""
    tol = ctx.harness.logprob_tolerance
    evidence, moved = 0, 0
    for i, prompt in enumerate(ctx.prompts(_CANDIDATES, min_len=2, max_len=16, seed=320)):
        base = await ctx.generate(prompt, ctx.greedy(_RUN, ignore_eos=True))
        ids, lps = base.output_ids, base.logprobs or ()
        r = next((k for k in range(1, len(ids)) if ids[k] in ids[:k]), None)
        if r is None or lps[r] > _SURE:
            continue  # no repeat, or one the model was too sure of to show the penalty
        evidence += 1
        try:
            pen = await ctx.generate(prompt, ctx.greedy(_RUN, ignore_eos=True, **{name: _PENALTY}))
        except Unsupported as exc:
            ctx.skip(f"{name}={_PENALTY}: the backend refuses it ({exc})")
        part = next((k for k, (a, b) in enumerate(zip(ids, pen.output_ids, strict=False)) if a != b), len(ids))
        plps = pen.logprobs or ()
        for k in range(1, min(part, r + 1)):
            if ids[k] not in ids[:k]:
                expect(
                    plps[k] >= lps[k] - tol,
                    f"prompt {i}: {name}={_PENALTY} lowered the logprob of token {ids[k]} at position {k}, its first "
                    f"occurrence ({lps[k]:.6g} -> {plps[k]:.6g}): a penalty lowers only tokens already generated",
                )
        if part <= r or plps[r] < lps[r] - tol:
            moved += 1
        if evidence == 3:
            break
    ctx.measure("repeats_used", evidence)
    ctx.measure("repeats_moved", moved)
    if not evidence:
        ctx.skip(
            f"no greedy run of {_CANDIDATES} repeats a token within {_RUN} with probability <= 0.9: nothing a "
            "penalty must move"
        )
    expect(
        moved,
        f"{name}={_PENALTY}: in {evidence} greedy runs that repeat a token, the repeat kept its token and logprob "
        f"(within {tol:.3g}): the penalty is not applied",
    )


@check("sampling")
@_model
async def check_repetition_penalty(ctx: CheckContext) -> None:
    """``repetition_penalty=2.0`` moves a greedy run's first repeat of a token (another token or a
    lower logprob), and lowers no token's logprob before it repeats."""
    await _penalty_changes_repeats(ctx, "repetition_penalty")


@check("sampling")
@_model
async def check_frequency_penalty(ctx: CheckContext) -> None:
    """``frequency_penalty=2.0`` moves a greedy run's first repeat of a token (another token or a
    lower logprob), and lowers no token's logprob before it repeats."""
    await _penalty_changes_repeats(ctx, "frequency_penalty")


@check("sampling")
@_model
async def check_presence_penalty(ctx: CheckContext) -> None:
    """``presence_penalty=2.0`` moves a greedy run's first repeat of a token (another token or a
    lower logprob), and lowers no token's logprob before it repeats."""
    await _penalty_changes_repeats(ctx, "presence_penalty")
