"""Sampling parameters: each one shown to change or bound the output (issue 29 item 1).

``temperature``, ``top_k``, ``top_p``, ``min_p``, ``min_new_tokens`` and the three penalties are
sent with every request (``SamplingParams``); an engine that drops one answers as if it had not
been asked, and nothing else in the suite would tell. Each check here asks something whose
answer is known without a harness:

* **filters** (``top_k=1``, ``top_p`` tiny, ``min_p=1``) at temperature 1 keep only the most likely
  token, so the sampled run *is* the greedy run. Were the filter ignored, temperature-1 sampling
  would reproduce the greedy tokens only with probability ``exp(sum of their logprobs)`` (the
  greedy logprobs are the temperature-1 distribution's); the check runs only where that is below
  ``_CHANCE`` and reports it (``log10_chance_if_ignored``). The sampled logprobs equal the greedy
  ones where they are unfiltered (SGLang's); where the backend declares
  ``Capabilities.filtered_logprobs`` (vLLM's ``processed_logprobs``: renormalised over the tokens
  the filter kept) each is 0 instead, the one token kept having probability 1, which also shows
  the filter took effect;
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

from ._core import _TIE_CEILING, CheckContext, CheckFailed, check, compare, expect, requires

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
    """Top-2 logprobs where a near tie must be told (``CheckContext.near_ties``), or an exact one in
    a filter check under ``filtered_logprobs`` (``_most_kept``)."""
    caps = ctx.capabilities
    tell_ties = ctx.near_ties() or (caps.filtered_logprobs and caps.top_logprobs >= 2)
    return {"top_logprobs": 2} if tell_ties else {}


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
    label = f"{what} at temperature 1 (only the most likely token is kept) vs greedy"
    tol = ctx.harness.logprob_tolerance
    if ctx.capabilities.filtered_logprobs:
        _kept_only_the_top(ctx, sampled, greedy, label)
        return
    try:
        # min_p=1 keeps every token tied with the best (bf16 logits tie): without top logprobs to
        # show a tie, a first difference that could be one skips (stock dynamo.sglang 1.6.1 parted
        # at position 2 of 8 in min_p on the H200 tier of 2026-12-06, no top logprobs declared).
        told = ctx.near_ties()
        compare(sampled, greedy, what=label, tolerance=tol, ctx=ctx, near_ties=told, ties_unseen=not told)
    except CheckFailed as exc:
        if _all_certain(sampled, greedy, tol):
            raise CheckFailed(
                f"{exc}; every sampled logprob is 0 (within {tol:.3g}) where the greedy run's are not: they are "
                "of the filtered distribution, renormalised (vLLM's --logprobs-mode processed_logprobs), which the "
                "backend does not declare (Capabilities.filtered_logprobs)"
            ) from None
        raise


def _all_certain(sampled: Sequence[Generation], greedy: Sequence[Generation], tol: float) -> bool:
    """Every sampled logprob is 0 within ``tol`` (probability 1), and some greedy one is not."""
    got = [x for g in sampled for x in g.logprobs or ()]
    want = [x for g in greedy for x in g.logprobs or ()]
    return bool(got) and all(x >= -tol for x in got) and any(x < -tol for x in want)


#: The most tokens an exact tie leaves a filter that keeps the most likely one (``top_k=1`` and
#: ``min_p=1`` keep every token tied with it). bf16 logits do tie: the vLLM tier (H100,
#: 2026-12-05 19:12) met one at case 0, position 4 of 8, in ``top_k``.
_MOST_TIED = 3


def _most_kept(g: Generation, k: int, tol: float) -> int:
    """How many tokens such a filter may keep at position ``k`` of the greedy run ``g``: each tied
    token is as likely as ``g``'s, so at most ``1 / p`` of them; one where ``g``'s top logprobs show
    the runner-up more than ``tol`` below (no tie)."""
    tops = g.top_logprobs[k] if g.top_logprobs is not None else ()
    if len(tops) >= 2 and tops[0][1] - tops[1][1] > tol:
        return 1
    lp = (g.logprobs or ())[k]
    return max(1, min(_MOST_TIED, int(math.exp(tol - lp))))


def _parted_at(ctx: CheckContext, i: int, s: Generation, g: Generation, tol: float, what: str) -> int | None:
    """Where the sampled run ``s`` leaves the greedy run ``g`` (``None``: it does not); only at a
    tie the greedy run's top logprobs show (both tokens within ``tol``), else ``CheckFailed``. The
    sampled run's own top logprobs cannot show one: the filter kept one token. Without top logprobs
    a first difference where the greedy pick was at most about one half likely could be a tie: the
    check skips there, saying so (it cannot tell a tie from a bug); a surer pick fails."""
    if s.output_ids == g.output_ids:
        return None
    j = next((k for k, (a, b) in enumerate(zip(s.output_ids, g.output_ids, strict=False)) if a != b), None)
    if j is None:
        raise CheckFailed(f"{what}: case {i} has {len(s.output_ids)} tokens, the greedy run {len(g.output_ids)}")
    tops = dict(g.top_logprobs[j]) if g.top_logprobs is not None else {}
    theirs, ours = g.output_ids[j], s.output_ids[j]
    if ours in tops and theirs in tops and tops[theirs] - tops[ours] <= tol:
        return j
    why = f"token {ours} is not within {tol:.3g} of {theirs} there"
    if not tops:
        # dynamo.vllm 1.4.2 (no top logprobs) parted from greedy at case 0, position 4 of top_k on
        # the H100 tier of 2026-12-06 05:14, where vLLM direct's top logprobs showed an exact bf16
        # tie the day before (_MOST_TIED's note).
        lp = g.logprobs[j] if g.logprobs is not None else None
        if lp is not None and lp <= _TIE_CEILING + tol:
            ctx.skip(
                f"{what}: case {i} parts from the greedy run at position {j} (got {list(s.output_ids)}, want "
                f"{list(g.output_ids)}), where the greedy pick had logprob {lp:.4g} (a tie is possible); without "
                "top logprobs (not declared) a tie cannot be told from a filter that kept another token"
            )
        why = (
            "no top_logprobs to tell a tie, and no logprob for the greedy pick"
            if lp is None
            else f"the greedy pick had logprob {lp:.4g}, above log(1/2) + {tol:.3g}: no other token ties it"
        )
    raise CheckFailed(
        f"{what}: case {i} output ids differ at position {j} (got {list(s.output_ids)}, want "
        f"{list(g.output_ids)}); not a tie in the greedy run: {why}"
    )


def _kept_only_the_top(
    ctx: CheckContext, sampled: Sequence[Generation], greedy: Sequence[Generation], what: str
) -> None:
    """Under ``filtered_logprobs``: the greedy tokens (up to a tie the greedy run shows), each with
    logprob 0 (the one token kept), or ``-log m`` where ``m`` tokens may tie (``_most_kept``)."""
    tol = ctx.harness.logprob_tolerance
    expect(len(sampled) == len(greedy), f"{what}: {len(sampled)} results vs {len(greedy)}")
    worst, ties = 0.0, []
    for i, (s, g) in enumerate(zip(sampled, greedy, strict=True)):
        j = _parted_at(ctx, i, s, g, tol, what)
        if j is not None:
            ties.append(f"case {i} at {j} of {len(g.output_ids)}")
        glps, slps = g.logprobs or (), s.logprobs or ()
        for k in range(len(slps) if j is None else j):
            most = _most_kept(g, k, tol)
            off = min(abs(slps[k] + math.log(m)) for m in range(1, most + 1))
            worst = max(worst, off)
            if off <= tol:
                continue
            tied = f", or -log m for m <= {most} tied tokens" if most > 1 else ""
            cause = (
                f"it is the greedy run's ({glps[k]:.3g}): the logprobs are of the unfiltered distribution "
                "(SGLang's), so filtered_logprobs is declared wrongly"
                if abs(slps[k] - glps[k]) <= tol
                else "the filter did not shape the distribution the logprobs are of"
            )
            raise CheckFailed(
                f"{what}: case {i} position {k}: sampled logprob {slps[k]:.3g}, want 0 within {tol:.3g} (the one "
                f"token kept has probability 1{tied}; the backend declares filtered_logprobs); {cause}"
            )
    ctx.measure("max_abs_dlogprob_vs_kept", worst)
    if ties:
        ctx.measure("near_tie_at", "; ".join(ties))


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
