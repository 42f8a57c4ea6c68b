"""bench/rb_bench/grpo.py: the CPU smoke (reference workers behind the SGLang and Dynamo launchers,
the example's loop interleaved over both) and the analysis on planted numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rb_bench import grpo, with_bench_path
from rollout_backends.adapters.reference import cached_tiny_model

X = grpo.TIMES


def test_smoke_runs_the_loop_on_sglang_and_dynamo_with_the_same_samples(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rb_bench.grpo",
            "--smoke",
            "--model-path",
            str(cached_tiny_model(0)),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=with_bench_path(os.environ),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())["grpo"]
    lanes = {x["row"]: x for x in data["lanes"]}
    assert set(lanes) == {"sglang direct", "dynamo rr"}
    for lane in lanes.values():
        assert lane["error"] is None
        steps = lane["steps"]
        assert [s["version"] for s in steps] == ["initial", *(f"step-{k}" for k in range(1, len(steps)))]
        assert len(steps) == 3 and all(s["sync_s"] > 0 and s["per_tensor_sync_s"] > 0 for s in steps)
        assert all(
            abs(s["step_s"] - (s["rollout_s"] + s["train_s"] + s["sync_s"] + s["memory_s"])) < 1e-9 for s in steps
        )
        assert all(len(s["digests"]) == 2 * 4 for s in steps)
    # The reference engine samples by seed, the same on both paths: the same tokens, the same curve.
    assert [s["digests"] for s in lanes["dynamo rr"]["steps"]] == [
        s["digests"] for s in lanes["sglang direct"]["steps"]
    ]
    assert "identical through step 2" in res.stdout
    goals = {v["goal"] for v in data["verdicts"]}
    assert f"dynamo rr step ≤ 1.00{X} sglang direct (upper end ≤ 1.03)" in goals
    assert "sglang direct: sync ≤ 5% of the step" in goals
    md = (out / "benchmarks.md").read_text()
    assert "## GRPO loop" in md and "| sync share (flat) |" in md
    # Reference workers release their memory on both paths: the rows do the same work.
    assert "engine memory released around training: sglang direct yes, dynamo rr yes;" in md


def test_rows_that_release_memory_differently_are_flagged() -> None:
    same = grpo.memory_release_note({"sglang direct": False, "smg": False})
    assert same == "engine memory released around training: sglang direct no, smg no"
    differ = grpo.memory_release_note({"sglang direct": False, "dynamo kv": True})
    assert differ.endswith("dynamo kv yes (rows differ: their steps are not like for like)")


def _lane(row: str, step: list[float], sync: list[float], *, per_tensor: list[float] | None = None,
          digests: list[list[str]] | None = None) -> grpo.LaneResult:  # fmt: skip
    steps = []
    for k, (st, sy) in enumerate(zip(step, sync, strict=True)):
        s: dict[str, Any] = {"step": k, "rollout_s": st - sy - 0.1, "train_s": 0.1, "sync_s": sy, "memory_s": 0.0}
        s.update(step_s=st, mean_reward=0.1, digests=digests[k] if digests else ["a", "b"])
        if per_tensor is not None:
            s["per_tensor_sync_s"] = per_tensor[k]
        steps.append(s)
    return grpo.LaneResult(row, tuple(steps))


def test_ratios_shares_and_verdicts_on_planted_numbers() -> None:
    base = _lane("sglang direct", [9.0, 1.00, 1.02, 0.98, 1.01, 1.00], [0.5, 0.02, 0.02, 0.02, 0.02, 0.02],
                 per_tensor=[0.5, 0.10, 0.11, 0.10, 0.10, 0.09])  # fmt: skip
    same = _lane("dynamo rr", [9.0, 0.99, 1.01, 0.97, 1.00, 0.99], [0.5, 0.02, 0.02, 0.02, 0.02, 0.02])
    slow = _lane("dynamo kv", [9.0, 1.20, 1.22, 1.18, 1.21, 1.19], [0.5, 0.08, 0.08, 0.08, 0.08, 0.08])
    result = grpo.RunResult((base, same, slow))
    # block 0 (the warm-up) leaves the timing
    iv = grpo.part_ratio(result, "dynamo rr", "step")
    assert iv is not None and iv.blocks == 5 and iv.estimate == pytest.approx(4.96 / 5.01)
    share = grpo.sync_share(result, "sglang direct")
    assert share is not None and share.estimate == pytest.approx(0.10 / 5.01)
    before = grpo.sync_share(result, "sglang direct", before=True)
    assert before is not None and before.estimate == pytest.approx(0.50 / (5.01 - 0.10 + 0.50))
    assert grpo.sync_share(result, "dynamo rr", before=True) is None  # no per-tensor pushes measured
    v = dict(grpo.verdicts(result))
    assert v[f"dynamo rr step ≤ 1.00{X} sglang direct (upper end ≤ 1.03)"].startswith("MET")
    assert v[f"dynamo kv step ≤ 1.00{X} sglang direct (upper end ≤ 1.03)"].startswith("MISSED")
    assert v["sglang direct: sync ≤ 5% of the step"].startswith("MET")
    assert v["dynamo kv: sync ≤ 5% of the step"].startswith("MISSED")  # 6.6 %
    text = grpo.tables(result)
    assert "| dynamo kv |" in text and "baseline" in text


def test_first_difference_names_the_step_and_the_sample() -> None:
    a = [["x", "y", "z"], ["p", "q", "r"], ["s", "t", "u"]]
    b = [["x", "y", "z"], ["p", "Q", "r"], ["s", "t", "u"]]
    result = grpo.RunResult(
        (_lane("sglang direct", [1, 1, 1], [0, 0, 0], digests=a), _lane("smg", [1, 1, 1], [0, 0, 0], digests=b),
         _lane("dynamo rr", [1, 1, 1], [0, 0, 0], digests=a))
    )  # fmt: skip
    assert grpo.first_difference(result, "smg") == "step 1, sample 1 (of 3)"
    assert grpo.first_difference(result, "dynamo rr") == "identical through step 2"


def test_the_example_loads_from_the_checkout() -> None:
    mod = grpo.load_example()
    assert mod.PLACEMENTS == ("colocated", "disk", "distributed") and grpo.load_example() is mod
