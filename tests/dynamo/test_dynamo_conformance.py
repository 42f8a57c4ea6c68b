"""The conformance suite on the CLI's default Dynamo fleet: a real frontend with the kv router and
our reference workers (CPU), two of them here (``launch dynamo`` starts one).

Until 2026-12-05 the suite ran over Dynamo only with round-robin routing (the GPU tier and its CPU
test), and ``abort_all`` failed 3 of 7 runs on this fleet: the frontend received one of three
concurrent requests 70 ms after the others, after ``abort_all()`` (``docs/conformance.md``).
Nothing but the URL is given: the checks that need alt weights or an oracle skip, and
``labels_follow_weights`` derives its own weights from the checkpoint the URL names. The mocker
fleet's run is in ``test_dynamo_mocker.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from rollout_backends import RolloutBackend
from rollout_backends.adapters.dynamo import DynamoFleet, RunningDynamoFleet, launch_dynamo_fleet
from rollout_backends.conformance import Harness, Outcome, run_checks

from .conftest import HAS_DYNAMO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HAS_DYNAMO, reason="ai-dynamo is not installed"),
    pytest.mark.asyncio(loop_scope="module"),
]

#: What the URL alone cannot give, and where the fleet's answers say nothing per token.
NOT_CHECKED = {
    "disk_update_matches_fresh",
    "tensor_update_matches_fresh",
    "distributed_update_matches_fresh",
    "stale_prefix_after_update",
    "injected_failure_rolls_back",
    "hf_logprob_parity",
    "version_spans_across_update",
    "stream_version_spans_across_update",
    "version_spans_across_in_place_update",
    "stream_version_spans_across_in_place_update",
    # Our worker sends a request's chunks when it ends: leaving a stream early cannot be seen.
    "stream_early_exit_aborts",
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def kv_fleet(tiny_model: Path, no_orphans: None) -> AsyncIterator[RunningDynamoFleet]:
    cfg = DynamoFleet(model_path=tiny_model, workers=2, worker_kind="reference", router_mode="kv")
    async with launch_dynamo_fleet(cfg) as fleet:
        yield fleet


async def test_the_suite_on_the_default_kv_fleet(kv_fleet: RunningDynamoFleet) -> None:
    async def factory() -> RolloutBackend:
        return await kv_fleet.connect()

    report = await run_checks(factory, Harness(concurrency=16, check_timeout_s=120.0), label="dynamo kv")
    print("\n" + report.summary())
    assert not report.failed and not report.errors, report.summary()
    assert {r.name for r in report.skipped} == NOT_CHECKED, report.summary()
    for name in ("abort_all", "labels_follow_weights", "min_version_after_partial_update", "top_k"):
        assert report[name].outcome is Outcome.PASS
