"""The version-constraint checks pass on the reference fleet and fail on one that ignores the
constraints (``Fleet._route_by_version`` skipped: every request served as if unconstrained)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest

import rollout_backends as rb
from rollout_backends.adapters.reference import ReferenceBackend, ReferenceEngine
from rollout_backends.conformance import BackendFactory, Harness, Outcome, select_checks

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
