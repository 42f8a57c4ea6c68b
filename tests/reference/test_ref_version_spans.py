"""Per-token versions (issue 17 item 1): ``Generation.version_spans`` from the reference engine, exact
across RETRACT and IN_PLACE pauses with a weight update between them, and the fleet's own spans
(``VersionSource.STAMPED``) only where no update overlapped the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
from refhelpers import GREEDY, PROMPTS, req, wait_for_tokens

import rollout_backends as rb
from rollout_backends.adapters.reference import ReferenceBackend, ReferenceEngine
from rollout_backends.kit import Driver, Fleet

N = 40


async def _across_an_update(
    engine: ReferenceEngine, mode: rb.PauseMode, new_weights: Path
) -> tuple[rb.Generation, int]:
    """A greedy request paused after >= 5 tokens, the weights replaced (labelled "b"), resumed."""
    task = asyncio.ensure_future(engine.generate(req(PROMPTS[0], GREEDY.replace(max_new_tokens=N))))
    await wait_for_tokens(engine, 5)
    await engine.pause(mode)
    k = engine.health().tokens_generated  # tokens made before the pause (the only request)
    try:
        await engine.update_weights_from_disk(
            str(new_weights), version="b", flush_cache=mode is not rb.PauseMode.IN_PLACE
        )
    finally:
        await engine.resume()
    return await task, k


async def test_retract_spans_split_at_the_update_and_match_fresh_engines(
    engine: ReferenceEngine, make_engine: Callable[..., ReferenceEngine], model_dir: Path, model_dir_b: Path
) -> None:
    gen, k = await _across_an_update(engine, rb.PauseMode.RETRACT, model_dir_b)
    assert 5 <= k < N and len(gen.output_ids) == N
    assert gen.version_spans == ((0, "default"), (k, "b"))  # tokens of both versions
    assert (gen.version_at_start, gen.version_at_end) == ("default", "b")
    # Each span equals a fresh engine of its version given the tokens before it.
    for (at, version), end in zip(gen.version_spans, [s[0] for s in gen.version_spans[1:]] + [N], strict=True):
        fresh = make_engine(model_dir if version == "default" else model_dir_b)
        cont = await fresh.generate(req(PROMPTS[0] + gen.output_ids[:at], GREEDY.replace(max_new_tokens=end - at)))
        assert gen.output_ids[at:end] == cont.output_ids, version
        assert gen.logprobs is not None and gen.logprobs[at:end] == cont.logprobs, version


async def test_in_place_spans_split_at_the_update(
    engine: ReferenceEngine, make_engine: Callable[..., ReferenceEngine], model_dir: Path, model_dir_b: Path
) -> None:
    """IN_PLACE keeps the KV computed under the old weights, so the tokens after the update are the
    new weights' forwards over old keys and values: labelled "b" (the weights that chose them), and
    not a fresh "b" engine's (which recomputes the prefix); the old span is exact."""
    gen, k = await _across_an_update(engine, rb.PauseMode.IN_PLACE, model_dir_b)
    assert gen.version_spans == ((0, "default"), (k, "b"))
    old = await make_engine(model_dir).generate(req(PROMPTS[0], GREEDY.replace(max_new_tokens=k)))
    assert gen.output_ids[:k] == old.output_ids and gen.logprobs is not None and gen.logprobs[:k] == old.logprobs
    plain = await make_engine(model_dir).generate(req(PROMPTS[0], GREEDY.replace(max_new_tokens=N)))
    assert gen.output_ids != plain.output_ids  # the new weights did choose the rest


async def test_a_relabel_alone_starts_a_span_and_quiet_requests_have_one(engine: ReferenceEngine) -> None:
    quiet = await engine.generate(req(PROMPTS[1]))
    assert quiet.version_spans == ((0, "default"),) and quiet.version_at_start == "default"
    task = asyncio.ensure_future(engine.generate(req(PROMPTS[0], GREEDY.replace(max_new_tokens=400))))
    await wait_for_tokens(engine, len(quiet.output_ids) + 5)
    await engine.set_weight_version("relabelled")
    gen = await task
    assert gen.version_spans is not None and [v for _, v in gen.version_spans] == ["default", "relabelled"]
    assert gen.version_spans[1][0] >= 5


async def test_an_abort_keeps_the_spans_of_its_partial_tokens(engine: ReferenceEngine) -> None:
    task = asyncio.ensure_future(engine.generate(req(PROMPTS[0], GREEDY.replace(max_new_tokens=3000), request_id="a")))
    await wait_for_tokens(engine, 5)
    await engine.abort("a")
    gen = await task
    assert gen.aborted and gen.output_ids and gen.version_spans == ((0, "default"),)


class NoSpans:
    """A reference driver whose answers carry no spans (as an HTTP engine's do not)."""

    def __init__(self, inner: Driver) -> None:
        self.inner = inner
        self.id, self.capabilities, self.aborts_by_id, self.ranks = inner.id, inner.capabilities, True, 1
        self.control, self.probe, self.served_version, self.aclose = (
            inner.control,
            inner.probe,
            inner.served_version,
            inner.aclose,
        )

    async def generate(self, request: rb.GenerateRequest) -> rb.Generation:
        gen = await self.inner.generate(request)
        return attrs.evolve(gen, version_spans=None, version_at_start=None)


async def test_the_fleet_stamps_spans_only_where_no_update_overlapped(model_dir: Path) -> None:
    ref = ReferenceBackend.create(model_dir, workers=2)
    caps = attrs.evolve(ref.capabilities, version_spans=rb.VersionSource.STAMPED)
    fleet = Fleet([NoSpans(d) for d in ref.drivers], capabilities=caps)  # type: ignore[list-item]
    fleet.set_installed_version("default")
    try:
        quiet = await fleet.generate(req(PROMPTS[1], worker="ref-0"))
        assert quiet.version_spans == ((0, "default"),) and quiet.version_at_start == "default"
        long = req(PROMPTS[0], GREEDY.replace(max_new_tokens=400), worker="ref-0")
        task = asyncio.ensure_future(fleet.generate(long))
        await wait_for_tokens(ref.engine("ref-0"), len(quiet.output_ids) + 5)
        other = asyncio.ensure_future(
            fleet.generate(req(PROMPTS[0], GREEDY.replace(max_new_tokens=400), worker="ref-1"))
        )
        await fleet.set_weight_version("v2", workers=["ref-0"])
        gen, untouched = await asyncio.gather(task, other)
        # Spanned the relabel: where the tokens changed version is not known to the fleet: no spans.
        assert gen.version_spans is None
        assert (gen.version_at_start, gen.version_at_end) == ("default", "v2")
        # The other worker was not relabelled: its request is one span, exactly.
        assert untouched.version_spans == ((0, "default"),)
        # Declared NONE: the fleet adds none.
        bare = Fleet([NoSpans(d) for d in ref.drivers], capabilities=ref.capabilities)  # type: ignore[list-item]
        assert (await bare.generate(req(PROMPTS[1], worker="ref-1"))).version_spans is None
    finally:
        await ref.aclose()


@pytest.mark.parametrize(
    ("spans", "n"),
    [
        (((1, "a"),), 3),  # not from 0
        (((0, "a"), (0, "b")), 3),  # not increasing
        (((0, "a"), (2, "a")), 3),  # not a new run
        (((0, "a"), (3, "b")), 3),  # past the end
        ((), 3),  # nothing for 3 tokens
        (((0, "a"),), 0),  # a span for no tokens
        (((0, 1),), 3),  # not a version label
    ],
)
def test_spans_that_do_not_cover_the_tokens_are_a_contract_violation(spans: object, n: int) -> None:
    with pytest.raises(rb.ContractViolation):
        rb.Generation(
            request_id="r",
            output_ids=tuple(range(n)),
            logprobs=None,
            finish_reason=rb.FinishReason.LENGTH,
            weight_version="a",
            prompt_tokens=1,
            version_spans=spans,  # type: ignore[arg-type]
        )
