"""The worker-side text algorithm as it was before 2026-12-02: the window run once per *token*.

``IncrementalDetokenizer.chunk`` (``adapters/dynamo/_detok.py``) now runs the prefix/read window
once per chunk. ``chunk_per_token`` is the earlier version (two decodes per token, per-token
pieces that add up to the text), kept here only so the probes can measure before against after:
``patch()`` swaps it in (``PROBE_PER_TOKEN_DETOK=1`` in ``nocompute_worker.py``, handler
``shim-pertokendetok`` in ``q5_shim.py``, the comparison column of ``detok_bench.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollout_backends.adapters.dynamo._detok import IncrementalDetokenizer

LIBRARY_CHUNK = IncrementalDetokenizer.chunk


def chunk_per_token(
    self: IncrementalDetokenizer, token_ids: Sequence[int], *, last: bool = False
) -> tuple[list[str], str]:
    pieces = [self.step(int(t)) for t in token_ids]
    tail = self.finish() if last else ""
    if tail and pieces:
        pieces[-1] += tail
    return pieces, "".join(pieces) if pieces else tail


def patch() -> None:
    IncrementalDetokenizer.chunk = chunk_per_token  # type: ignore[method-assign]
