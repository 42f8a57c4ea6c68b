"""Fixtures of the reliability suite: sizes (CI vs ``RB_RELIABILITY_FULL=1``), models, figures.

Figures each test measures are collected in ``figures`` and, when ``RB_RELIABILITY_FIGURES`` names a
file, written there as JSON at the end of the session (``docs/reliability.md`` quotes them).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.procs import descendants

#: ``RB_RELIABILITY_FULL=1``: the full sizes (1,000 requests per death test, 10,000 fuzz cases, ...).
FULL = os.environ.get("RB_RELIABILITY_FULL", "") == "1"


def size(ci: int, full: int) -> int:
    """``full`` under ``RB_RELIABILITY_FULL=1``, else ``ci``."""
    return full if FULL else ci


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except Exception:
        return False
    return True


HAS_DYNAMO = _importable("dynamo.llm")
HAS_SMG = _importable("smg")

_FIGURES: dict[str, Any] = {}


@pytest.fixture(scope="session")
def figures() -> Iterator[dict[str, Any]]:
    yield _FIGURES
    out = os.environ.get("RB_RELIABILITY_FIGURES")
    if out and _FIGURES:
        path = Path(out)
        old = json.loads(path.read_text()) if path.exists() else {}
        old.update(_FIGURES)
        old["_meta"] = {"full": FULL, "written": time.strftime("%Y-%m-%d %H:%M:%S")}
        path.write_text(json.dumps(old, indent=2, sort_keys=True))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from rollout_backends.adapters.reference._backend import cached_tiny_model

    return cached_tiny_model(0)


@pytest.fixture(scope="session")
def tiny_model_b() -> Path:
    from rollout_backends.adapters.reference._backend import cached_tiny_model

    return cached_tiny_model(1)


children = descendants  # kept under this module's name for its importers


@pytest.fixture(scope="module")
def no_orphans() -> Iterator[None]:
    """Fail the module if it leaves child processes behind."""
    before = children()
    yield
    deadline = time.monotonic() + 15
    left = children() - before
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = children() - before
    assert not left, f"processes left behind: {sorted(left)}"


def _socket_inodes(pid: int) -> set[str]:
    out: set[str] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _hex_addr(text: str) -> str:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ".".join(str(b) for b in raw[::-1])
    else:  # IPv6: four little-endian 32-bit words
        words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
        full = b"".join(words)
        ip = ":".join(full[i : i + 2].hex() for i in range(0, 16, 2))
    return f"{ip}:{int(port, 16)}"


def listening_addresses(pids: list[int]) -> set[str]:
    """``ip:port`` of every TCP socket in LISTEN state held by ``pids`` (from /proc/net/tcp{,6})."""
    inodes: set[str] = set()
    for pid in pids:
        inodes |= _socket_inodes(pid)
    out: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                out.add(_hex_addr(f[1]))
    return out


def is_loopback(addr: str) -> bool:
    ip = addr.rsplit(":", 1)[0]
    return ip.startswith("127.") or ip in ("0000:0000:0000:0000:0000:0000:0000:0001",)
