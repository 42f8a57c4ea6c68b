"""The client-overhead benchmark runs end to end (tiny counts); no timing is checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rollout_backends._bench import overhead


def test_smoke_produces_a_table_with_every_client(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cells.json"
    assert overhead.main(["--smoke", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "client" not in line]
    for client in ("raw aiohttp", "raw httpx", "miles httpx", "ours"):
        assert any(f"| {client} " in r or f"| {client} (" in r for r in rows), (client, printed)
    assert "baseline: raw aiohttp" in printed
    data = json.loads(out.read_text())
    cells = data["cells"]
    assert {c["client"] for c in cells} >= {"raw aiohttp", "raw httpx", "miles httpx", "ours"}
    assert all(c["requests"] > 0 and c["errors"] == 0 for c in cells)
    assert data["meta"]["versions"]["aiohttp"]


def test_thin_script_imports_the_same_main() -> None:
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    try:
        from benchmarks import client_overhead
    finally:
        sys.path.remove(str(root))
    assert client_overhead.main is overhead.main
