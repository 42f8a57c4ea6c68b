"""Every conformance check on the reference backend: in process, and through reference:// URLs.

The whole CPU tier (this file) runs in well under five minutes on two cores.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rollout_backends as rb
from rollout_backends.adapters.reference import ReferenceBackend
from rollout_backends.conformance import ALL_CHECKS, Outcome, Report, check_parity, run_checks
from rollout_backends.conformance._reference import reference_harness

ROOT = Path(__file__).resolve().parents[2]
URL = "reference://?workers=2&seed=0"


@pytest.fixture(scope="module")
def reference_report() -> Report:
    """One run of the whole suite (default knobs, 200 concurrent requests) on a 2-worker fleet."""

    async def factory() -> rb.RolloutBackend:
        return ReferenceBackend.create(workers=2, seed=0)

    report = asyncio.run(run_checks(factory, reference_harness(URL), label="ReferenceBackend x2"))
    print("\n" + report.summary())
    return report


@pytest.mark.parametrize("name", [c.name for c in ALL_CHECKS])
def test_reference_backend_passes(reference_report: Report, name: str) -> None:
    result = reference_report[name]
    assert result.outcome is Outcome.PASS, f"{result.line()}\n{result.traceback or ''}"


def test_reference_suite_measurements(reference_report: Report) -> None:
    assert reference_report.ok and not reference_report.skipped
    assert reference_report["concurrent_equals_sequential"].measurements["requests"] == 200
    # The engine is deterministic: identical numbers wherever the weights are the same.
    for name in ("greedy_repeatable", "disk_update_matches_fresh", "distributed_update_matches_fresh"):
        assert reference_report[name].measurements["max_abs_dlogprob"] == 0.0
    assert reference_report["hf_logprob_parity"].measurements["max_abs_dlogprob"] < 1e-3


def test_parity_across_reference_fleets_and_transformers() -> None:
    harness = reference_harness(URL)

    def factory(workers: int) -> rb.conformance.BackendFactory:
        async def make() -> rb.RolloutBackend:
            return ReferenceBackend.create(workers=workers, seed=0)

        return make

    report = asyncio.run(
        check_parity({"one": factory(1), "two": factory(2)}, hf_model_path=harness.hf_model_path, max_new_tokens=12)
    )
    assert report.ok, report.summary()
    assert report.pairs[0].max_abs_dlogprob == 0.0 and report.cases == 8
    assert 0.0 < report.hf[0].max_abs_dlogprob < 1e-3  # measured, not assumed
    # Different weights: parity must fail (the comparison can fail).
    other = asyncio.run(
        check_parity(
            {
                "seed0": factory(1),
                "seed1": lambda: asyncio.sleep(0, ReferenceBackend.create(harness.alt_weights_path)),
            },
            max_new_tokens=8,
        )
    )
    assert not other.ok and not other.pairs[0].ids_equal


def _pytest(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--pyargs",
        "rollout_backends.conformance",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
    ]
    cmd += ["-p", "no:sglang_tests", "-p", "no:trtllm_tests", "-p", "no:vllm_tests", *args]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


def test_plugin_without_backend_is_one_clear_skip(tmp_path: Path) -> None:
    out = _pytest(tmp=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 skipped" in out.stdout and "no backend given: pass --rb-backend URL" in out.stdout


def test_plugin_runs_every_check_through_a_reference_url(tmp_path: Path) -> None:
    out = _pytest("--rb-backend", "reference://?workers=1&seed=0", "--rb-concurrency", "20", tmp=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    # every check passes but those that need two workers (pytest skips with the reason); then
    # parity against transformers
    skips = re.findall(r"^SKIPPED \[(\d+)\] .*: (.*)$", out.stdout, re.M)
    assert skips and {reason for _, reason in skips} == {"needs >= 2 workers, the fleet has 1"}, skips
    skipped = sum(int(k) for k, _ in skips)
    assert f"{len(ALL_CHECKS) - skipped + 1} passed, {skipped} skipped" in out.stdout, out.stdout[-3000:]
    assert "parity[reference://?workers=1&seed=0~transformers]" in out.stdout
    assert "rollout-backends conformance" in out.stdout  # the measurements section


def test_plugin_parity_across_two_urls_and_failures_are_failures(tmp_path: Path) -> None:
    out = _pytest(
        "--rb-backend", "reference://?workers=1", "--rb-backend", "reference://?workers=2",
        "--rb-check", "greedy_shapes", "--rb-check", "staleness_visible", "--rb-check", "parity", tmp=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:]
    # 2 x greedy_shapes, staleness on 2 workers (skip on 1), 2 x hf_logprob_parity, then parity:
    # the pair and each URL against transformers
    assert "8 passed, 1 skipped" in out.stdout, out.stdout[-3000:]
    assert "PASS  parity[reference://?workers=1~reference://?workers=2]" in out.stdout
    assert "PASS  parity[reference://?workers=2~transformers]" in out.stdout
    bad = _pytest(
        "--rb-backend", "fake://?bugs=positive_logprob", "--rb-harness", "tests.conformance.fake_backend:url_harness",
        "--rb-check", "greedy_shapes", "--rb-check", "health_live_ready", "--rb-check", "distributed_*", tmp=tmp_path,
    )  # fmt: skip
    assert bad.returncode == 1, bad.stdout[-3000:]
    # the bug fails its check; the others pass or skip (parity not selected)
    assert "1 failed, 1 passed, 1 skipped" in bad.stdout, bad.stdout[-3000:]
    assert "test_parity" not in bad.stdout
    assert "logprob[0]=" in bad.stdout and "> 0" in bad.stdout
    assert "weight transport 'distributed' not declared" in bad.stdout
