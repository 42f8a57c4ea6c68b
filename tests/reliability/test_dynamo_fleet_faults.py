"""Real processes: a Dynamo frontend (round robin; 1.4.2, or 1.6.1 in ``make test-dynamo16``) over
three ``dynamo.mocker`` workers, and over two reference workers (exact tokens). SIGKILL mid-load,
detection, resends, restart.

Dynamo 1.4.2 keeps routing to a killed worker until its discovery lease expires (~10 s); those
requests fail with HTTP 500 "Failed to generate completions" = ``ConnectionFailed(nothing_generated=True)``,
which ``RetryPolicy(generate_resends=N)`` resends, and requests cut off mid-answer, which the
fleet's default ``WorkerLoss.RESEND`` resends whole. 1.6.1 drops the instance at the first failed
dispatch; ``/v1/completions`` answers 503 (``Overloaded``, not resendable: running requests get it
too), native ``/generate`` (reference workers) a resendable 500 before the stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from rb_bench.soak import LoadReport, run_load
from rollout_backends import GenerateRequest, SamplingParams, WorkerLoss, WorkerLossPolicy
from rollout_backends._http import HttpClient
from rollout_backends.adapters.dynamo import DynamoFleet, RunningDynamoFleet, launch_dynamo_fleet
from rollout_backends.kit import HttpFleetBackend

from .conftest import HAS_DYNAMO, is_loopback, listening_addresses, size

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HAS_DYNAMO, reason="ai-dynamo is not installed"),
    pytest.mark.asyncio(loop_scope="module"),
]

TIMEOUT_S = 10.0
TYPED_FAILURES = {"BackendUnavailable", "ConnectionFailed", "BackendTimeout", "Overloaded"}
MOCK_SAMPLING = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


def _mock_req(i: int) -> GenerateRequest:
    return GenerateRequest(input_ids=[1 + i % 50, 2, 3, 4 + i % 7], sampling=MOCK_SAMPLING)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mocker(tiny_model: Path, no_orphans: None) -> AsyncIterator[tuple[RunningDynamoFleet, HttpFleetBackend]]:
    cfg = DynamoFleet(
        model_path=tiny_model, workers=3, worker_kind="mocker", router_mode="round-robin", mocker_speedup_ratio=1.0
    )
    async with launch_dynamo_fleet(cfg) as fleet:
        backend = await fleet.connect(client=HttpClient(timeout=TIMEOUT_S, control_timeout=5.0))
        yield fleet, backend


async def _kill_under_load(
    fleet: RunningDynamoFleet, b: HttpFleetBackend, index: int, n: int
) -> tuple[LoadReport, float, list[Any]]:
    victim = b.workers[index]
    killed: list[float] = []
    failures: list[Any] = []

    async def generate(req: GenerateRequest) -> Any:
        try:
            return await b.generate(req)
        except Exception as exc:
            failures.append(exc)
            raise

    def on_done(i: int, outcome: str) -> None:
        if i >= n // 4 and not killed:
            fleet.kill_worker(index)
            killed.append(time.monotonic())

    async def watch() -> float:
        while not killed:
            await asyncio.sleep(0.01)
        while True:
            report = await b.health()
            if not report.worker(victim).live:
                return time.monotonic() - killed[0]
            assert time.monotonic() - killed[0] < 10, report
            await asyncio.sleep(0.05)

    watcher = asyncio.ensure_future(watch())
    report = await run_load(generate, _mock_req, n, concurrency=8, timeout_s=TIMEOUT_S, on_done=on_done)
    detect = await asyncio.wait_for(watcher, 15)
    return report, detect, failures


def _configured_ports(fleet: RunningDynamoFleet) -> set[int]:
    """The ports the launcher picked: frontend HTTP, the RL admin port, each worker's system and rpc."""
    ports = {int(fleet.frontend_url.rsplit(":", 1)[1])}
    ports.add(int(str(fleet.supervisor.process("frontend").spec.env["DYN_RL_PORT"])))
    for url in fleet.worker_urls:
        ports.add(int(url.rsplit(":", 1)[1]))
        ports.add(fleet.rpc_ports[url])
    return ports


def _check(report: LoadReport) -> None:
    assert report.lost == 0 and report.hung == 0 and not report.untyped, report.summary()
    assert set(report.errors) <= TYPED_FAILURES, report.summary()
    assert report.max_latency_s <= TIMEOUT_S + 2.0, report.summary()


async def test_mocker_death_restart_and_resends(
    mocker: tuple[RunningDynamoFleet, HttpFleetBackend], figures: dict[str, Any]
) -> None:
    fleet, b = mocker
    n = size(200, 1000)
    addrs = listening_addresses([p for n_ in fleet.supervisor.names for p in fleet.supervisor.group_pids(n_)])
    ours = _configured_ports(fleet)
    listening_ports = {int(a.rsplit(":", 1)[1]) for a in addrs}
    assert ours <= listening_ports, (ours, addrs)
    exposed = sorted(a for a in addrs if not is_loopback(a))
    # Every port the launcher chooses is on 127.0.0.1. Dynamo 1.4.2's ZMQ event plane binds its own
    # ephemeral ports on 0.0.0.0 (no setting for it): recorded, documented, never one of ours.
    assert not {int(a.rsplit(":", 1)[1]) for a in exposed} & ours, exposed
    figures["dynamo_listeners"] = {"ours_loopback": len(ours), "dynamo_event_plane_on_all_interfaces": exposed}

    # 1. No resends (WorkerLoss.FAIL): the requests routed to the dead instance fail, typed and flagged.
    b.worker_loss = WorkerLossPolicy(action=WorkerLoss.FAIL)
    try:
        report, detect, failures = await _kill_under_load(fleet, b, 2, n)
    finally:
        b.worker_loss = WorkerLossPolicy()
    print(f"\ndynamo mocker death, no resends: {report.summary()}; health saw it after {detect:.2f}s")
    _check(report)
    assert detect < 2.0
    assert all(getattr(e, "nothing_generated", False) for e in failures if type(e).__name__ == "ConnectionFailed")
    dead = b.workers[2]
    assert report.by_worker[dead] <= n // 4 + 8  # nothing served by the dead one after the kill

    # 2. Restart: the worker rejoins (health ready, and the frontend routes to it again).
    t0 = time.monotonic()
    await fleet.supervisor.restart(fleet.worker_name(2))
    await fleet.supervisor.wait_ready([fleet.worker_name(2)], timeout=60)
    deadline = time.monotonic() + 60
    while True:
        health = await b.health()
        if health.ready:
            break
        assert time.monotonic() < deadline, health
        await asyncio.sleep(0.2)
    rejoin_s = time.monotonic() - t0
    deadline = time.monotonic() + 30  # the lease of the old instance may still be listed: bounded wait
    # A clean round of round robin (no resends: one landing on the old instance's lease would be
    # resent to the next worker and skew the 10/10/10 split, seen 11/10/9 in a fresh-clone CI run).
    b.worker_loss = WorkerLossPolicy(action=WorkerLoss.FAIL)
    try:
        while True:
            after = await run_load(b.generate, _mock_req, 30, concurrency=3, timeout_s=TIMEOUT_S)
            if after.completed == 30:
                break
            assert time.monotonic() < deadline, after.summary()
            await asyncio.sleep(1.0)
    finally:
        b.worker_loss = WorkerLossPolicy()
    print(f"dynamo restart: ready after {rejoin_s:.1f}s; 30 requests after: {after.summary()}")
    served_by = dict(after.by_worker)
    # Round robin reaches all three again. (Known gap: the restarted mocker registers a new instance
    # id, which the adapter mapped once at connect: its generations carry worker=None.)
    assert len(served_by) == 3 and all(c == 10 for c in served_by.values()), served_by

    # 3. The default (WorkerLoss.RESEND): the same kill, and no request fails (issue 17: 3 failed in
    # flight before it, BackendUnavailable). 1.4.2 keeps routing to the dead instance until its
    # lease expires (~10 s), so each resend has about a 1-in-3 chance of landing there again: the
    # policy's 12 resends make 13 dead landings in a row negligible.
    resent_before = b.resends_after_worker_loss
    report2, detect2, _ = await _kill_under_load(fleet, b, 1, n)
    resent = b.resends_after_worker_loss - resent_before
    print(f"dynamo mocker death, WorkerLoss.RESEND: {report2.summary()}; {resent} resends; detected in {detect2:.2f}s")
    _check(report2)
    assert detect2 < 2.0
    assert report2.failed == 0 and report2.completed == n, report2.summary()
    assert resent > 0  # the kill did cut requests off: they were resent, not spared
    figures["dynamo_mocker_worker_death"] = {
        "workers": 3,
        "no_resends": {
            **report.summary(),
            "time_to_detect_s": round(detect, 3),
            "messages": sorted({f"{type(e).__name__}: {e}"[:200] for e in failures}),
        },
        "restart": {"ready_after_s": round(rejoin_s, 2), "served_after_restart": served_by},
        "worker_loss_resend": {**report2.summary(), "resends": resent, "time_to_detect_s": round(detect2, 3)},
    }


# -- reference workers: exact tokens survive a death ----------------------------------------------

REF_SAMPLING = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
REF_PROMPTS = [tuple(range(5 + i, 12 + i)) for i in range(8)]


def _ref_req(i: int) -> GenerateRequest:
    return GenerateRequest(input_ids=REF_PROMPTS[i % len(REF_PROMPTS)], sampling=REF_SAMPLING)


async def test_reference_worker_death_exact_tokens(tiny_model: Path, no_orphans: None, figures: dict[str, Any]) -> None:
    cfg = DynamoFleet(model_path=tiny_model, workers=2, worker_kind="reference", router_mode="round-robin")
    async with launch_dynamo_fleet(cfg) as fleet:
        b = await fleet.connect(client=HttpClient(timeout=TIMEOUT_S, control_timeout=5.0))
        # The default WorkerLoss.RESEND policy only (no transport-level generate_resends).
        expected = {}
        for i in range(len(REF_PROMPTS)):
            gens = [await b.generate(_ref_req(i)) for _ in range(2)]  # round robin: one on each worker
            assert gens[0].output_ids == gens[1].output_ids and gens[0].worker != gens[1].worker
            expected[REF_PROMPTS[i]] = gens[0].output_ids
        n = size(100, 400)
        got: list[tuple[tuple[int, ...], tuple[int, ...], str | None]] = []
        killed: list[float] = []

        async def generate(req: GenerateRequest) -> Any:
            g = await b.generate(req)
            got.append((req.input_ids, g.output_ids, g.worker))
            return g

        def on_done(i: int, outcome: str) -> None:
            if i >= n // 3 and not killed:
                fleet.kill_worker(1)
                killed.append(time.monotonic())

        report = await run_load(generate, _ref_req, n, concurrency=4, timeout_s=TIMEOUT_S, on_done=on_done)
        t0 = time.monotonic()
        health = await b.health()
        print(
            f"\ndynamo reference death (WorkerLoss.RESEND): {report.summary()}; {b.resends_after_worker_loss} resends"
        )
        _check(report)
        assert report.failed == 0 and report.completed == n, report.summary()
        assert not health.worker(b.workers[1]).live and time.monotonic() - t0 < 2.0
        assert all(out == expected[p] for p, out, _ in got), "a completed request has other tokens"
        figures["dynamo_reference_worker_death"] = {**report.summary(), "workers": 2, "exact_tokens": True}
