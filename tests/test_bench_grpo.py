"""bench/rb_bench/grpo.py: the CPU smoke (reference workers behind the SGLang and Dynamo launchers,
the example's loop interleaved over both) and the analysis on planted numbers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

from rb_bench import grpo, with_bench_path
from rb_bench.stats import paired_ratio
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
        # every step records when the rollout's answers came back (client-side, all sent at once)
        assert all(0 < s["latency_first_s"] <= s["latency_median_s"] <= s["latency_last_s"] for s in steps)
        assert all(s["latency_last_s"] <= s["rollout_s"] for s in steps)
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


# -- --combine: several runs pooled -----------------------------------------------------------------

WORKLOAD = f"2 prompts {X} 4 samples {X} 8 new tokens (planted)"


def _run(lanes: tuple[grpo.LaneResult, ...], date: str, workload: str = WORKLOAD) -> grpo.RunResult:
    meta = {"date": date, "machine": "test machine", "gpu": "none", "versions": {"python": "3"}, "commit": "abc",
            "command": "python -m rb_bench.grpo --smoke", "duration_s": 60.0}  # fmt: skip
    info = {"workload": workload, "fleets": "one worker each", "memory": "—", "notes": [f"ran on {date}"]}
    return grpo.RunResult(lanes, info, meta)


def _write(folder: Path, run: grpo.RunResult) -> Path:
    """``results.json`` as a run writes it (the run's own writer, ``_emit``)."""
    grpo._emit(run.meta, run, str(folder), "planted", [])
    return folder / "results.json"


# Run 1 alone does not decide the Dynamo row's step (3 timed blocks, spread); pooled with run 2 it does.
BASE_A, RR_A = [9.0, 1.00, 0.99, 1.01], [9.0, 0.95, 1.05, 0.97]
BASE_B, RR_B = [8.0, 1.01, 0.99, 1.03, 1.00], [8.0, 0.99, 0.98, 1.01, 0.97]


def _two_runs() -> tuple[grpo.RunResult, grpo.RunResult]:
    a = _run((_lane("sglang direct", BASE_A, [0.5, 0.02, 0.02, 0.02]),
              _lane("dynamo rr", RR_A, [0.5, 0.03, 0.02, 0.02])), "2026-12-07 10:00:00 UTC")  # fmt: skip
    later = [["a", "b"], ["a", "b"], ["a", "X"], ["a", "b"], ["a", "b"]]  # run 2's Dynamo row samples differently
    b = _run((_lane("dynamo rr", RR_B, [0.5, 0.01, 0.01, 0.01, 0.01], digests=later),  # rows in another order
              _lane("sglang direct", BASE_B, [0.5, 0.02, 0.03, 0.02, 0.02])), "2026-12-07 11:00:00 UTC")  # fmt: skip
    return a, b


def test_pooled_runs_give_the_interval_over_the_union_of_their_blocks() -> None:
    a, b = _two_runs()
    pooled = grpo.pool([a, b])
    want = paired_ratio(RR_A[1:] + RR_B[1:], BASE_A[1:] + BASE_B[1:])
    assert grpo.part_ratio(pooled, "dynamo rr", "step") == want and want.blocks == 7
    rr = pooled.lane("dynamo rr")
    assert rr is not None and rr.series("step") == RR_A[1:] + RR_B[1:]
    share = grpo.sync_share(pooled, "dynamo rr")
    assert share == paired_ratio([0.03, 0.02, 0.02, 0.01, 0.01, 0.01, 0.01], RR_A[1:] + RR_B[1:])
    v = dict(grpo.verdicts(pooled))[f"dynamo rr step ≤ 1.00{X} sglang direct (upper end ≤ 1.03)"]
    assert v == f"MET: {want.format()}"
    alone = dict(grpo.verdicts(a))[f"dynamo rr step ≤ 1.00{X} sglang direct (upper end ≤ 1.03)"]
    assert alone.startswith("NOT DECIDED")
    # The reward curve and the first sample unlike are run 1's (run 2's Dynamo row differs at its step 2).
    assert rr.steps == a.lanes[1].steps and [x.row for x in pooled.lanes] == ["sglang direct", "dynamo rr"]
    assert grpo.first_difference(pooled, "dynamo rr") == "identical through step 3"
    assert grpo.first_difference(b, "dynamo rr") == "step 2, sample 1 (of 2)"
    notes = "; ".join(pooled.info["notes"])
    assert "pooled from 2 run(s)" in notes and "reward curve and first sample unlike from run 1" in notes
    assert "3 timed of 4 blocks" in notes and "4 timed of 5 blocks" in notes
    assert "reward per step (run 1)" in grpo.tables(pooled) and "reward per step (run 1)" not in grpo.tables(a)
    # One run pooled is that run: the same intervals as without pooling.
    assert grpo.part_ratio(grpo.pool([a]), "dynamo rr", "step") == grpo.part_ratio(a, "dynamo rr", "step")


def test_pooling_cuts_each_run_to_the_blocks_all_its_rows_finished() -> None:
    # Run 1: the Dynamo row failed in block 3; the baseline's blocks 3 and 4 (slow) have no partner there.
    base_a, rr_a = [9.0, 1.0, 1.05, 5.0, 5.0], [9.0, 2.0, 2.1]
    base_b, rr_b = [9.0, 1.1, 1.2, 1.15], [9.0, 2.2, 2.4, 2.3]
    failed = attrs.evolve(_lane("dynamo rr", rr_a, [0.1] * 3), error="block 3: boom")
    a = _run((_lane("sglang direct", base_a, [0.1] * 5), failed), "2026-12-07 10:00:00 UTC")
    b = _run((_lane("sglang direct", base_b, [0.1] * 4), _lane("dynamo rr", rr_b, [0.1] * 4)), "2026-12-07 11:00")
    pooled = grpo.pool([a, b])
    base, rr = pooled.lane("sglang direct"), pooled.lane("dynamo rr")
    assert base is not None and rr is not None
    assert base.series("step") == [1.0, 1.05, 1.1, 1.2, 1.15]
    assert rr.series("step") == [2.0, 2.1, 2.2, 2.4, 2.3]
    assert grpo.part_ratio(pooled, "dynamo rr", "step") == paired_ratio(rr.series("step"), base.series("step"))
    # Not what concatenating every step would pair: run 2's Dynamo blocks against run 1's slow baseline.
    unpaired = paired_ratio([2.0, 2.1, 2.2, 2.4, 2.3], [1.0, 1.05, 5.0, 5.0, 1.1])
    assert grpo.part_ratio(pooled, "dynamo rr", "step") != unpaired
    assert rr.error == "run 1: block 3: boom" and base.error is None
    assert "2 timed of 5 blocks" in "; ".join(pooled.info["notes"])


def test_runs_that_differ_are_refused_naming_the_file(tmp_path: Path) -> None:
    a, b = _two_runs()
    first = _write(tmp_path / "a", a)
    other = _write(tmp_path / "b", attrs.evolve(b, info={**b.info, "workload": "another workload"}))
    with pytest.raises(ValueError, match=re.escape(f"{other}: workload 'another workload' differs from {first}'s")):
        grpo.pool([grpo.load_result(first), grpo.load_result(other)])
    fewer = _write(tmp_path / "c", attrs.evolve(b, lanes=b.lanes[1:]))
    with pytest.raises(ValueError, match=re.escape(f"{fewer}: rows differ from {first}'s (missing: ['dynamo rr']")):
        grpo.pool([grpo.load_result(first), grpo.load_result(fewer)])
    with pytest.raises(SystemExit, match=re.escape(f"grpo --combine: {other}: workload")):
        grpo.main(["--combine", str(first), str(other)])
    with pytest.raises(SystemExit, match=re.escape(f"{first}: holds the run of 2026-12-07 10:00:00 UTC")):
        grpo.main(["--combine", str(first), str(first)])
    with pytest.raises(SystemExit, match=re.escape(f"{tmp_path / 'missing.json'}: not a GRPO results.json")):
        grpo.main(["--combine", str(first), str(tmp_path / "missing.json")])


_COMBINE = """
import sys
from rb_bench import grpo
rc = grpo.main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "sglang", "transformers", "dynamo") if m in sys.modules)
assert not heavy, f"--combine imported {heavy}"
sys.exit(rc)
"""


def test_combine_cli_pools_two_written_runs(tmp_path: Path) -> None:
    a, b = _two_runs()
    files = [str(_write(tmp_path / "a", a)), str(_write(tmp_path / "b", b))]
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-c", _COMBINE, "--combine", *files, "--out", str(out)],
                         capture_output=True, text=True, timeout=120, env=with_bench_path(os.environ))  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    want = paired_ratio(RR_A[1:] + RR_B[1:], BASE_A[1:] + BASE_B[1:])
    assert f"- dynamo rr step ≤ 1.00{X} sglang direct (upper end ≤ 1.03): MET: {want.format()}" in res.stdout
    assert "- sglang direct: sync ≤ 5% of the step: MET" in res.stdout
    assert "| sglang direct | 7 |" in res.stdout
    data = json.loads((out / "results.json").read_text())["grpo"]
    assert [len(x["timed_steps"]) for x in data["lanes"]] == [7, 7]
    assert data["meta"]["command"].endswith("# pools runs of: python -m rb_bench.grpo --smoke")
    assert [r["file"] for r in data["meta"]["runs"]] == files and data["meta"]["duration_s"] == "60.0 + 60.0"
    assert {v["verdict"] for v in data["verdicts"]} >= {f"MET: {want.format()}"}
    md = (out / "benchmarks.md").read_text()
    assert "pooled from 2 run(s)" in md and "run 1: ran on 2026-12-07 10:00:00 UTC" in md
    # The written pool reads back as it was; a single run's JSON keeps its old shape.
    back = grpo.load_result(out / "results.json")
    assert grpo.part_ratio(back, "dynamo rr", "step") == want
    assert "timed_steps" not in json.loads(Path(files[0]).read_text())["grpo"]["lanes"][0]
    with pytest.raises(SystemExit, match="one of the runs: pick another folder"):
        grpo.main(["--combine", *files, "--out", str(tmp_path / "a")])


def test_latency_spread_and_its_table() -> None:
    assert grpo.latency_spread([]) == {}
    got = grpo.latency_spread([0.30, 0.10, 0.20, 0.90])
    assert got == {"latency_first_s": 0.10, "latency_median_s": pytest.approx(0.25), "latency_last_s": 0.90}

    def lane(row: str, last: list[float]) -> grpo.LaneResult:
        steps = [{"step": k, "step_s": 1.0, "latency_first_s": 0.5, "latency_median_s": 0.6, "latency_last_s": x}
                 for k, x in enumerate(last)]  # fmt: skip
        return grpo.LaneResult(row, tuple(steps))

    result = grpo.RunResult((lane("sglang direct", [9.0, 1.0, 1.0, 1.0]), lane("dynamo kv", [9.0, 1.1, 1.2, 1.1])))
    text = grpo.latency_table(result)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines()[2:]
            if line.startswith("| ") and not line.startswith("| row")}  # fmt: skip
    # the warm-up (9.0) leaves the means; last minus first per step, then the mean
    assert rows["sglang direct"][:5] == ["0.500", "0.600", "1.000", "0.500", "baseline"]
    assert rows["dynamo kv"][2:4] == ["1.133", "0.633"]
    assert rows["dynamo kv"][4].startswith("1.133")
    # runs saved before the field existed: no table
    assert grpo.latency_table(grpo.RunResult((_lane("sglang direct", [1.0, 1.0], [0.1, 0.1]),))) == ""
