"""Shared fixtures for our own tests."""

from __future__ import annotations

import gc
import importlib.metadata
import os
from collections.abc import Iterator

import pytest

from tests.task_guard import UnretrievedTaskLog

_UNRETRIEVED = UnretrievedTaskLog()


def pytest_sessionstart(session: pytest.Session) -> None:
    """``RB_EXPECT_DYNAMO=<version>`` (``make test-dynamo16``): the run is about that ai-dynamo, so a
    missing or different one is an error, not a silent skip of every Dynamo test."""
    _UNRETRIEVED.install()
    want = os.environ.get("RB_EXPECT_DYNAMO")
    if not want:
        return
    try:
        got = importlib.metadata.version("ai-dynamo")
        import dynamo.llm  # noqa: F401  (what the Dynamo tests' skip condition imports)
    except Exception as exc:
        raise pytest.UsageError(f"RB_EXPECT_DYNAMO={want}, but ai-dynamo does not import: {exc!r}") from exc
    if got != want:
        raise pytest.UsageError(f"RB_EXPECT_DYNAMO={want}, but ai-dynamo {got} is installed")


@pytest.fixture(autouse=True)
def _no_unretrieved_task_exceptions() -> Iterator[None]:
    """A task that failed with nobody awaiting it is a lost error: the test fails (issue 16)."""
    _UNRETRIEVED.take()
    yield
    seen = _UNRETRIEVED.take()
    if seen:
        pytest.fail("asyncio task exceptions never retrieved: " + "; ".join(seen), pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    gc.collect()  # tasks held in reference cycles are freed, and reported, only here
    seen = _UNRETRIEVED.take()
    if seen:
        print("\nasyncio task exceptions never retrieved (freed late): " + "; ".join(seen))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
