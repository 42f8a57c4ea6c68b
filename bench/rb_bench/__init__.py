"""Benchmarks, observation tools (wire capture, smg probe) and the conformance suite's GPU tier, run
from a checkout (not installed).

The library (``rollout_backends``) is the product; this package measures and exercises it and is
never part of its wheel (``tests/test_packaging.py``). Run a module with the checkout's ``bench/``
on the path::

    PYTHONPATH=bench python -m rb_bench.fanout --engine mocker --smoke

pytest puts ``bench/`` on the path itself (``pythonpath`` in pyproject.toml). A module that starts
another module of this package as a child process passes it :func:`with_bench_path`'s environment,
since the parent may have found ``rb_bench`` through ``sys.path`` rather than ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["BENCH_DIR", "REPO_ROOT", "with_bench_path"]

#: The checkout's ``bench/`` folder (the one that holds this package).
BENCH_DIR = Path(__file__).resolve().parents[1]
#: The checkout's root.
REPO_ROOT = BENCH_DIR.parent


def with_bench_path(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``BENCH_DIR`` first on ``PYTHONPATH`` (once), for a ``python -m rb_bench.*`` child."""
    out = dict(env)
    rest = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(BENCH_DIR)]
    out["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR), *rest])
    return out
