"""Logprobs beyond the sampled token: top-k alternatives per output token (issue 17, item 4)."""

from __future__ import annotations

import math

from rollout_backends import Capabilities, Generation, RolloutBackend

from ._core import CheckContext, Requirement, _Requires, check, expect
from ._harness import Harness

__all__ = ["check_top_logprobs"]

#: The k the checks ask for (at most what the backend declares).
_TOP_K = 5


def _top_declared(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    if not c.logprobs:
        return "capability logprobs=True not declared"
    return None if c.top_logprobs >= 1 else "capability top_logprobs >= 1 not declared"


def _check_top_shape(ctx: CheckContext, gen: Generation, k: int, tol: float) -> float:
    """Shape and greedy consistency of ``gen.top_logprobs``; returns the largest |logprob - top|."""
    rid = gen.request_id
    tops = gen.top_logprobs
    expect(tops is not None, f"{rid}: top_logprobs requested but None")
    assert tops is not None and gen.logprobs is not None
    expect(
        len(tops) == len(gen.output_ids), f"{rid}: {len(tops)} top_logprobs entries for {len(gen.output_ids)} tokens"
    )
    vocab = ctx.vocab_size
    want = k if vocab is None else min(k, vocab)
    worst = 0.0
    for i, (tok, lp, top) in enumerate(zip(gen.output_ids, gen.logprobs, tops, strict=True)):
        expect(len(top) == want, f"{rid}: token {i} has {len(top)} top logprobs, want {want}")
        ids = [t for t, _ in top]
        lps = [v for _, v in top]
        expect(len(set(ids)) == len(ids), f"{rid}: token {i}: repeated ids in its top logprobs {ids}")
        expect(all(math.isfinite(v) and v <= 1e-6 for v in lps), f"{rid}: token {i}: top logprobs {lps} not <= 0")
        expect(lps == sorted(lps, reverse=True), f"{rid}: token {i}: top logprobs not most likely first: {lps}")
        # Greedy: the chosen token is the most likely one, and its logprob is the top one.
        expect(tok in ids, f"{rid}: greedy token {i} ({tok}) is not in its top-{k} {ids}")
        mine = lps[ids.index(tok)]
        worst = max(worst, abs(mine - lp), abs(lps[0] - lp))
        expect(
            abs(mine - lp) <= tol and abs(lps[0] - lp) <= tol,
            f"{rid}: greedy token {i}: logprob {lp!r}, its top-k entry {mine!r}, the top-k max {lps[0]!r}",
        )
    return worst


@check("logprobs")
@_Requires([Requirement("top_logprobs >= 1", _top_declared)])
async def check_top_logprobs(ctx: CheckContext) -> None:
    """``top_logprobs=k`` gives, per output token, k distinct (id, logprob) pairs, most likely first; for
    greedy decoding the chosen token is in them and its logprob is their max; asking does not change
    the tokens."""
    k = min(_TOP_K, ctx.capabilities.top_logprobs)
    tol = ctx.harness.logprob_tolerance
    prompts = ctx.prompts(3, min_len=2, max_len=24)
    plain = await ctx.generate_all(prompts, ctx.greedy(12))
    with_top = await ctx.generate_all(prompts, ctx.greedy(12, top_logprobs=k))
    worst = 0.0
    for p, g in zip(plain, with_top, strict=True):
        expect(g.output_ids == p.output_ids, f"{g.request_id}: top_logprobs={k} changed the greedy tokens")
        worst = max(worst, _check_top_shape(ctx, g, k, tol))
    ctx.measure("k", k)
    ctx.measure("max_abs_dlogprob_vs_top", worst)
    # Without top_logprobs none come back (the field stays None).
    expect(all(p.top_logprobs is None for p in plain), "top_logprobs came back although not asked for")
