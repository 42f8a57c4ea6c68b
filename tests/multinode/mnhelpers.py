"""Helpers for the multi-node tests (imported as ``mnhelpers``; pytest puts this folder on sys.path)."""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from types import ModuleType
from typing import Any

import pytest


def require(module: str) -> ModuleType:
    """Import ``module``; skip the test without it, but fail in CI (``.ci/run`` installs it)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is not installed (tools/install-multinode-deps.sh): {exc}")
        pytest.skip(f"{module} is not installed (tools/install-multinode-deps.sh)")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] not in ("Z", "X")


async def wait_until(pred: Any, timeout: float, interval: float = 0.2) -> bool:
    """Poll ``pred()`` (sync or async) until true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)
