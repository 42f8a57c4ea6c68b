"""Fixtures for the Dynamo tests: the tiny models, process accounting, skip without ai-dynamo."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import descendants


def _has_dynamo() -> bool:
    try:
        import dynamo.llm  # noqa: F401
    except Exception:
        return False
    return True


HAS_DYNAMO = _has_dynamo()


_children = descendants  # kept under this module's name for its importers


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from rollout_backends.adapters.reference._backend import cached_tiny_model

    return cached_tiny_model(0)


@pytest.fixture(scope="session")
def tiny_model_b() -> Path:
    """Same shapes, other weights (seed 1): the "new checkpoint" of the update tests."""
    from rollout_backends.adapters.reference._backend import cached_tiny_model

    return cached_tiny_model(1)


@pytest.fixture(scope="module")
def no_orphans() -> Iterator[None]:
    """Fail the module if it leaves child processes behind."""
    before = _children()
    yield
    import time

    deadline = time.monotonic() + 10
    left = _children() - before
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _children() - before
    assert not left, f"processes left behind: {sorted(left)}"
