"""Weight versions per request: constraints (issue 17 item 2: ``GenerateRequest.min_version`` /
``exact_version``) and per-token versions (item 1: ``Generation.version_spans``).

A request goes only to a worker whose installed label satisfies it ("later" is the order of the
fleet's history of installed labels); where none does the answer is ``NoCompatibleVersion``,
retryable, with nothing generated. Both checks relabel workers (``set_weight_version``, no weight
load) and put the labels back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rollout_backends import (
    Capabilities,
    GenerateRequest,
    Generation,
    NoCompatibleVersion,
    PauseMode,
    RolloutBackend,
    VersionSource,
    WeightTransport,
)

from ._core import (
    CheckContext,
    CheckFailed,
    HarnessError,
    Requirement,
    _Requires,
    check,
    expect,
    requires,
    validate_generation,
)
from ._harness import Harness
from ._weights import _alt_loader, _restore, _update

__all__ = [
    "check_min_version_after_partial_update",
    "check_unknown_exact_version_is_retryable",
    "check_stream_version_spans_across_in_place_update",
    "check_stream_version_spans_across_update",
    "check_version_spans_across_in_place_update",
    "check_version_spans_across_update",
    "check_version_spans_quiet",
]

#: A label no fleet has installed (the check never installs it).
_NEVER = "conformance-never-installed"
#: The label one worker gets in the partial update.
_NEW = "conformance-v2"


def _constraints_declared(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    return None if c.version_constraints else "capability version_constraints=True not declared"


_constraints = _Requires([Requirement("version_constraints=True", _constraints_declared)])


async def _constrained(
    ctx: CheckContext, *, min_version: str | None = None, exact_version: str | None = None
) -> Generation:
    prompt = ctx.prompts(1, seed=17)[0]
    base = ctx.request(prompt, ctx.greedy(4, ignore_eos=True), "versioned")
    req = GenerateRequest(
        input_ids=base.input_ids,
        sampling=base.sampling,
        request_id=base.request_id,
        return_logprobs=base.return_logprobs,
        min_version=min_version,
        exact_version=exact_version,
    )
    gen = await ctx.backend.generate(req)
    validate_generation(ctx, req, gen)
    return gen


@check("versions")
@_constraints
async def check_unknown_exact_version_is_retryable(ctx: CheckContext) -> None:
    """``exact_version`` of a label no worker has: ``NoCompatibleVersion`` (a retryable
    ``TransientError`` with ``nothing_generated``, naming the wanted version), not a generation."""
    try:
        gen = await _constrained(ctx, exact_version=_NEVER)
    except NoCompatibleVersion as exc:
        expect(exc.retryable, "NoCompatibleVersion is not retryable")
        expect(exc.nothing_generated, "NoCompatibleVersion.nothing_generated is False")
        expect(exc.exact_version == _NEVER, f"NoCompatibleVersion.exact_version={exc.exact_version!r}")
        expect(set(exc.served) == set(ctx.backend.workers), f"served names {sorted(exc.served)}")
        ctx.measure("served", ",".join(f"{w}={v}" for w, v in sorted(exc.served.items())))
    else:
        raise CheckFailed(f"exact_version={_NEVER!r} was served (by {gen.worker}, version {gen.weight_version!r})")
    # The unconstrained path still serves.
    gen = await ctx.generate(ctx.prompts(1, seed=18)[0], ctx.greedy(4, ignore_eos=True))
    expect(len(gen.output_ids) == 4, "no normal generation after the refusal")


@check("versions")
@requires(min_workers=2)
@_constraints
async def check_min_version_after_partial_update(ctx: CheckContext) -> None:
    """After a partial update (one worker relabelled ``conformance-v2``), every ``min_version`` request
    for it lands on that worker and reports it at start and end (or, on a fleet that cannot pin,
    is refused with ``NoCompatibleVersion``); ``exact_version`` of the old label avoids it."""
    backend = ctx.backend
    workers = backend.workers
    target = workers[-1]
    previous = dict(await backend.weight_versions())
    try:
        for worker, old in previous.items():  # every worker labelled: the old label is in the history
            await backend.set_weight_version(old or "conformance-v1", workers=[worker])
        labels = dict(await backend.weight_versions())
        await backend.set_weight_version(_NEW, workers=[target])
        landed = []
        for _ in range(2 * len(workers)):
            try:
                gen = await _constrained(ctx, min_version=_NEW)
            except NoCompatibleVersion:
                expect(
                    not ctx.capabilities.worker_pinning,
                    f"min_version={_NEW!r} refused although {target} serves it and the fleet can pin",
                )
                ctx.measure("refused_without_pinning", True)
                return
            landed.append(gen.worker)
            expect(gen.worker in (None, target), f"min_version={_NEW!r} served by {gen.worker}, not {target}")
            expect(gen.weight_version == _NEW, f"min_version={_NEW!r} served at version {gen.weight_version!r}")
            expect(gen.version_at_start == _NEW, f"min_version={_NEW!r}: version_at_start={gen.version_at_start!r}")
        ctx.measure("landed", ",".join(sorted({str(w) for w in landed})))
        old = labels[workers[0]]
        if old is not None and old != _NEW:
            gen = await _constrained(ctx, exact_version=old)
            expect(gen.worker != target, f"exact_version={old!r} served by {target}, which serves {_NEW!r}")
            expect(gen.weight_version == old, f"exact_version={old!r} served at version {gen.weight_version!r}")
    finally:
        for worker, old in previous.items():
            if old is not None:
                await backend.set_weight_version(old, workers=[worker])


def _spans_declared(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    if c.version_spans is not VersionSource.NONE:
        return None
    return "capability version_spans not declared (it is NONE: answers carry no per-token versions)"


def _engine_spans(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    if c.version_spans is VersionSource.RESPONSE:
        return None
    return "capability version_spans=RESPONSE not declared (spans across an update come only from an engine)"


@check("versions")
@_Requires([Requirement("version_spans declared", _spans_declared)])
async def check_version_spans_quiet(ctx: CheckContext) -> None:
    """With no update in flight, every generation is one span of the version it reports:
    ``version_spans == ((0, weight_version),)`` and ``version_at_start == weight_version``."""
    for i, prompt in enumerate(ctx.prompts(3, seed=23)):
        gen = await ctx.generate(prompt, ctx.greedy(6, ignore_eos=True))
        rid = gen.request_id
        expect(gen.weight_version is not None, f"{rid}: version_spans declared, but no weight_version")
        expect(
            gen.version_spans == ((0, gen.weight_version),),
            f"{rid}: version_spans {gen.version_spans!r}, want one span of {gen.weight_version!r}",
        )
        expect(gen.version_at_start == gen.weight_version, f"{rid}: version_at_start={gen.version_at_start!r}")
        ctx.measure(f"spans_{i}", len(gen.version_spans or ()))


def _update_while_parked(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    if c.update_while_parked:
        return None
    return "capability update_while_parked not declared (a RETRACT update with requests parked is refused)"


#: What a check of spans across a RETRACT update needs: the update completes with the request
#: parked (tokens after it are the new weights' own, their KV recomputed, so each new span can be
#: held against a fresh engine), and the alt weights.
_ACROSS_RETRACT = _Requires(
    [
        *requires(
            pause_mode=PauseMode.RETRACT,
            any_transport=(WeightTransport.DISK, WeightTransport.TENSOR),
            hooks=("alt_weights_path", "fresh_factory_on"),
        ).reqs,
        Requirement("update_while_parked", _update_while_parked),
    ]
)
#: Across an IN_PLACE update the tokens after it are the new weights' over the old weights' KV,
#: which no fresh engine reproduces: the boundary is held against the uninterrupted run instead.
_ACROSS_IN_PLACE = requires(
    pause_mode=PauseMode.IN_PLACE,
    any_transport=(WeightTransport.DISK, WeightTransport.TENSOR),
    hooks=("alt_weights_path",),
)


def _stream_spans(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    missing = [name for name in ("streaming", "stream_version_spans") if not getattr(c, name)]
    if not missing:
        return None
    return f"capabilit{'ies' if len(missing) > 1 else 'y'} {' and '.join(f'{m}=True' for m in missing)} not declared"


_engine_spans_req = _Requires([Requirement("version_spans=RESPONSE", _engine_spans)])
_stream_spans_req = _Requires([Requirement("stream_version_spans", _stream_spans)])


def _streamed(ctx: CheckContext) -> Callable[[GenerateRequest], asyncio.Task[Generation]]:
    """Start a request as a stream; its task is the final chunk's generation."""

    async def streamed(request: GenerateRequest) -> Generation:
        async with ctx.backend.stream(request) as chunks:
            async for chunk in chunks:
                if chunk.final is not None:
                    return chunk.final
        raise CheckFailed(f"{request.request_id}: the stream ended without its final chunk")

    return lambda request: ctx.track(asyncio.ensure_future(streamed(request)))


@check("versions")
@_ACROSS_RETRACT
@_engine_spans_req
async def check_version_spans_across_update(ctx: CheckContext) -> None:
    """A greedy request in flight across a weight update (``weight_update(mode=RETRACT)`` to the alt
    weights) holds tokens of both versions: its spans start with the old version and end with the
    new one, the old span equals the same request run before the update, and each new-version span
    equals a fresh engine on the new weights given the tokens before it."""
    await _spans_across_update(ctx, ctx.start, PauseMode.RETRACT)


@check("versions")
@_ACROSS_RETRACT
@_stream_spans_req
async def check_stream_version_spans_across_update(ctx: CheckContext) -> None:
    """``version_spans_across_update`` for a *streamed* request: the engine's per-chunk versions
    put together give spans starting with the old version and ending with the new, each
    new-version span equal to a fresh engine on the new weights given the tokens before it."""
    await _spans_across_update(ctx, _streamed(ctx), PauseMode.RETRACT)


@check("versions")
@_ACROSS_IN_PLACE
@_engine_spans_req
async def check_version_spans_across_in_place_update(ctx: CheckContext) -> None:
    """A greedy request frozen in place across a weight update (``weight_update(mode=IN_PLACE)``
    to the alt weights) holds tokens of both versions, and the boundary is exact: the old span
    equals the same request run before the update, and the first token of the new span does not
    (it is the alt weights' own; the alt weights are another model, so a late stamp shows as an
    old-span token that differs from the run before, an early one as a new span that starts on it)."""
    await _spans_across_update(ctx, ctx.start, PauseMode.IN_PLACE)


@check("versions")
@_ACROSS_IN_PLACE
@_stream_spans_req
async def check_stream_version_spans_across_in_place_update(ctx: CheckContext) -> None:
    """``version_spans_across_in_place_update`` for a *streamed* request: the spans the fleet
    puts together from the chunks' versions change exactly where the tokens did."""
    await _spans_across_update(ctx, _streamed(ctx), PauseMode.IN_PLACE)


async def _spans_across_update(
    ctx: CheckContext, start: Callable[[GenerateRequest], asyncio.Task[Generation]], mode: PauseMode
) -> None:
    prompt = ctx.prompts(1, min_len=6, max_len=12, seed=29)[0]
    req = ctx.long_request(prompt, ctx.harness.pause_max_new_tokens, tag="spans")
    n = req.sampling.max_new_tokens
    before = await ctx.generate(prompt, ctx.greedy(n, ignore_eos=True))  # the old weights, uninterrupted
    old = before.weight_version
    previous = dict(await ctx.backend.weight_versions())
    new = "conformance-spans"
    try:
        task = start(req)
        await ctx.let_run()
        if task.done():
            raise HarnessError(f"the {n}-token request finished before the update: raise Harness.pause_max_new_tokens")
        await _update(ctx, new, _alt_loader(ctx), mode)
        gen = await asyncio.wait_for(asyncio.shield(task), 60.0)
        validate_generation(ctx, req, gen)
        spans = gen.version_spans
        expect(spans is not None, f"{gen.request_id}: no version_spans although the engine declares them")
        assert spans is not None
        ctx.measure("spans", ",".join(f"{at}:{v}" for at, v in spans))
        versions = [v for _, v in spans]
        expect(len(spans) >= 2, f"in flight across the update, yet one span: {spans!r}")
        expect(versions[0] == old and versions[-1] == new, f"spans {spans!r}: want {old!r} first, {new!r} last")
        expect(gen.version_at_start == old, f"version_at_start={gen.version_at_start!r}, want {old!r}")
        expect(gen.weight_version == new, f"weight_version={gen.weight_version!r}, want {new!r}")
        ends = [at for at, _ in spans[1:]] + [len(gen.output_ids)]
        k = ends[0]
        expect(gen.output_ids[:k] == before.output_ids[:k], f"the first {k} tokens ({old!r}) differ from a run before")
        if mode is PauseMode.IN_PLACE:
            await _expect_new_from(ctx, gen, before, k, new)
        else:
            await _expect_spans_match_fresh(ctx, prompt, gen, spans, ends, new)
    finally:
        await _restore(ctx, previous)


async def _expect_new_from(ctx: CheckContext, gen: Generation, before: Generation, k: int, new: str) -> None:
    """The first token labelled ``new`` is not the uninterrupted run's: it came from the new weights.

    An independent model's greedy token equals the old one's by chance at about one position in
    the vocabulary size (the suite's alt weights are another seed's random model), so a span
    that starts on the old token is an early stamp, not a coincidence."""
    ctx.measure("boundary", k)
    expect(
        gen.output_ids[k] != before.output_ids[k],
        f"token {k}, the first labelled {new!r}, is {gen.output_ids[k]}: the old weights' token there "
        f"(the run before the update), so the span starts too early",
    )


async def _expect_spans_match_fresh(
    ctx: CheckContext,
    prompt: tuple[int, ...],
    gen: Generation,
    spans: tuple[tuple[int, str], ...],
    ends: list[int],
    new: str,
) -> None:
    fresh_on, path = ctx.harness.fresh_factory_on, ctx.harness.alt_weights_path
    assert fresh_on is not None and path is not None
    fresh = await fresh_on(path)()
    try:
        for (at, version), end in zip(spans, ends, strict=True):
            if version != new:
                continue
            cont = ctx.request(prompt + gen.output_ids[:at], ctx.greedy(end - at, ignore_eos=True), "fresh")
            want = await fresh.generate(cont)
            expect(
                gen.output_ids[at:end] == want.output_ids,
                f"span ({at}, {version!r}) tokens {gen.output_ids[at:end]} differ from a fresh engine on the "
                f"new weights given the {at} tokens before it: {want.output_ids}",
            )
    finally:
        await fresh.aclose()
