"""The pytest plugin on ``fake://`` backends: outcomes, the closing summary, parity per pair.

Each test runs ``pytest --pyargs rollout_backends.conformance`` in a subprocess, as a user would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE = "tests.conformance.fake_backend"


def _pytest(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "rollout_backends.conformance", "-q", "-rfEs"]
    cmd += ["-p", "no:cacheprovider", "-p", "no:sglang_tests", "-p", "no:trtllm_tests", "-p", "no:vllm_tests", *args]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


def _section(out: str, title: str) -> str:
    m = re.search(rf"=+ {re.escape(title)} =+\n(.*?)(?:\n=+ |\Z)", out, re.S)
    assert m, out[-3000:]
    return m.group(1)


def test_shifted_logprobs_with_no_harness_fail_and_the_gaps_are_listed(tmp_path: Path) -> None:
    out = _pytest("--rb-backend", "fake://?bugs=logprobs_shifted", "--rb-harness", f"{FAKE}:bare_harness", tmp=tmp_path)
    assert out.returncode == 1, out.stdout[-3000:]
    assert "FAILED" in out.stdout and "test_contract[fake://?bugs=logprobs_shifted-greedy_logprob_bound]" in out.stdout
    assert " error" not in out.stdout.strip().splitlines()[-1], out.stdout[-2000:]
    gaps = _section(out.stdout, "rollout-backends conformance: not checked")
    assert "no harness hook:" in gaps
    assert re.search(r"harness hook 'alt_weights_path' not provided: .*disk_update_matches_fresh", gaps), gaps
    assert "not declared by the backend:" in gaps and "distributed_update_matches_fresh" in gaps
    assert "parity needs two --rb-backend URLs" in gaps


def test_harness_problems_are_errors_and_backend_bugs_failures(tmp_path: Path) -> None:
    out = _pytest(
        "--rb-backend", "fake://?bugs=ignore_stop", "--rb-harness", f"{FAKE}:short_budget_harness",
        "--rb-check", "finish_stop_token", "--rb-check", "pause_abort", "--rb-check", "abort_one", tmp=tmp_path,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert "1 failed" in last and "2 errors" in last, out.stdout[-3000:]
    assert "FAILED test_conformance.py::test_contract[fake://?bugs=ignore_stop-finish_stop_token]" in out.stdout
    assert "ERROR at setup of test_contract[fake://?bugs=ignore_stop-pause_abort]" in out.stdout
    assert "raise Harness.long_max_new_tokens" in out.stdout and "not a verdict on the backend" in out.stdout
    gaps = _section(out.stdout, "rollout-backends conformance: not checked")
    assert "error (setup, harness or check; not a verdict on the backend):" in gaps and "pause_abort" in gaps


def test_parity_per_pair_selected_by_rb_check(tmp_path: Path) -> None:
    same, other = "fake://?seed=1", "fake://?seed=1&workers=2"
    differ = "fake://?seed=2"
    out = _pytest(
        "--rb-backend", same, "--rb-backend", other, "--rb-backend", differ,
        "--rb-harness", f"{FAKE}:bare_harness", "--rb-check", "parity", tmp=tmp_path,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:]
    assert f"FAILED test_conformance.py::test_parity[{same}~{differ}]" in out.stdout
    assert "greedy ids differ at case 0, token 0" in out.stdout
    assert f"PASS  parity[{same}~{other}]" in out.stdout
    assert f"FAIL  parity[{same}~{differ}]" in out.stdout and f"FAIL  parity[{other}~{differ}]" in out.stdout
    # hf_logprob_parity is in the parity group too: skipped on each (no HF model), and said so.
    assert "harness hook 'hf_model_path' not provided: hf_logprob_parity" in out.stdout
    last = out.stdout.strip().splitlines()[-1]
    assert "2 failed, 1 passed, 3 skipped" in last, out.stdout[-3000:]
    only = _pytest("--rb-backend", same, "--rb-backend", other, "--rb-harness", f"{FAKE}:bare_harness",
                   "--rb-check", "greedy_shapes", tmp=tmp_path)  # fmt: skip
    assert only.returncode == 0 and "test_parity" not in only.stdout and "2 passed" in only.stdout, only.stdout[-2000:]


def test_a_harness_that_cannot_be_built_is_an_error_per_check(tmp_path: Path) -> None:
    out = _pytest("--rb-backend", "fake://", "--rb-harness", f"{FAKE}:broken_harness",
                  "--rb-check", "greedy_shapes", "--rb-check", "finish_length", tmp=tmp_path)  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert "2 errors" in last and "failed" not in last, out.stdout[-3000:]
    assert "the harness cannot reach its checkpoint store" in out.stdout
