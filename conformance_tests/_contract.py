"""Data-plane contract: shapes, logprobs, finish reasons, sampling knobs, groups, concurrency."""

from __future__ import annotations

import asyncio
import math

from rollout_backends import FinishReason, GenerateRequest, Generation, SamplingParams, generate_group

from ._core import (
    CheckContext,
    CheckFailed,
    check,
    compare,
    expect,
    requires,
    validate_generation,
)

__all__ = [
    "check_concurrent_equals_sequential",
    "check_concurrent_requests_complete",
    "check_continuation_consistent",
    "check_finish_length",
    "check_finish_stop_token",
    "check_generate_group",
    "check_greedy_logprob_bound",
    "check_greedy_repeatable",
    "check_greedy_shapes",
    "check_ignore_eos",
    "check_max_new_tokens",
    "check_seeded_sampling",
]


@check("contract")
async def check_greedy_shapes(ctx: CheckContext) -> None:
    """Greedy generations have aligned ids/logprobs, finite logprobs <= 0, a finish reason, counts, a version."""
    prompts = ctx.prompts(6, min_len=1, max_len=40)
    gens = await ctx.generate_all(prompts)  # validate_generation runs on each
    ctx.measure("tokens", sum(len(g.output_ids) for g in gens))
    expect(any(g.output_ids for g in gens), "no generation produced any token")
    # Without logprobs requested the ids are the same (greedy) and logprobs may be omitted.
    p = prompts[0]
    req = GenerateRequest(input_ids=p, sampling=ctx.greedy(), request_id=ctx.request_id("nolp"), return_logprobs=False)
    bare = await ctx.backend.generate(req)
    validate_generation(ctx, req, bare)
    if ctx.capabilities.greedy_decoding:
        expect(bare.output_ids == gens[0].output_ids, "return_logprobs=False changed the greedy output ids")


@check("contract")
@requires(greedy_decoding=True)
async def check_greedy_repeatable(ctx: CheckContext) -> None:
    """The same greedy request twice gives the same ids, and logprobs within the tolerance."""
    prompts = ctx.prompts(4, max_len=32)
    first = await ctx.generate_all(prompts, ctx.greedy(16))
    second = await ctx.generate_all(prompts, ctx.greedy(16))
    compare(second, first, what="second greedy run vs first", tolerance=ctx.harness.logprob_tolerance, ctx=ctx)


@check("contract")
@requires(greedy_decoding=True)
async def check_continuation_consistent(ctx: CheckContext) -> None:
    """Greedy ``prompt + output[:k]`` with one new token gives ``output[k]`` and ``logprobs[k]``.

    For several ``k`` (0 included: the first token against a one-token request), within
    ``Harness.logprob_tolerance`` (the cache-hit tolerance: the continuation reuses the prompt's
    KV). An adapter that reports logprobs one position off and pads the end (``logprobs[i]`` of
    ``output[i+1]``), or drops or reorders prompt tokens, fails here with no harness. A near tie
    (another token, with a logprob within the tolerance of ``logprobs[k]``) is recorded, not failed.
    """
    tol = ctx.harness.logprob_tolerance
    worst, compared, ties = 0.0, 0, 0
    for i, prompt in enumerate(ctx.prompts(3, min_len=2, max_len=16, seed=13)):
        n = ctx.cap_new_tokens(len(prompt), 12)
        base = await ctx.generate(prompt, ctx.greedy(n, ignore_eos=True), tag=f"base{i}")
        out = base.output_ids
        for k in sorted({0, 1, len(out) // 2, len(out) - 1} & set(range(len(out)))):
            one = await ctx.generate(prompt + out[:k], ctx.greedy(1, ignore_eos=True), tag=f"k{k}")
            got_lp = one.logprobs[0] if one.logprobs else None
            want_lp = base.logprobs[k] if base.logprobs is not None else None
            delta = abs(got_lp - want_lp) if got_lp is not None and want_lp is not None else None
            where = f"prompt {i} ({len(prompt)} tokens) + the first {k} output tokens"
            if one.output_ids[0] != out[k]:
                if delta is not None and delta <= tol:
                    ties += 1  # two tokens within the tolerance of each other: a near tie
                    continue
                raise CheckFailed(
                    f"{where}: greedy gives token {one.output_ids[0]} (logprob {got_lp}), but the run that "
                    f"produced them continued with {out[k]} (logprob {want_lp}) at position {k}"
                )
            compared += 1
            if delta is not None:
                worst = max(worst, delta)
                expect(
                    delta <= tol,
                    f"{where}: token {out[k]} has logprob {got_lp:.6g} as the next token but {want_lp:.6g} as "
                    f"logprobs[{k}] of the longer run (|Δ| {delta:.3g} > tolerance {tol:.3g}): logprobs are not "
                    "aligned with their tokens",
                )
    ctx.measure("positions", compared)
    ctx.measure("near_ties", ties)
    ctx.measure("max_abs_dlogprob", worst)
    expect(compared > 0, "no position could be compared (every one was a near tie)")


@check("contract")
@requires(logprobs=True, vocab_size=True, greedy_decoding=True)
async def check_greedy_logprob_bound(ctx: CheckContext) -> None:
    """A greedy token is the most likely one, so its logprob is >= -log(vocab size).

    The largest of V probabilities is at least 1/V (within ``Harness.logprob_tolerance``). An
    adapter that reports logprobs one position late (``logprobs[0]`` the prompt's last token's,
    ``logprobs[i]`` that of ``output[i-1]``) passes the continuation check, whose requests are
    shifted alike, but fails here: the last token of a pseudo-random prompt is unlikely, mostly
    far below 1/V, and it is reported as the greedy token's.
    """
    vocab = ctx.vocab_size
    assert vocab is not None
    floor = -math.log(vocab) - ctx.harness.logprob_tolerance
    lowest = 0.0
    for i, prompt in enumerate(ctx.prompts(8, min_len=1, max_len=24, seed=17)):
        gen = await ctx.generate(prompt, ctx.greedy(ctx.cap_new_tokens(len(prompt), 4), ignore_eos=True))
        assert gen.logprobs is not None  # validate_generation: logprobs are declared
        for j, lp in enumerate(gen.logprobs):
            lowest = min(lowest, lp)
            expect(
                lp >= floor,
                f"prompt {i}: greedy token {gen.output_ids[j]} at position {j} has logprob {lp:.6g} < "
                f"-log(vocab {vocab}) = {-math.log(vocab):.6g}: a greedy token cannot be that unlikely (is the "
                "logprob another position's?)",
            )
    ctx.measure("lowest_greedy_logprob", lowest)
    ctx.measure("floor", floor)


@check("contract")
async def check_finish_length(ctx: CheckContext) -> None:
    """``max_new_tokens`` reached ends with finish 'length' and exactly that many tokens (ignore_eos)."""
    gen = await ctx.generate(ctx.prompts(1)[0], ctx.greedy(5, ignore_eos=True))
    expect(gen.finish_reason is FinishReason.LENGTH, f"finish {gen.finish_reason.value!r}, want 'length'")
    expect(len(gen.output_ids) == 5, f"{len(gen.output_ids)} tokens, want 5")


@check("contract")
async def check_max_new_tokens(ctx: CheckContext) -> None:
    """``max_new_tokens`` in {1, 2, 7, 13} is honoured exactly (ignore_eos); shorter runs are prefixes of longer."""
    prompt = ctx.prompts(1, seed=3)[0]
    runs = {}
    for n in (1, 2, 7, 13):
        gen = await ctx.generate(prompt, ctx.greedy(n, ignore_eos=True))
        expect(len(gen.output_ids) == n, f"max_new_tokens={n}: got {len(gen.output_ids)} tokens")
        expect(gen.finish_reason is FinishReason.LENGTH, f"max_new_tokens={n}: finish {gen.finish_reason.value!r}")
        runs[n] = gen
    if not ctx.capabilities.greedy_decoding:
        return  # random tokens: no run is a prefix of another
    longest = runs[13].output_ids
    for n, gen in runs.items():
        expect(longest[:n] == gen.output_ids, f"greedy max_new_tokens={n} is not a prefix of max_new_tokens=13")


async def _stop_candidate(ctx: CheckContext, *, ignore_eos: bool) -> tuple[tuple[int, ...], Generation, int, int]:
    """A prompt, its greedy run, a token of that run before any EOS, and the index it first appears at."""
    for seed in range(8):
        prompt = ctx.prompts(1, seed=100 + seed)[0]
        base = await ctx.generate(prompt, ctx.greedy(16, ignore_eos=ignore_eos))
        # A natural STOP ends on an EOS token: pick the stop token before it.
        out = base.output_ids[:-1] if base.finish_reason is FinishReason.STOP else base.output_ids
        if len(out) >= 2:
            token = out[len(out) // 2]
            return prompt, base, token, out.index(token)
    raise CheckFailed("could not get a greedy run of >= 2 tokens before an EOS in 8 prompts")


@check("contract")
@requires(greedy_decoding=True)
async def check_finish_stop_token(ctx: CheckContext) -> None:
    """A stop token id seen in a greedy run ends the run there: finish 'stop', the stop token included."""
    prompt, base, token, idx = await _stop_candidate(ctx, ignore_eos=False)
    gen = await ctx.generate(prompt, ctx.greedy(16, stop_token_ids=(token,)))
    ctx.measure("stop_index", idx)
    expect(gen.finish_reason is FinishReason.STOP, f"finish {gen.finish_reason.value!r}, want 'stop' at token {token}")
    expect(
        gen.output_ids == base.output_ids[: idx + 1],
        f"stop at {token}: got {list(gen.output_ids)}, want {list(base.output_ids[: idx + 1])}",
    )
    if gen.matched_stop is not None:
        expect(gen.matched_stop == token, f"matched_stop={gen.matched_stop}, want {token}")


@check("contract")
@requires(greedy_decoding=True)
async def check_ignore_eos(ctx: CheckContext) -> None:
    """``ignore_eos`` runs to ``max_new_tokens`` through stop tokens (and through an EOS if one is met)."""
    prompt, base, token, _ = await _stop_candidate(ctx, ignore_eos=True)
    gen = await ctx.generate(prompt, ctx.greedy(16, ignore_eos=True, stop_token_ids=(token,)))
    expect(gen.finish_reason is FinishReason.LENGTH, f"ignore_eos with stop token: finish {gen.finish_reason.value!r}")
    expect(gen.output_ids == base.output_ids, "ignore_eos + stop_token_ids changed the greedy ids")
    # Opportunistic EOS probe: a prompt whose greedy run stops by itself must go on with ignore_eos.
    for p in ctx.prompts(6, seed=7):
        natural = await ctx.generate(p, ctx.greedy(32))
        if natural.finish_reason is FinishReason.STOP:
            n = len(natural.output_ids)
            forced = await ctx.generate(p, ctx.greedy(n + 4, ignore_eos=True))
            ctx.measure("eos_probe", "stopped naturally, checked")
            expect(len(forced.output_ids) == n + 4, f"ignore_eos stopped after {len(forced.output_ids)} tokens")
            expect(forced.output_ids[:n] == natural.output_ids, "ignore_eos changed the ids before the EOS")
            return
    ctx.measure("eos_probe", "no natural EOS met")


@check("contract")
@requires(seeded_sampling=True)
async def check_seeded_sampling(ctx: CheckContext) -> None:
    """Same seed → same sampled ids (alone and among other requests); different seeds differ."""
    prompt = ctx.prompts(1, seed=5)[0]
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=1234)
    a = await ctx.generate(prompt, sp)
    b = await ctx.generate(prompt, sp)
    compare([b], [a], what="seed 1234 twice", tolerance=ctx.harness.logprob_tolerance, ctx=ctx)
    others = [
        ctx.request(p, SamplingParams(temperature=1.0, max_new_tokens=16, seed=7)) for p in ctx.prompts(3, seed=6)
    ]
    mine = ctx.request(prompt, sp)
    gens = await asyncio.gather(ctx.backend.generate(mine), *(ctx.backend.generate(r) for r in others))
    validate_generation(ctx, mine, gens[0])
    compare([gens[0]], [a], what="seed 1234 among other requests vs alone", tolerance=ctx.harness.logprob_tolerance)
    variants = {a.output_ids}
    for seed in (1, 2, 3):
        variants.add((await ctx.generate(prompt, sp.replace(seed=seed))).output_ids)
    ctx.measure("distinct_of_4_seeds", len(variants))
    expect(len(variants) > 1, "four different seeds gave the same 16 sampled tokens (is the seed ignored?)")


@check("contract")
async def check_generate_group(ctx: CheckContext) -> None:
    """``generate_group`` returns n valid samples with distinct ids; seeded groups repeat exactly."""
    prompt = ctx.prompts(1, seed=9)[0]
    sp = SamplingParams(temperature=1.0, max_new_tokens=ctx.harness.max_new_tokens, ignore_eos=True)
    group = await generate_group(ctx.backend, prompt, 4, sp, base_seed=100, group_id=ctx.request_id("group"))
    expect(len(group) == 4, f"{len(group)} samples, want 4")
    expect(len({g.request_id for g in group}) == 4, "samples share a request id")
    for i, g in enumerate(group):
        req = GenerateRequest(input_ids=prompt, sampling=sp.replace(seed=100 + i), request_id=g.request_id)
        validate_generation(ctx, req, g)
        expect(len(g.output_ids) == sp.max_new_tokens, f"sample {i}: {len(g.output_ids)} tokens")
    if ctx.capabilities.seeded_sampling:
        again = await generate_group(ctx.backend, prompt, 4, sp, base_seed=100, group_id=ctx.request_id("group"))
        compare(again, group, what="seeded group run twice", tolerance=ctx.harness.logprob_tolerance, ctx=ctx)
        expect(len({g.output_ids for g in group}) > 1, "4 samples with seeds 100..103 are all identical")


@check("contract")
async def check_concurrent_requests_complete(ctx: CheckContext) -> None:
    """``Harness.concurrency`` requests sent at once all complete with valid, full-length answers."""
    n = ctx.harness.concurrency
    prompts = ctx.prompts(n, min_len=1, max_len=48, seed=12)
    sp = ctx.greedy(ctx.harness.max_new_tokens, ignore_eos=True)
    reqs = [ctx.request(p, sp, "load") for p in prompts]
    gens = await asyncio.gather(*(ctx.backend.generate(r) for r in reqs))
    for r, g in zip(reqs, gens, strict=True):
        validate_generation(ctx, r, g)  # finish 'length' => all max_new_tokens (or the context) produced
        expect(
            g.finish_reason is FinishReason.LENGTH, f"{r.request_id}: finish {g.finish_reason.value} with ignore_eos"
        )
    ctx.measure("requests", n)


@check("contract")
@requires(batch_invariant=True)
async def check_concurrent_equals_sequential(ctx: CheckContext) -> None:
    """``Harness.concurrency`` greedy requests sent at once equal the same requests sent one by one."""
    n = ctx.harness.concurrency
    prompts = ctx.prompts(n, min_len=1, max_len=48, seed=11)
    sp = ctx.greedy(ctx.harness.max_new_tokens)
    sequential = await ctx.generate_all(prompts, sp)
    reqs = [ctx.request(p, sp, "conc") for p in prompts]
    concurrent = await asyncio.gather(*(ctx.backend.generate(r) for r in reqs))
    for r, g in zip(reqs, concurrent, strict=True):
        validate_generation(ctx, r, g)
    ctx.measure("requests", n)
    compare(
        list(concurrent),
        sequential,
        what=f"{n} concurrent vs sequential",
        tolerance=ctx.harness.logprob_tolerance,
        ctx=ctx,
    )
