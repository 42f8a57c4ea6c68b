"""The benchmarks run end to end (tiny counts); no timing is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_backends._bench import fanout, overhead, report, weightsync


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


# -- RL fan-out routing and weight sync (issue 7 parts 2-4) -------------------------------------


class _Tok:
    """A stand-in tokenizer: one id per byte, and a chat template that only concatenates."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def _workload(**kw: object) -> fanout.Workload:
    args: dict[str, object] = dict(
        name="gsm8k", steps=2, prompts=3, samples=5, max_new_tokens=64, length_median=30.0, vocab_size=200, seed=0
    )
    args.update(kw)
    return fanout.make_workload(_Tok(), **args)  # type: ignore[arg-type]


def test_workload_is_fixed_by_its_seed_and_lengths_stay_in_range() -> None:
    a, b, c = _workload(), _workload(), _workload(seed=1)
    assert a == b
    assert a != c
    groups = [g for step in a.steps for g in step]
    assert len(a.steps) == 2 and len(groups) == 6 and all(g.samples == 5 for g in groups)
    lengths = [n for g in groups for n in g.lengths]
    assert all(8 <= n <= 64 for n in lengths) and len(set(lengths)) > 3  # drawn, not constant
    # Every prompt of a step shares the chat template and the system prompt (the prefix routers can use).
    assert len({g.prompt[:30] for g in groups}) == 1
    assert all(t < 200 for g in groups for t in g.prompt)
    assert a.planned_output_tokens() == sum(lengths)


def test_agentic_workload_plans_every_later_turn() -> None:
    w = _workload(name="agentic", turns=3, steps=1)
    for g in w.steps[0]:
        assert len(g.later_lengths) == g.samples and all(len(x) == 2 for x in g.later_lengths)
        assert len(g.user_turns) == g.samples and all(len(x) == 2 and all(x) for x in g.user_turns)
    assert w.planned_output_tokens() == sum(sum(g.lengths) + sum(map(sum, g.later_lengths)) for g in w.steps[0])


def test_weight_buckets_respect_the_limit_and_keep_the_order() -> None:
    import torch

    named = [(f"t{i}", torch.zeros(n, dtype=torch.bfloat16)) for i, n in enumerate([10, 30, 25, 100, 5, 5])]
    got = weightsync.buckets(named, limit_bytes=80)  # bf16: 2 bytes per element
    assert [[n for n, _ in b] for b in got] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert weightsync.nbytes(named) == 350


def test_markdown_section_is_replaced_in_place(tmp_path: Path) -> None:
    report.update_markdown(tmp_path, "fanout", "first")
    report.update_markdown(tmp_path, "weightsync", "ws")
    report.update_markdown(tmp_path, "fanout", "second")
    text = (tmp_path / "benchmarks.md").read_text()
    assert "first" not in text and text.index("second") < text.index("ws")
    assert text.count("<!-- begin fanout -->") == 1
    report.update_json(tmp_path, "a", {"x": 1})
    report.update_json(tmp_path, "b", 2)
    assert json.loads((tmp_path / "results.json").read_text()) == {"a": {"x": 1}, "b": 2}
    with pytest.raises(ValueError):
        report.check_name("a b.png")


def test_fanout_smoke_runs_every_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Reference workers behind real smg, and two Dynamo mockers behind a real frontend (skipped without them)."""
    pytest.importorskip("smg")
    pytest.importorskip("dynamo.frontend")
    assert fanout.main(["--engine", "mocker", "--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())["fanout"]
    planned = data["settings"]["planned_output_tokens"]
    rows = {(r["backend"], r["workload"], r["client"]): r for r in data["results"]}
    for workload in ("gsm8k", "agentic"):
        for backend in fanout.BACKENDS:
            r = rows[(backend, workload, "adapter")]
            assert r["status"] == "ok", r
            assert r["step_s"] and all(s > 0 for s in r["step_s"]) and r["tokens_per_s"] > 0
            assert 0 < r["p50_s"] <= r["p99_s"]
            # max_new_tokens per request + ignore_eos: exactly the planned tokens, on every backend.
            assert r["output_tokens"] == planned[workload], (backend, workload)
            if backend.startswith("sglang") or backend.startswith("smg"):
                assert r["prefix_hit"] > 0  # siblings share their prompt; reference workers report hits
    for client in ("adapter (paired)", "raw aiohttp (paired)"):
        assert rows[("sglang rr", "gsm8k", client)]["status"] == "ok"
    printed = capsys.readouterr().out
    for backend in fanout.BACKENDS:
        assert f"| {backend} |" in printed
    md = (tmp_path / "benchmarks.md").read_text()
    assert "## RL fan-out routing" in md and "--engine mocker --smoke" in md
    assert (tmp_path / "fanout.png").stat().st_size > 0
    assert len(list(tmp_path.iterdir())) <= 6


def test_weightsync_smoke_measures_every_cpu_transport(tmp_path: Path) -> None:
    # Its own process: tensor hand-over switches torch's sharing strategy for the whole process.
    res = subprocess.run(
        [sys.executable, "-m", "rollout_backends._bench.weightsync", "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((tmp_path / "results.json").read_text())["weightsync"]
    got = {m["transport"]: m for m in data["results"]}
    assert set(got) == {"raw broadcast", "gloo", "tensors", "disk"}
    for m in got.values():
        assert m["status"] == "ok" and len(m["rounds_s"]) == 2 and all(x > 0 for x in m["rounds_s"]), m
        assert m["nbytes"] > 0
    assert got["gloo"]["nbytes"] == got["raw broadcast"]["nbytes"] == got["tensors"]["nbytes"]
    assert "generated 4 tokens after the updates" in " ".join(data["notes"])
    assert "## Weight sync" in (tmp_path / "benchmarks.md").read_text()
