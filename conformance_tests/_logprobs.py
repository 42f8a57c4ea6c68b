"""Logprobs beyond the sampled token: top-k alternatives per output token (issue 17, item 4)."""

from __future__ import annotations

import math

from rollout_backends import Capabilities, FinishReason, GenerateRequest, Generation, RolloutBackend, SamplingParams

from ._core import CheckContext, Requirement, _Requires, check, expect
from ._harness import Harness

__all__ = ["check_prompt_logprobs_rescore", "check_stop_strings", "check_top_logprobs"]

#: The k the checks ask for (at most what the backend declares).
_TOP_K = 5


def _top_declared(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    if not c.logprobs:
        return "capability logprobs=True not declared"
    return None if c.top_logprobs >= 1 else "capability top_logprobs >= 1 not declared"


def _prompt_declared(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    if not c.logprobs:
        return "capability logprobs=True not declared"
    return None if c.prompt_logprobs else "capability prompt_logprobs=True not declared"


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


async def _rescore(ctx: CheckContext, seq: tuple[int, ...], start: int) -> Generation:
    req = GenerateRequest(
        input_ids=seq,
        sampling=SamplingParams(max_new_tokens=0, temperature=0.0),
        request_id=ctx.request_id("rescore"),
        prompt_logprobs_start=start,
    )
    got = await ctx.backend.generate(req)
    rid = req.request_id
    expect(got.request_id == rid, f"{rid}: answered as {got.request_id!r}")
    expect(got.output_ids == (), f"{rid}: max_new_tokens=0 generated {list(got.output_ids)}")
    expect(got.finish_reason is FinishReason.LENGTH, f"{rid}: finish {got.finish_reason.value!r}, want 'length'")
    expect(got.prompt_tokens == len(seq), f"{rid}: prompt_tokens={got.prompt_tokens}, sent {len(seq)}")
    lps = got.prompt_logprobs
    expect(lps is not None, f"{rid}: prompt_logprobs_start={start} but no prompt_logprobs")
    assert lps is not None
    expect(len(lps) == len(seq) - start, f"{rid}: {len(lps)} prompt logprobs from {start} of {len(seq)} tokens")
    expect(lps[0] is None, f"{rid}: the first scored position has logprob {lps[0]!r}, want None (SGLang's shape)")
    for i, lp in enumerate(lps[1:], 1):
        expect(isinstance(lp, float) and math.isfinite(lp) and lp <= 1e-6, f"{rid}: prompt logprob {i} is {lp!r}")
    return got


@check("logprobs")
@_Requires([Requirement("prompt_logprobs", _prompt_declared)])
async def check_prompt_logprobs_rescore(ctx: CheckContext) -> None:
    """Re-scoring prompt + output of a greedy generation (``max_new_tokens=0``, prompt logprobs from
    the last prompt token, as Miles' --recompute-logprobs-via-prefill sends it) gives the
    generation's own logprobs at the output positions; from 0 it gives the same numbers; prompt
    logprobs asked with a generation do not change its tokens."""
    tol = ctx.harness.logprob_tolerance
    worst = 0.0
    for p in ctx.prompts(3, min_len=2, max_len=20):
        g = await ctx.generate(p, ctx.greedy(10, ignore_eos=True))
        assert g.logprobs is not None
        seq = tuple(p) + g.output_ids
        tail = await _rescore(ctx, seq, len(p) - 1)
        whole = await _rescore(ctx, seq, 0)
        assert tail.prompt_logprobs is not None and whole.prompt_logprobs is not None
        for j, lp in enumerate(g.logprobs):
            again, full = tail.prompt_logprobs[1 + j], whole.prompt_logprobs[len(p) + j]
            assert again is not None and full is not None
            worst = max(worst, abs(again - lp), abs(full - lp))
            expect(
                abs(again - lp) <= tol and abs(full - lp) <= tol,
                f"output token {j} ({g.output_ids[j]}): generated with logprob {lp!r}, re-scored {again!r} "
                f"(from {len(p) - 1}) and {full!r} (from 0)",
            )
        # The prompt part agrees between the two starts as well.
        for j in range(len(p) - 1, len(seq)):
            a, b = whole.prompt_logprobs[j], tail.prompt_logprobs[j - (len(p) - 1)]
            if a is not None and b is not None:
                worst = max(worst, abs(a - b))
                expect(abs(a - b) <= tol, f"position {j}: {a!r} from 0, {b!r} from {len(p) - 1}")
        # Prompt logprobs with a real generation: same tokens, prompt logprobs as re-scored.
        req = GenerateRequest(
            input_ids=p,
            sampling=ctx.greedy(10, ignore_eos=True),
            request_id=ctx.request_id("with-prompt"),
            prompt_logprobs_start=0,
        )
        both = await ctx.backend.generate(req)
        expect(both.output_ids == g.output_ids, f"{req.request_id}: prompt logprobs changed the greedy tokens")
        expect(
            both.prompt_logprobs is not None and len(both.prompt_logprobs) == len(p),
            f"{req.request_id}: prompt logprobs {both.prompt_logprobs!r} for a {len(p)}-token prompt",
        )
        assert both.prompt_logprobs is not None
        for j in range(1, len(p)):
            a, b = both.prompt_logprobs[j], whole.prompt_logprobs[j]
            assert a is not None and b is not None
            expect(abs(a - b) <= tol, f"{req.request_id}: prompt position {j}: {a!r}, re-scored {b!r}")
    ctx.measure("max_abs_dlogprob", worst)


def _stops_declared(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    return None if c.stop_strings else "capability stop_strings=True not declared"


#: A stop string no tiny model writes: a run with it has text and ends on its own terms.
_NEVER = "\u2603" * 64


def _pick_stop(text: str) -> tuple[str, int] | None:
    """Two ASCII letters or digits of ``text`` past its start (where the first occurrence is)."""
    for i in range(2, len(text) - 1):
        sub = text[i : i + 2]
        if sub.isascii() and sub.isalnum() and text.find(sub) == i:
            return sub, i
    return None


@check("contract")
@_Requires([Requirement("stop_strings", _stops_declared)])
async def check_stop_strings(ctx: CheckContext) -> None:
    """A stop string taken from a greedy run's text ends the same run there (SGLang's semantics):
    finish 'stop' with the string as matched_stop, the ids a prefix of the free run's ending with
    the token that completes it (one token fewer has not met it), the text cut before it (kept
    with no_stop_trim)."""
    checked = 0
    for p in ctx.prompts(6, min_len=3, max_len=16, seed=5):
        n = ctx.cap_new_tokens(len(p), 24)
        free = await ctx.generate(p, ctx.greedy(n, stop=(_NEVER,)))
        expect(free.text is not None, f"{free.request_id}: a request with stop strings got no text")
        assert free.text is not None
        expect(free.matched_stop != _NEVER, f"{free.request_id}: matched a stop string it does not contain")
        picked = _pick_stop(free.text)
        if picked is None:
            continue
        sub, pos = picked
        for keep in (False, True):
            g = await ctx.generate(p, ctx.greedy(n, stop=(_NEVER, sub), no_stop_trim=keep))
            rid = g.request_id
            expect(
                g.finish_reason is FinishReason.STOP,
                f"{rid}: stop {sub!r} in {free.text!r}: finish {g.finish_reason.value!r}",
            )
            expect(g.matched_stop == sub, f"{rid}: matched_stop {g.matched_stop!r}, want {sub!r}")
            expect(free.output_ids[: len(g.output_ids)] == g.output_ids, f"{rid}: ids are not the free run's prefix")
            want = free.text[: pos + len(sub)] if keep else free.text[:pos]
            expect(g.text == want, f"{rid}: text {g.text!r}, want {want!r} (no_stop_trim={keep})")
        if len(g.output_ids) > 1:
            short = await ctx.generate(p, ctx.greedy(len(g.output_ids) - 1, stop=(sub,)))
            expect(
                short.finish_reason is not FinishReason.STOP or short.matched_stop != sub,
                f"{short.request_id}: {sub!r} already matched one token before the token completing it",
            )
            expect(short.text is None or sub not in short.text, f"{short.request_id}: text {short.text!r} has {sub!r}")
        checked += 1
    if not checked:
        ctx.skip("no greedy run's text has two ASCII letters to stop on")
    ctx.measure("stops_checked", checked)
