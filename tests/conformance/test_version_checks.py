"""The version checks pass on the reference fleet and fail on broken ones: one that ignores the
constraints (``Fleet._route_by_version`` skipped), one that stamps every token with the version at
the finish, one that reports no spans."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
import pytest

import rollout_backends as rb
from rollout_backends.adapters.reference import ReferenceBackend, ReferenceEngine
from rollout_backends.conformance import BackendFactory, Harness, Outcome, select_checks
from rollout_backends.conformance._reference import reference_harness

CHECKS = ["unknown_exact_version_is_retryable", "min_version_after_partial_update"]


class IgnoresConstraints(ReferenceBackend):
    """Declares ``version_constraints`` and routes as if no request had one."""

    def _route_by_version(self, request: rb.GenerateRequest) -> rb.GenerateRequest:
        return request


def factory(cls: type[ReferenceBackend]) -> BackendFactory:
    async def make() -> rb.RolloutBackend:
        engines = ReferenceBackend.create(workers=2, seed=0).engines
        return cls(engines)

    return make


@pytest.mark.parametrize("name", CHECKS)
async def test_the_check_passes_and_fails_where_constraints_are_ignored(name: str) -> None:
    (c,) = select_checks([name])
    good = await c(factory(ReferenceBackend), Harness())
    assert good.outcome is Outcome.PASS, good.line()
    bad = await c(factory(IgnoresConstraints), Harness())
    assert bad.outcome is Outcome.FAIL, bad.line()
    assert "served" in bad.message


async def test_the_checks_skip_where_not_declared() -> None:
    class Undeclared(ReferenceBackend):
        def __init__(self, engines: Sequence[ReferenceEngine]) -> None:
            super().__init__(engines)
            self.capabilities = attrs.evolve(self.capabilities, version_constraints=False)

    for name in CHECKS:
        (c,) = select_checks([name])
        r = await c(factory(Undeclared), Harness())
        assert r.outcome is Outcome.SKIP and "version_constraints" in (r.message or ""), r.line()


class SpansAtFinish(ReferenceBackend):
    """Reports every token as the version at the finish (what SGLang 0.5.16 stamps): one span."""

    async def generate(self, request: rb.GenerateRequest) -> rb.Generation:
        gen = await super().generate(request)
        assert gen.weight_version is not None
        return attrs.evolve(gen, version_spans=((0, gen.weight_version),) if gen.output_ids else ())


class NoSpans(ReferenceBackend):
    """Declares engine spans and reports none."""

    async def generate(self, request: rb.GenerateRequest) -> rb.Generation:
        return attrs.evolve(await super().generate(request), version_spans=None)


@pytest.mark.parametrize(
    ("name", "broken"),
    [("version_spans_across_update", SpansAtFinish), ("version_spans_quiet", NoSpans)],
)
async def test_the_span_checks_pass_and_fail_on_wrong_spans(name: str, broken: type[ReferenceBackend]) -> None:
    harness = reference_harness("reference://?workers=2&seed=0")
    (c,) = select_checks([name])
    good = await c(factory(ReferenceBackend), harness)
    assert good.outcome is Outcome.PASS, good.line()
    bad = await c(factory(broken), harness)
    assert bad.outcome is Outcome.FAIL, bad.line()
    assert "span" in (bad.message or "")


class ShiftedBoundary(ReferenceBackend):
    """Reports the second span starting ``shift`` tokens off where the engine changed version."""

    shift = 0

    async def generate(self, request: rb.GenerateRequest) -> rb.Generation:
        gen = await super().generate(request)
        spans = gen.version_spans
        if spans is None or len(spans) < 2:
            return gen
        (first, v0), (at, v1), *rest = spans
        return attrs.evolve(gen, version_spans=((first, v0), (at + self.shift, v1), *rest))


class EarlyBoundary(ShiftedBoundary):
    shift = -1


class LateBoundary(ShiftedBoundary):
    shift = 1


@pytest.mark.parametrize(
    ("broken", "says"),
    [(SpansAtFinish, "one span"), (EarlyBoundary, "too early"), (LateBoundary, "differ from a run before")],
)
async def test_in_place_spans_check_passes_and_fails_on_a_wrong_boundary(
    broken: type[ReferenceBackend], says: str
) -> None:
    harness = reference_harness("reference://?workers=2&seed=0")
    (c,) = select_checks(["version_spans_across_in_place_update"])
    good = await c(factory(ReferenceBackend), harness)
    assert good.outcome is Outcome.PASS, good.line()
    assert int(good.measurements["boundary"]) > 0
    bad = await c(factory(broken), harness)
    assert bad.outcome is Outcome.FAIL, bad.line()
    assert says in (bad.message or ""), bad.line()


class ChunkVersionsOnly:
    """An engine whose streamed generations carry no spans of their own, as SGLang's: the fleet
    puts them together from the chunks' versions. ``at_finish``: every chunk reports the version at
    the finish instead (one span, although the tokens span two versions)."""

    def __init__(self, engine: ReferenceEngine, *, at_finish: bool, late: bool = False) -> None:
        self._engine, self._at_finish, self._late = engine, at_finish, late

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def stream(self, request: rb.GenerateRequest) -> AsyncIterator[rb.TokenChunk]:
        chunks = self._engine.stream(request)
        held: list[rb.TokenChunk] = []
        last: str | None = None
        try:
            async for c in chunks:
                if c.final is not None:
                    c = attrs.evolve(c, final=attrs.evolve(c.final, version_spans=None))
                if self._late:  # each chunk reports the version of the chunk before it
                    last, c = c.weight_version, attrs.evolve(c, weight_version=last or c.weight_version)
                if not self._at_finish:
                    yield c
                    continue
                held.append(c)
                if c.final is not None:
                    for h in held:
                        yield attrs.evolve(h, weight_version=c.final.weight_version)
        finally:
            await chunks.aclose()


def chunk_versions_factory(*, at_finish: bool, late: bool = False) -> BackendFactory:
    async def make() -> rb.RolloutBackend:
        engines = ReferenceBackend.create(workers=2, seed=0).engines
        return ReferenceBackend([ChunkVersionsOnly(e, at_finish=at_finish, late=late) for e in engines])  # type: ignore[misc]

    return make


async def test_stream_spans_check_passes_on_chunk_versions_and_fails_on_versions_at_finish() -> None:
    harness = reference_harness("reference://?workers=2&seed=0")
    (c,) = select_checks(["stream_version_spans_across_update"])
    good = await c(chunk_versions_factory(at_finish=False), harness)
    assert good.outcome is Outcome.PASS, good.line()
    assert "conformance-spans" in str(good.measurements["spans"]) and "," in str(good.measurements["spans"])
    bad = await c(chunk_versions_factory(at_finish=True), harness)
    assert bad.outcome is Outcome.FAIL, bad.line()
    assert "span" in (bad.message or "")


@pytest.mark.parametrize(("at_finish", "late"), [(True, False), (False, True)])
async def test_stream_in_place_spans_check_fails_on_versions_at_finish_or_late(at_finish: bool, late: bool) -> None:
    harness = reference_harness("reference://?workers=2&seed=0")
    (c,) = select_checks(["stream_version_spans_across_in_place_update"])
    good = await c(chunk_versions_factory(at_finish=False), harness)
    assert good.outcome is Outcome.PASS, good.line()
    bad = await c(chunk_versions_factory(at_finish=at_finish, late=late), harness)
    assert bad.outcome is Outcome.FAIL, bad.line()
    assert "span" in (bad.message or "") or "differ" in (bad.message or ""), bad.line()
