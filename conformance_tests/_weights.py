"""Weight updates: each transport against a fresh engine, stale prefixes, versions, failures."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Awaitable, Callable, Sequence

from rollout_backends import (
    Generation,
    InvalidRequest,
    MemoryTag,
    PauseMode,
    RolloutBackend,
    WeightBucket,
    WeightTransport,
    WeightUpdateFailed,
    WeightUpdateTransaction,
)

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

__all__ = [
    "check_disk_update_matches_fresh",
    "check_distributed_update_matches_fresh",
    "check_injected_failure_rolls_back",
    "check_memory_release_resume",
    "check_stale_prefix_after_update",
    "check_tensor_update_matches_fresh",
    "check_update_failure_keeps_version",
]

Loader = Callable[[WeightUpdateTransaction], Awaitable[None]]

_MODE_PREFERENCE = (PauseMode.RETRACT, PauseMode.ABORT, PauseMode.IN_PLACE)


def _default_mode(ctx: CheckContext) -> PauseMode | None:
    return next((m for m in _MODE_PREFERENCE if m in ctx.capabilities.pause_modes), None)


async def _update(ctx: CheckContext, version: str, loader: Loader, mode: PauseMode | None = None) -> None:
    """Run ``loader`` inside the weight-update transaction (in ``mode`` or the preferred declared one)."""
    mode = mode or _default_mode(ctx)
    if mode is None:
        raise CheckFailed("weight updates need a pause mode; the backend declares none")
    async with ctx.backend.weight_update(version, mode=mode) as tx:
        await loader(tx)


def _disk_loader(path: str) -> Loader:
    async def load(tx: WeightUpdateTransaction) -> None:
        await tx.update_from_disk(path)

    return load


def _loader_for(ctx: CheckContext, path: str) -> Loader:
    """Load the checkpoint ``path`` with the first declared of disk and tensor."""
    if WeightTransport.DISK in ctx.capabilities.weight_transports:
        return _disk_loader(path)
    named = ctx.harness.load_weights(path)

    async def load(tx: WeightUpdateTransaction) -> None:
        await tx.update_from_tensors(named)

    return load


def _alt_loader(ctx: CheckContext) -> Loader:
    """Load the alt weights with the first declared of disk and tensor."""
    path = ctx.harness.alt_weights_path
    assert path is not None
    return _loader_for(ctx, path)


async def _restore(ctx: CheckContext, previous: dict[str, str | None]) -> None:
    """Load the served checkpoint back (``Harness.base_weights_path``, else the backend's
    ``Capabilities.model_path``: shared servers), with the old version label."""
    base = served_checkpoint(ctx.capabilities, ctx.harness)
    if base is None:
        return
    label = next(iter(set(previous.values())), None) if len(set(previous.values())) == 1 else None
    if WeightTransport.DISK in ctx.capabilities.weight_transports:
        await ctx.backend.update_weights_from_disk(base, version=label, flush_cache=True)
    elif os.path.isdir(base):  # tensors are read here: a path only the server sees cannot be
        await ctx.backend.update_weights_from_tensors(ctx.harness.load_weights(base), version=label, flush_cache=True)


async def _oracle(ctx: CheckContext, prompts: Sequence[Sequence[int]]) -> list[Generation]:
    """Greedy outputs of a fresh engine on the alt weights."""
    fresh = ctx.harness.fresh_factory_on
    path = ctx.harness.alt_weights_path
    assert fresh is not None and path is not None
    backend = await fresh(path)()
    try:
        return await ctx.generate_all(prompts, ctx.greedy(16), backend=backend)
    finally:
        await backend.aclose()


async def _update_matches_fresh(ctx: CheckContext, loader: Loader, version: str) -> None:
    prompts = ctx.prompts(4, min_len=4, max_len=40, seed=81)
    want = await _oracle(ctx, prompts)
    before = await ctx.generate_all(prompts, ctx.greedy(16))  # also warms the prefix cache
    if all(a.output_ids == b.output_ids for a, b in zip(before, want, strict=True)):
        raise HarnessError("the alt weights give the same greedy outputs as the served ones: use other weights")
    previous = dict(await ctx.backend.weight_versions())
    try:
        await _update(ctx, version, loader)
        after = await ctx.generate_all(prompts, ctx.greedy(16))
        compare(
            after,
            want,
            what="after the update vs a fresh engine on the new weights",
            tolerance=ctx.harness.logprob_tolerance,
            ctx=ctx,
        )
        if ctx.versioned():
            wrong = [g.weight_version for g in after if g.weight_version != version]
            expect(not wrong, f"responses after the update carry versions {wrong}, want {version!r}")
            versions = dict(await ctx.backend.weight_versions())
            expect(set(versions.values()) == {version}, f"weight_versions() after the update: {versions}")
            expect(await ctx.backend.weight_version() == version, "weight_version() is not the new version")
    finally:
        await _restore(ctx, previous)


@check("weights")
@requires(transport=WeightTransport.DISK, any_pause_mode=True, hooks=("alt_weights_path", "fresh_factory_on"))
async def check_disk_update_matches_fresh(ctx: CheckContext) -> None:
    """After a disk update, greedy outputs equal a fresh engine on those weights; every response has the new version."""
    path = ctx.harness.alt_weights_path
    assert path is not None
    await _update_matches_fresh(ctx, _disk_loader(path), "conformance-disk")


@check("weights")
@requires(transport=WeightTransport.TENSOR, any_pause_mode=True, hooks=("alt_weights_path", "fresh_factory_on"))
async def check_tensor_update_matches_fresh(ctx: CheckContext) -> None:
    """After an in-memory tensor update, outputs equal a fresh engine on those weights."""
    path = ctx.harness.alt_weights_path
    assert path is not None
    named = ctx.harness.load_weights(path)

    async def load(tx: WeightUpdateTransaction) -> None:
        await tx.update_from_tensors(named)

    await _update_matches_fresh(ctx, load, "conformance-tensor")


@check("weights")
@requires(
    transport=WeightTransport.DISTRIBUTED,
    any_pause_mode=True,
    hooks=("alt_weights_path", "fresh_factory_on", "make_sender"),
)
async def check_distributed_update_matches_fresh(ctx: CheckContext) -> None:
    """Weights broadcast from a torch.distributed rank 0 in two buckets equal a fresh engine on them."""
    h = ctx.harness
    assert h.alt_weights_path is not None and h.make_sender is not None
    named = list(h.load_weights(h.alt_weights_path))
    half = max(1, len(named) // 2)
    buckets = [b for b in (named[:half], named[half:]) if b]
    ranks = h.engine_ranks or len(ctx.backend.workers)
    group, sender = h.make_sender(1 + ranks)
    joined = False
    try:
        await asyncio.gather(asyncio.to_thread(sender.connect), ctx.backend.init_weight_group(group))
        joined = True

        async def load(tx: WeightUpdateTransaction) -> None:
            for part in buckets:
                bucket = WeightBucket.from_named_tensors(part)
                sent, _ = await asyncio.gather(
                    asyncio.to_thread(sender.broadcast, part),
                    tx.update_from_distributed(bucket, group_name=group.group_name),
                )
                expect(sent == bucket, "the sender broadcast another bucket than described")

        ctx.measure("buckets", len(buckets))
        await _update_matches_fresh(ctx, load, "conformance-distributed")
    finally:
        if joined:
            await ctx.backend.destroy_weight_group(group.group_name)
        await asyncio.to_thread(sender.close)


@check("weights")
@requires(any_transport=(WeightTransport.DISK, WeightTransport.TENSOR), hooks=("alt_weights_path",))
async def check_stale_prefix_after_update(ctx: CheckContext) -> None:
    """After an update (in each declared pause mode), a prompt whose prefix was cached before equals
    a flushed run. Where the update did not change the probes' outputs the probe cannot tell KV
    computed before it from KV computed after: the check skips, naming the modes."""
    rng_prompts = ctx.prompts(1, min_len=64, max_len=64, seed=91)
    prefix = rng_prompts[0][: ctx.clamp_prompt_len(64)]
    probes = [prefix, *(prefix + tail for tail in ctx.prompts(3, min_len=1, max_len=4, seed=92))]
    loader = _alt_loader(ctx)
    modes = [m for m in _MODE_PREFERENCE if m in ctx.capabilities.pause_modes]
    if not modes:
        ctx.skip("no pause mode declared: the weight-update transaction cannot run")
    previous = dict(await ctx.backend.weight_versions())
    restores = served_checkpoint(ctx.capabilities, ctx.harness) is not None
    blind: list[str] = []
    for i, mode in enumerate(modes):
        if i == 0 or restores:
            told = await _stale_prefix_probe(ctx, ctx.backend, mode, loader, probes, previous)
        else:
            # Each mode needs the served weights back: a new backend from the factory (a fresh
            # engine for in-process backends; a shared server still holds the alt weights, and
            # the probe then cannot tell, below).
            backend = await ctx.factory()
            try:
                told = await _stale_prefix_probe(ctx, backend, mode, loader, probes, previous)
            finally:
                with contextlib.suppress(Exception):
                    await backend.resume()
                await backend.aclose()
        if not told:
            blind.append(mode.value)
    if blind:
        ctx.skip(
            f"in pause mode(s) {blind} the update left the probes' outputs unchanged (the backend may have held the "
            "alt weights already: a shared server whose checkpoint is unknown), so stale KV cannot be told from "
            "fresh; give Harness.base_weights_path (or a backend that reports Capabilities.model_path)"
        )


async def _stale_prefix_probe(
    ctx: CheckContext,
    backend: RolloutBackend,
    mode: PauseMode,
    loader: Loader,
    probes: Sequence[tuple[int, ...]],
    previous: dict[str, str | None],
) -> bool:
    """One mode's probe; whether it could tell (the update changed the probes' outputs)."""
    sp = ctx.greedy(8)
    await ctx.generate_all(probes, sp, backend=backend)
    warm = await ctx.generate_all(probes, sp, backend=backend)  # the second run is served from the cache
    try:
        async with backend.weight_update(f"conformance-prefix-{mode.value}", mode=mode) as tx:
            await loader(tx)
        served = await ctx.generate_all(probes, sp, backend=backend)
        # Tokens served from KV computed before the update (must be 0 unless the KV is recomputed).
        ctx.measure(f"cached_tokens_first_probe_{mode.value}", served[0].cached_tokens)
        await backend.flush_cache()
        cold = await ctx.generate_all(probes, sp, backend=backend)
        compare(
            served,
            cold,
            what=f"after update ({mode.value}): cached prefix vs flushed",
            tolerance=ctx.harness.logprob_tolerance,
            ctx=ctx,
        )
        return any(a.output_ids != b.output_ids for a, b in zip(warm, cold, strict=True))
    finally:
        if backend is ctx.backend:
            await _restore(ctx, previous)


async def _expect_update_fails(ctx: CheckContext, version: str, loader: Loader) -> WeightUpdateFailed:
    try:
        await _update(ctx, version, loader)
    except WeightUpdateFailed as exc:
        return exc
    raise CheckFailed("the weight update did not raise WeightUpdateFailed")


async def _expect_unchanged(
    ctx: CheckContext,
    previous: dict[str, str | None],
    prompts: Sequence[Sequence[int]],
    before: list[Generation] | None,
) -> None:
    report = await ctx.backend.health()
    expect(report.ready, f"not every worker is ready after a failed update: {report.unhealthy_workers}")
    versions = dict(await ctx.backend.weight_versions())
    expect(versions == previous, f"versions moved after a failed update: {previous} -> {versions}")
    if before is not None:
        after = await ctx.generate_all(prompts, ctx.greedy(16))
        compare(after, before, what="outputs after a failed update", tolerance=ctx.harness.logprob_tolerance, ctx=ctx)


@check("weights")
@requires(transport=WeightTransport.DISK, any_pause_mode=True, survives_failed_load=True)
async def check_update_failure_keeps_version(ctx: CheckContext) -> None:
    """A disk update from a missing checkpoint raises WeightUpdateFailed; all resumed, version and outputs unchanged."""
    prompts = ctx.prompts(3, seed=95)
    before = await ctx.generate_all(prompts, ctx.greedy(16))
    previous = dict(await ctx.backend.weight_versions())
    with tempfile.TemporaryDirectory(prefix="rb-conformance-") as tmp:
        missing = os.path.join(tmp, "no-such-checkpoint")
        exc = await _expect_update_fails(ctx, "conformance-missing", _disk_loader(missing))
    ctx.measure("failed_steps", ",".join(exc.steps))
    expect(exc.version == "conformance-missing", f"WeightUpdateFailed.version={exc.version!r}")
    await _expect_unchanged(ctx, previous, prompts, before)


@check("weights")
@requires(
    any_transport=(WeightTransport.DISK, WeightTransport.TENSOR),
    any_pause_mode=True,
    hooks=("alt_weights_path", "inject_failure"),
    survives_failed_load=True,
)
async def check_injected_failure_rolls_back(ctx: CheckContext) -> None:
    """One worker failing mid-update: WeightUpdateFailed names it; every worker resumed; no version moved."""
    inject = ctx.harness.inject_failure
    assert inject is not None
    target = ctx.backend.workers[-1]
    previous = dict(await ctx.backend.weight_versions())
    try:
        async with inject(ctx.backend, target):
            exc = await _expect_update_fails(ctx, "conformance-injected", _alt_loader(ctx))
        expect(target in exc.workers, f"WeightUpdateFailed names {exc.workers}, not the failed worker {target!r}")
        ctx.measure("failed_steps", ",".join(exc.steps))
        await _expect_unchanged(ctx, previous, ctx.prompts(2, seed=96), None)
        gen = await ctx.generate(ctx.prompts(1, seed=97)[0], ctx.greedy(4, ignore_eos=True))
        expect(len(gen.output_ids) == 4, "no normal generation after the failed update")
    finally:
        await _restore(ctx, previous)


#: How the check gives memory back after each release: all at once, and in Miles' colocated order
#: (weights back, the new weights loaded into them, then the KV cache; radixark/miles 31f1ca961a94).
_RESUMES: dict[str, tuple[tuple[MemoryTag, ...] | None, ...]] = {
    "all at once": (None,),
    "weights, then kv_cache": ((MemoryTag.WEIGHTS,), (MemoryTag.KV_CACHE,)),
    # resume_memory() after a partial resume: what still sleeps, and only that (SGLang 0.5.16's
    # scheduler raises KeyError on a tag it has not released; the fleet sends only those)
    "weights, then the rest": ((MemoryTag.WEIGHTS,), None),
}


@check("weights")
@requires(memory_release=True)
async def check_memory_release_resume(ctx: CheckContext) -> None:
    """After ``release_memory`` and ``resume_memory`` (all at once; weights before the KV cache;
    weights, then everything else), greedy outputs are what they were: the memory comes back
    holding the weights. A staged resume the backend refuses (``InvalidRequest``) is recorded, and
    everything resumed at once."""
    prompts = ctx.prompts(3, max_len=24, seed=131)
    before = await ctx.generate_all(prompts, ctx.greedy(12, ignore_eos=True))
    backend, refused = ctx.backend, []
    for label, resumes in _RESUMES.items():
        await backend.release_memory()
        done = False
        try:
            for tags in resumes:
                await backend.resume_memory(tags)
            done = True
        except InvalidRequest as exc:
            refused.append(f"{label}: {exc}")
        finally:
            if not done:  # never leave the engine released
                await backend.resume_memory()
        after = await ctx.generate_all(prompts, ctx.greedy(12, ignore_eos=True))
        compare(
            after,
            before,
            what=f"greedy after release + resume ({label})",
            tolerance=ctx.harness.logprob_tolerance,
            ctx=ctx,
        )
    if refused:
        ctx.measure("resume_refused", "; ".join(refused))
