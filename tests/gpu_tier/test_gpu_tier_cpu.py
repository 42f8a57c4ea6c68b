"""The GPU tier command (``rb_bench.gpu_tier``) on CPU.

The end-to-end test runs the whole orchestration with ``--engine reference``: reference SGLang
servers (one direct, two behind a real ``smg``), a Dynamo frontend with a reference worker, an
oracle on the alt weights; parity, drift, a few checks on each, the result files, teardown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rb_bench import with_bench_path
from rb_bench.gpu_tier import (
    BACKENDS,
    DEFAULT_BACKENDS,
    LOGS_TAIL,
    RESULTS_JSON,
    RESULTS_MD,
    TierConfig,
    _Running,
    _Tier,
    config_from_args,
    main,
)
from rollout_backends.conformance import select_checks
from tests.conformance.fake_backend import fake_factory, fake_harness

CHECKS = (
    "greedy_shapes",
    "disk_update_matches_fresh",
    "distributed_update_matches_fresh",
    "injected_failure_rolls_back",
)


def test_placement_and_sender_reasons(tmp_path: Path) -> None:
    one = TierConfig(out=tmp_path, gpus=("0",))
    assert one.trainer_gpu is None
    assert one.gpus_of("smg") == ("0", "0") and one.gpus_of("direct") == ("0",)
    for key in BACKENDS:
        reason = one.sender_unavailable(key)
        assert reason is not None and "NCCL needs trainer and engine on different GPUs" in reason
    two = TierConfig(out=tmp_path, gpus=("0", "1"))
    assert two.trainer_gpu == "1" and two.gpus_of("dynamo") == ("0",)
    assert two.sender_unavailable("direct") is None and two.sender_unavailable("dynamo") is None
    assert "share GPU 0" in (two.sender_unavailable("smg") or "")
    three = TierConfig(out=tmp_path, gpus=("0", "1", "2"))
    assert three.gpus_of("smg") == ("0", "1") and three.sender_unavailable("smg") is None
    # reference workers broadcast over gloo: no GPU placement needed
    assert TierConfig(out=tmp_path, engine="reference").sender_unavailable("smg") is None


def test_a_second_dynamo_fleet_needs_its_interpreter(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--dynamo16-python"):
        TierConfig(out=tmp_path, backends=("dynamo16",))
    assert config_from_args(["--out", str(tmp_path)]).backends == DEFAULT_BACKENDS
    cfg = config_from_args(["--out", str(tmp_path), "--dynamo16-python", "/opt/py16"])
    assert cfg.backends == (*DEFAULT_BACKENDS, "dynamo16") and cfg.gpus_of("dynamo16") == ("0",)


def test_cli_rejects_a_typo_before_starting_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path / "o"), "--engine", "reference", "--check", "no_such_check"]) == 2
    assert "no check matches" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "o"), "--backends", "direct,vllm"]) == 2
    assert not (tmp_path / "o").exists()


async def test_budget_stops_starting_checks(tmp_path: Path) -> None:
    """Checks start only while ``min_check_s`` of the budget is left; the rest are "not run"."""
    cfg = TierConfig(out=tmp_path / "out", engine="reference", backends=("direct",), min_check_s=1.0, quiet=True)
    tier = _Tier(cfg)
    harness = fake_harness(tmp_path)

    async def close() -> None:
        return None

    tier.running["direct"] = _Running(
        key="direct",
        name="sglang-direct",
        description="fake",
        factory=fake_factory(1),
        close=close,
        workers=1,
        startup_s=0,
    )
    tier.harness_for = lambda key: harness  # type: ignore[method-assign]
    tier.work_deadline = time.monotonic() + 1.6
    await tier.all_suites()  # selects every check: stops early by the budget
    run = tier.result.runs["direct"]
    assert run.results, "the first checks ran"
    assert run.not_run, "later checks were not started"
    assert len(run.results) + len(run.not_run) == len(select_checks(None))
    assert time.monotonic() < tier.work_deadline + 30


def _leftovers(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append(f"{pid}: {cmd[:200]}")
    return found


@pytest.mark.slow
def test_gpu_tier_reference_end_to_end(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    argv = [sys.executable, "-m", "rb_bench.gpu_tier", "--out", str(out), "--engine", "reference",
            "--budget-s", "240", "--work-dir", str(work)]  # fmt: skip
    for c in CHECKS:
        argv += ["--check", c]
    env = with_bench_path(os.environ)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, env=env)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "gpu-tier reference: OK" in proc.stdout

    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([RESULTS_MD, RESULTS_JSON, LOGS_TAIL])
    assert all((out / f).stat().st_size < 4 * 1024 * 1024 for f in files)

    data: dict[str, Any] = json.loads((out / RESULTS_JSON).read_text())
    assert data["engine"] == "reference" and data["ok"] is True
    assert set(data["backends"]) == {BACKENDS[k] for k in DEFAULT_BACKENDS}  # vLLM's: rb_bench.vllm_tier
    for name, b in data["backends"].items():
        assert b["started"], name
        outcomes = {r["name"]: r["outcome"] for r in b["results"]}
        assert outcomes == dict.fromkeys(CHECKS, "pass"), (name, outcomes)
        assert b["cache_hit_drift"]["ids_identical"] == b["cache_hit_drift"]["prompts"]
        assert b["cache_hit_drift"]["cached_tokens_second_run"] > 0
    assert data["oracle"]["started"]
    parity = data["parity"]
    assert parity["ok"] and len(parity["pairs"]) == 6 and all(p["ids_equal"] for p in parity["pairs"])
    assert all(h["tokens"] > 0 and h["max_abs_dlogprob"] < 2e-2 for h in parity["transformers"])
    # The reference servers return prompt logprobs: parity compares them, and the table says so.
    assert all(p["prompt_logprobs_compared"] and p["max_abs_dprompt_logprob"] == 0 for p in parity["pairs"])

    md = (out / RESULTS_MD).read_text()
    assert "max \\|Δ prompt logprob\\|" in md and "not compared" not in md
    assert "# Conformance results: GPU tier" in md and "| injected_failure_rolls_back |" in md
    # every process is gone and the models and logs stayed in --work-dir
    assert not _leftovers(str(work)), _leftovers(str(work))
    assert (work / "model-seed0" / "model.safetensors").is_file()


# The engine side of SGLang 0.5.16's distributed update (``init_custom_process_group`` in
# sglang/srt/utils/common.py and ``update_weights_from_distributed`` in weight_updater.py), reduced
# to what it does with torch.distributed, with gloo on CPU instead of NCCL.
_ENGINE_RANK = r"""
import sys, datetime, torch, torch.distributed
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
url, world, group_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
timeout = datetime.timedelta(seconds=60)
store, rank, world = next(rendezvous(url, 1, world, timeout=timeout))
store.set_timeout(timeout)
store = PrefixStore(group_name, store)
pg, _ = _new_process_group_helper(world, 1, [], Backend("gloo"), store, group_name=group_name,
                                  backend_options=None, timeout=timeout, device_id=None)
_world.pg_group_ranks[pg] = {i: i for i in range(world)}
shapes = [(4, 3), (5,)]
got = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
for h in [torch.distributed.broadcast(t, src=0, group=pg, async_op=True) for t in got]:
    h.wait()
print(repr([t.float().sum().item() for t in got]), flush=True)
torch.distributed.destroy_process_group(pg)
"""


def test_sender_group_matches_sglangs_construction() -> None:
    """``NcclWeightSender`` builds its group as SGLang's engines build theirs (checked over gloo)."""
    import torch

    from rb_bench.gpu_tier import NcclWeightSender
    from rollout_backends.adapters.reference import free_port

    port, name = free_port(), "rb-test-group"
    engine = subprocess.Popen(
        [sys.executable, "-c", _ENGINE_RANK, f"tcp://127.0.0.1:{port}", "2", name],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sender = NcclWeightSender("127.0.0.1", port, 2, name, device="cpu", backend="gloo", timeout_s=60)
    try:
        sender.connect()
        named = [
            ("a", torch.arange(12, dtype=torch.bfloat16).reshape(4, 3)),
            ("b", torch.ones(5, dtype=torch.bfloat16)),
        ]
        bucket = sender.broadcast(named)
        assert bucket.names == ["a", "b"]
        out, err = engine.communicate(timeout=60)
    finally:
        sender.close()
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    assert engine.returncode == 0, err[-2000:]
    assert out.strip() == repr([66.0, 5.0])


@pytest.mark.slow
def test_cpu_tier_full_suite_over_every_http_path(tmp_path: Path) -> None:
    """The whole suite via SGLang HTTP (direct, behind smg) and via the Dynamo frontend, on reference engines."""
    out, work = tmp_path / "out", tmp_path / "work"
    argv = [sys.executable, "-m", "rb_bench.gpu_tier", "--out", str(out), "--engine", "reference",
            "--budget-s", "400", "--work-dir", str(work), "--sequential"]  # fmt: skip
    # --sequential: one backend's checks at a time. On 2 cores, three suites at once starve the
    # servers' event loops enough that an abort can arrive after a 2048-token request finished.
    env = with_bench_path(os.environ)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=480, check=False, env=env)
    print(proc.stdout[-4000:])
    data: dict[str, Any] = json.loads((out / RESULTS_JSON).read_text())
    every = {c.name for c in select_checks(None)}
    for name, b in data["backends"].items():
        assert b["started"], name
        outcomes = {r["name"]: (r["outcome"], r.get("message") or "") for r in b["results"]}
        assert set(outcomes) == every, (name, every - set(outcomes))
        for check, (outcome, message) in outcomes.items():
            if outcome == "skip":
                continue
            assert outcome == "pass", (name, check, outcome, message)
    assert data["parity"]["ok"]
    assert not _leftovers(str(work)), _leftovers(str(work))


@pytest.mark.slow
def test_cpu_tier_stream_version_spans_run_over_dynamo(tmp_path: Path) -> None:
    """Our Dynamo workers stamp every chunk with its tokens' version (FlavorRoutes.chunk_versions):
    over the real frontend the streamed-spans checks, across a RETRACT and an IN_PLACE update, run
    (not skipped) and pass. The RETRACT one fails where the worker stamps every chunk with the
    finish's version (one span; checked by hand 2026-12-03)."""
    out, work = tmp_path / "out", tmp_path / "work"
    argv = [sys.executable, "-m", "rb_bench.gpu_tier", "--out", str(out), "--engine", "reference",
            "--backends", "dynamo", "--check", "stream_version_spans_across_update",
            "--check", "stream_version_spans_across_in_place_update",
            "--budget-s", "200", "--work-dir", str(work)]  # fmt: skip
    env = with_bench_path(os.environ)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=260, check=False, env=env)
    print(proc.stdout[-4000:])
    data: dict[str, Any] = json.loads((out / RESULTS_JSON).read_text())
    (b,) = data["backends"].values()
    outcomes = {r["name"]: r["outcome"] for r in b["results"]}
    want = {"stream_version_spans_across_update": "pass", "stream_version_spans_across_in_place_update": "pass"}
    assert outcomes == want, outcomes
    # connect()'s default asks the workers (our worker answers get_internal_state as dynamo.sglang 1.4.x).
    said = [n for n in data["notes"] if "memory saver" in n]
    assert said == [
        "dynamo-rr: memory saver asked of the workers: True (workers: enable_memory_saver is on on every "
        "worker); the launcher says nothing for these workers"
    ], said
    assert not _leftovers(str(work)), _leftovers(str(work))
