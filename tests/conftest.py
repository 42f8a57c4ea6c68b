"""Shared fixtures for our own tests."""

from __future__ import annotations

import importlib.metadata
import os

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    """``RB_EXPECT_DYNAMO=<version>`` (``make test-dynamo16``): the run is about that ai-dynamo, so a
    missing or different one is an error, not a silent skip of every Dynamo test."""
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
