"""Health (live, ready, progress, staleness) and bad input (``InvalidRequest``, then still healthy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout_backends import GenerateRequest, InvalidRequest, PauseMode, SamplingParams, StaleWeights

from ._core import CheckContext, CheckFailed, check, expect, requires

__all__ = [
    "check_health_live_ready",
    "check_health_paused_not_ready",
    "check_health_progress_probe",
    "check_reject_bad_max_new_tokens",
    "check_reject_empty_prompt",
    "check_reject_out_of_vocab",
    "check_reject_prompt_too_long",
    "check_reject_unknown_sampling_key",
    "check_staleness_visible",
]


@check("health")
async def check_health_live_ready(ctx: CheckContext) -> None:
    """``health()`` lists every worker live and ready; ``wait_ready`` returns at once."""
    report = await ctx.backend.health()
    ids = tuple(w.worker for w in report.workers)
    expect(ids == ctx.backend.workers, f"health lists workers {ids}, the backend has {ctx.backend.workers}")
    expect(report.live and report.ready, f"not live/ready: {report}")
    expect(report.router_live is not False, "the router is reported down")
    for w in report.workers:
        expect(w.making_progress is None, f"{w.worker}: making_progress={w.making_progress} without probe=True")
        expect(not w.stale, f"{w.worker}: stale on a fresh backend")
    ready = await ctx.backend.wait_ready(timeout=10.0)
    expect(ready.ready, "wait_ready returned a report that is not ready")


@check("health")
@requires(progress_probe=True)
async def check_health_progress_probe(ctx: CheckContext) -> None:
    """``health(probe=True)`` runs a generation on every worker: ``making_progress`` is True for each."""
    report = await ctx.backend.health(probe=True)
    for w in report.workers:
        expect(
            w.making_progress is True, f"{w.worker}: making_progress={w.making_progress} with probe=True ({w.error})"
        )


@check("health")
@requires(any_pause_mode=True)
async def check_health_paused_not_ready(ctx: CheckContext) -> None:
    """A paused worker is live but not ready; after resume it is ready again."""
    mode = next(
        m for m in (PauseMode.RETRACT, PauseMode.ABORT, PauseMode.IN_PLACE) if m in ctx.capabilities.pause_modes
    )
    target = ctx.backend.workers[0]
    await ctx.backend.pause(mode, workers=[target])
    try:
        report = await ctx.backend.health()
        w = report.worker(target)
        expect(w.live, f"{target}: not live while paused")
        expect(not w.ready, f"{target}: ready while paused ({mode.value})")
        for other in report.workers:
            if other.worker != target:
                expect(other.ready, f"{other.worker}: not ready although only {target} was paused")
    finally:
        await ctx.backend.resume(workers=[target])
    report = await ctx.backend.health()
    expect(report.ready, f"not ready after resume: {report.unhealthy_workers}")


@check("health")
@requires(min_workers=2)
async def check_staleness_visible(ctx: CheckContext) -> None:
    """One worker relabelled (``workers=[w0]``) while the others missed it: the mismatch shows as ``stale``.

    With ``expect_version`` (``HttpFleetBackend``; not part of the protocol) the new version is
    declared expected, so the workers that missed it are the stale ones. Without it, whichever side
    the report's ``expected_version`` names, the other side must be stale. ``weight_version()``
    raises ``StaleWeights`` while workers disagree.
    """
    b: Any = ctx.backend
    workers = ctx.backend.workers
    declare = getattr(b, "expect_version", None)
    previous = dict(await ctx.backend.weight_versions())
    try:
        await ctx.backend.set_weight_version("conformance-new", workers=[workers[0]])
        if callable(declare):
            declare("conformance-new")
        report = await ctx.backend.health()
        served = {w.worker: w.weight_version for w in report.workers}
        expect(served[workers[0]] == "conformance-new", f"the updated worker serves {served[workers[0]]!r}")
        expected = report.expected_version
        expect(expected is not None, "health() has no expected_version while workers serve different versions")
        if callable(declare):
            expect(expected == "conformance-new", f"expected_version={expected!r} after expect_version()")
        want = {w for w, v in served.items() if v != expected}
        ctx.measure("stale", ",".join(sorted(report.stale_workers)))
        expect(want, f"no worker differs from expected_version={expected!r}: {served}")
        expect(set(report.stale_workers) == want, f"stale {report.stale_workers}, want {sorted(want)} ({served})")
        try:
            await ctx.backend.weight_version()
        except StaleWeights as exc:
            expect(set(exc.served) == set(workers), f"StaleWeights.served names {sorted(exc.served)}")
        else:
            raise CheckFailed("weight_version() did not raise StaleWeights while workers disagree")
    finally:
        if callable(declare):
            declare(None)
        for worker, old in previous.items():
            if old is not None:
                await ctx.backend.set_weight_version(old, workers=[worker])
    report = await ctx.backend.health()
    expect(not report.stale_workers, f"still stale after restoring: {report.stale_workers}")


async def _rejected(ctx: CheckContext, what: str, make: Callable[[], Any]) -> InvalidRequest:
    """``make()`` (which may build and send a request) raises ``InvalidRequest``; then still healthy."""
    try:
        result = make()
        if hasattr(result, "__await__"):
            result = await result
    except InvalidRequest as exc:
        ctx.measure(f"{what}_field", exc.field)
        err = exc
    else:
        raise CheckFailed(f"{what}: accepted (returned {type(result).__name__}), want InvalidRequest")
    gen = await ctx.generate(ctx.prompts(1, seed=123)[0], ctx.greedy(4, ignore_eos=True))
    expect(len(gen.output_ids) == 4, f"after {what}: no normal generation")
    report = await ctx.backend.health()
    expect(report.ready, f"after {what}: not ready ({report.unhealthy_workers})")
    return err


@check("bad_input")
@requires(vocab_size=True)
async def check_reject_out_of_vocab(ctx: CheckContext) -> None:
    """A prompt with an id >= vocab size is an ``InvalidRequest`` naming ``input_ids``; the backend stays healthy."""
    vocab = ctx.vocab_size
    assert vocab is not None
    for bad in (vocab, vocab + 1000):
        req = ctx.request((1, 2, bad))
        err = await _rejected(ctx, "out_of_vocab", lambda: ctx.backend.generate(req))  # noqa: B023
        expect(err.field.startswith("input_ids"), f"InvalidRequest field {err.field!r}, want input_ids[...]")


@check("bad_input")
async def check_reject_empty_prompt(ctx: CheckContext) -> None:
    """An empty prompt is an ``InvalidRequest`` (at request construction); the backend stays healthy."""
    await _rejected(ctx, "empty_prompt", lambda: ctx.backend.generate(GenerateRequest(input_ids=())))


@check("bad_input")
async def check_reject_bad_max_new_tokens(ctx: CheckContext) -> None:
    """``max_new_tokens`` of 0 or < 0 is an ``InvalidRequest``; the backend stays healthy."""
    for n in (0, -1):

        def make(n: int = n) -> Any:
            return ctx.backend.generate(ctx.request((1, 2, 3), SamplingParams(max_new_tokens=n)))

        err = await _rejected(ctx, f"max_new_tokens_{n}", make)
        expect("max_new_tokens" in err.field, f"InvalidRequest field {err.field!r}")


@check("bad_input")
@requires(max_context=True)
async def check_reject_prompt_too_long(ctx: CheckContext) -> None:
    """A prompt longer than the context is an ``InvalidRequest``; the backend stays healthy."""
    limit = ctx.max_context
    assert limit is not None
    lo, hi = ctx.token_range()
    prompt = tuple(lo + i % (hi - lo) for i in range(limit + 1))
    await _rejected(ctx, "prompt_too_long", lambda: ctx.backend.generate(ctx.request(prompt)))


@check("bad_input")
async def check_reject_unknown_sampling_key(ctx: CheckContext) -> None:
    """``SamplingParams.from_mapping`` with an unknown key is an ``InvalidRequest`` naming the key."""
    err = await _rejected(
        ctx, "unknown_key", lambda: SamplingParams.from_mapping({"max_new_tokens": 4, "beam_width": 3})
    )
    expect("beam_width" in err.field, f"InvalidRequest field {err.field!r} does not name the key")
