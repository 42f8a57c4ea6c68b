"""Weight labels against the weights they label, with no harness (issue 29 item 1).

An adapter that moves the version label before the new weights load, or keeps the old label on
answers of the new weights, passes every check that compares a label with a label; it is seen
only where an answer's tokens can be told to be one version's weights. The suite makes such
weights itself from the served checkpoint (``Harness.base_weights_path``, else
``Capabilities.model_path``, where it is a folder on this host): a copy with pairs of token ids
swapped in the embedding and the LM head (``Harness.permute_vocabulary``). That model answers a
prompt with its ids swapped exactly as the served one answers the original, with the ids of its
answer swapped and the same logprobs, so what the new weights must answer is known before they are
loaded, without running them: no alt weights and no fresh-engine oracle.
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
from collections.abc import Mapping
from pathlib import Path

import attrs

from rollout_backends import Generation, SamplingParams, WeightTransport

from ._core import (
    CheckContext,
    CheckFailed,
    HarnessError,
    check,
    compare,
    expect,
    requires,
    served_checkpoint,
)
from ._weights import Loader, _default_mode, _loader_for, _restore

__all__ = ["check_labels_follow_weights"]

#: The label of the permuted weights.
_PERMUTED = "conformance-permuted"
#: Tokens per answer.
_TOKENS = 8


def _swap_pairs(ctx: CheckContext) -> list[tuple[int, int]]:
    """Pairs of the prompt-token range, shuffled (one id may be left alone)."""
    lo, hi = ctx.token_range()
    ids = list(range(lo, hi))
    random.Random(f"{ctx.name}:swap").shuffle(ids)
    return [(ids[i], ids[i + 1]) for i in range(0, len(ids) - 1, 2)]


def _image(gen: Generation, swap: Mapping[int, int]) -> Generation:
    """What the permuted weights answer where the served ones answered ``gen``."""
    tops = gen.top_logprobs
    return attrs.evolve(
        gen,
        output_ids=tuple(swap.get(t, t) for t in gen.output_ids),
        top_logprobs=None if tops is None else tuple(tuple((swap.get(t, t), lp) for t, lp in pos) for pos in tops),
    )


async def _derive(ctx: CheckContext, src: str, dst: str) -> dict[int, int]:
    """Write the permuted copy of ``src`` to ``dst``; returns the swap. Skips where ``src`` cannot be
    used (too large, not a checkpoint the harness's ``permute_vocabulary`` reads)."""
    size = sum(p.stat().st_size for p in Path(src).rglob("*") if p.is_file())
    limit = ctx.harness.max_derived_bytes
    if size > limit:
        ctx.skip(f"the served checkpoint {src} is {size / 2**30:.1f} GiB, over Harness.max_derived_bytes")
    pairs = _swap_pairs(ctx)
    try:
        await asyncio.to_thread(ctx.harness.permute_vocabulary, src, dst, pairs)
    except (ValueError, ImportError) as exc:
        ctx.skip(f"cannot derive weights from the served checkpoint: {exc}")
    except Exception as exc:
        raise HarnessError(f"Harness.permute_vocabulary({src!r}) raised {type(exc).__name__}: {exc}") from exc
    swap: dict[int, int] = {}
    for a, b in pairs:
        swap[a], swap[b] = b, a
    return swap


@attrs.frozen
class _Book:
    """The prompts (closed under the swap), what each set of weights answers them, and which
    prompts tell the two apart."""

    prompts: tuple[tuple[int, ...], ...]
    served: Mapping[tuple[int, ...], Generation]
    permuted: Mapping[tuple[int, ...], Generation]

    def informative(self, prompt: tuple[int, ...]) -> bool:
        return self.served[prompt].output_ids != self.permuted[prompt].output_ids


class _Judge:
    """Holds each answer served after an update against the weights its label names."""

    def __init__(self, ctx: CheckContext, book: _Book, labels: Mapping[str, Mapping[tuple[int, ...], Generation]]):
        self.ctx, self.book, self.labels = ctx, book, labels
        self.judged = 0
        self.unjudged = 0

    def _holds(self, gen: Generation, want: Generation) -> bool:
        try:
            compare(
                [gen], [want], what="", tolerance=self.ctx.harness.logprob_tolerance, near_ties=self.ctx.near_ties()
            )
        except CheckFailed:
            return False
        return True

    def __call__(self, prompt: tuple[int, ...], gen: Generation, target: str) -> None:
        """``gen`` answered ``prompt`` after the update to ``target`` completed: it is labelled
        ``target`` and holds those weights. Where the answer may have begun before (its spans or
        start version say another version), it is not judged."""
        spans = gen.version_spans
        label = gen.weight_version
        if (spans is not None and len(spans) > 1) or (gen.version_at_start not in (None, label) and spans is None):
            self.unjudged += 1
            return
        rid = gen.request_id
        other = next(v for v in self.labels if v != target)
        if not self.book.informative(prompt):
            expect(label == target, f"{rid}: served after the update to {target!r}, labelled {label!r}")
            return
        self.judged += 1
        mine, theirs = self.labels[target][prompt], self.labels[other][prompt]
        if self._holds(gen, mine):
            expect(
                label == target,
                f"{rid}: holds the weights of {target!r} (the update just made), yet is labelled {label!r}: "
                "a stale label",
            )
        elif self._holds(gen, theirs):
            if label == target:
                raise CheckFailed(
                    f"{rid}: labelled {target!r}, but holds the weights it replaced ({other!r}'s tokens "
                    f"{list(gen.output_ids)}): the label moved before the weights loaded"
                )
            raise CheckFailed(
                f"{rid}: after the update to {target!r} the answer holds the weights of {other!r} and their label: "
                "the update did not load"
            )
        else:
            tol = self.ctx.harness.logprob_tolerance
            compare([gen], [mine], what=f"{rid}: labelled {label!r}, vs the weights of {target!r}", tolerance=tol)
            raise CheckFailed(f"{rid}: labelled {label!r}, holds neither the weights of {target!r} nor of {other!r}")


def _sampling(ctx: CheckContext) -> SamplingParams:
    return ctx.greedy(_TOKENS, ignore_eos=True, top_logprobs=2 if ctx.near_ties() else 0)


async def _book(ctx: CheckContext, swap: Mapping[int, int], label: str) -> _Book:
    base = ctx.prompts(3, min_len=4, max_len=16, seed=401)
    prompts = tuple(dict.fromkeys([*base, *(tuple(swap.get(t, t) for t in p) for p in base)]))
    gens = await ctx.generate_all(prompts, _sampling(ctx))
    served = dict(zip(prompts, gens, strict=True))
    wrong = {g.weight_version for g in gens} - {label}
    expect(not wrong, f"before any update answers carry {sorted(map(str, wrong))}, weight_version() is {label!r}")
    permuted = {p: _image(served[tuple(swap.get(t, t) for t in p)], swap) for p in prompts}
    book = _Book(prompts=prompts, served=served, permuted=permuted)
    told = sum(book.informative(p) for p in prompts)
    ctx.measure("prompts_told_apart", f"{told} of {len(prompts)}")
    if told < 2:
        ctx.skip(f"the permuted weights answer {len(prompts) - told} of {len(prompts)} prompts as the served ones")
    return book


async def _update_and_judge(ctx: CheckContext, judge: _Judge, target: str, loader: Loader) -> None:
    """Update to ``target`` with prompts sent while paused (the first answers after it), then the
    prompts again; every answer must be labelled ``target`` and hold its weights."""
    prompts = judge.book.prompts
    sp = _sampling(ctx)
    waiting: list[tuple[tuple[int, ...], asyncio.Task[Generation]]] = []
    mode = _default_mode(ctx)
    assert mode is not None  # any_pause_mode is required
    async with ctx.backend.weight_update(target, mode=mode) as tx:
        for p in prompts:
            waiting.append((p, ctx.start(ctx.request(p, sp, "waiting"))))
        await asyncio.sleep(ctx.harness.wait_s)  # they reach the engines, which hold them
        await loader(tx)
    for p, task in waiting:
        judge(p, await asyncio.wait_for(task, 60.0), target)
    for p, gen in zip(prompts, await ctx.generate_all(prompts, sp), strict=True):
        judge(p, gen, target)


@check("weights")
@requires(
    any_transport=(WeightTransport.DISK, WeightTransport.TENSOR),
    any_pause_mode=True,
    versioned=True,
    greedy_decoding=True,
    served_checkpoint=True,
)
async def check_labels_follow_weights(ctx: CheckContext) -> None:
    """Every answer is labelled with the version whose weights it holds, told apart with no
    harness: the suite derives other weights from the served checkpoint (token ids swapped in pairs,
    so their answers are known in advance), updates to them (prompts sent while paused, then
    again), and back to the served weights under the old label. An answer labelled new that holds
    the old weights (the label moved before the weights loaded), or one labelled old that holds the
    new weights (a stale label), fails."""
    src = served_checkpoint(ctx.capabilities, ctx.harness)
    assert src is not None
    old = await ctx.backend.weight_version()
    if old is None:
        ctx.skip("the backend serves no version label yet (weight_version() is None)")
    new = _PERMUTED if old != _PERMUTED else f"{_PERMUTED}-2"  # left over by a run that was cut short
    previous = dict(await ctx.backend.weight_versions())
    done = False
    with tempfile.TemporaryDirectory(prefix="rb-conformance-", dir=ctx.harness.scratch_dir) as tmp:
        dst = os.path.join(tmp, "permuted")
        swap = await _derive(ctx, src, dst)
        try:
            # The served weights are exactly the checkpoint's (a shared server may hold others).
            await _restore(ctx, previous)
            book = await _book(ctx, swap, old)
            judge = _Judge(ctx, book, {old: book.served, new: book.permuted})
            await _update_and_judge(ctx, judge, new, _loader_for(ctx, dst))
            await _update_and_judge(ctx, judge, old, _loader_for(ctx, src))
            done = True
        finally:
            if not done:
                await ctx.settle()  # a failure left answers in flight: the engines must be idle to load
                await _restore(ctx, previous)
    ctx.measure("answers_judged", judge.judged)
    ctx.measure("answers_not_judged", judge.unjudged)
    expect(judge.judged, "no answer after the updates could be judged (every one may have begun before)")
