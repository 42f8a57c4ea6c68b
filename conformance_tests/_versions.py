"""Version-constrained requests (issue 17 item 2): ``GenerateRequest.min_version`` / ``exact_version``.

A request goes only to a worker whose installed label satisfies it ("later" is the order of the
fleet's history of installed labels); where none does the answer is ``NoCompatibleVersion``,
retryable, with nothing generated. Both checks relabel workers (``set_weight_version``, no weight
load) and put the labels back.
"""

from __future__ import annotations

from rollout_backends import (
    Capabilities,
    GenerateRequest,
    Generation,
    NoCompatibleVersion,
    RolloutBackend,
)

from ._core import CheckContext, CheckFailed, Requirement, _Requires, check, expect, requires, validate_generation
from ._harness import Harness

__all__ = ["check_min_version_after_partial_update", "check_unknown_exact_version_is_retryable"]

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
