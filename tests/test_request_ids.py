"""A request id is in flight at most once per fleet: a duplicate is refused before anything is sent.

An engine refuses a duplicate only among its own requests; behind an entry that spreads requests
(round robin, a router) two calls with one id reach different workers and ``abort(id)`` then ends
both. The fleet refuses the second call itself, names ``request_id``, and the first runs on whole.
"""

from __future__ import annotations

import asyncio

import pytest

import rollout_backends as rb
from rollout_backends import FinishReason, GenerateRequest, SamplingParams
from rollout_backends._fleet import Fleet
from rollout_backends.testing import FakeFleet, fake_fleet

from .test_worker_loss import LosingDriver, _lost

LONG = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)


def _req(rid: str, sampling: SamplingParams = LONG) -> GenerateRequest:
    return GenerateRequest(input_ids=(5, 6, 7), sampling=sampling, request_id=rid)


async def _started(fleet: FakeFleet, rid: str) -> None:
    for _ in range(500):
        if any(rid in {r.request_id for r in d.requests} for d in fleet.fakes):
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"{rid} never reached a worker")


async def test_duplicate_in_flight_refused_across_workers_and_the_first_runs_whole() -> None:
    async with fake_fleet(2, token_delay=0.005) as fleet:
        first = asyncio.ensure_future(fleet.generate(_req("r")))
        await _started(fleet, "r")
        with pytest.raises(rb.InvalidRequest) as ei:
            await fleet.generate(_req("r"))
        assert ei.value.field == "request_id" and "Duplicate request ID" in str(ei.value)
        gen = await first
        assert gen.finish_reason is FinishReason.LENGTH and len(gen.output_ids) == 40
        # The refused call reached no worker: round robin would have sent it to the other one.
        assert [r.request_id for d in fleet.fakes for r in d.requests] == ["r"]
        again = await fleet.generate(_req("r"))  # finished: the id is free again
        assert again.output_ids == gen.output_ids


async def test_claim_released_when_the_call_fails_or_is_cancelled() -> None:
    async with fake_fleet(1, token_delay=0.005) as fleet:
        with pytest.raises(rb.InvalidRequest):
            await fleet.generate(GenerateRequest(input_ids=(5, 10**6), sampling=LONG, request_id="bad"))
        short = SamplingParams(max_new_tokens=2, temperature=0.0)
        assert (await fleet.generate(GenerateRequest(input_ids=(5,), sampling=short, request_id="bad"))).output_ids
        task = asyncio.ensure_future(fleet.generate(_req("c")))
        await _started(fleet, "c")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len((await fleet.generate(_req("c", short))).output_ids) == 2


async def test_distinct_ids_run_concurrently() -> None:
    async with fake_fleet(2) as fleet:
        gens = await asyncio.gather(
            *(fleet.generate(_req(f"r{i}", SamplingParams(max_new_tokens=3))) for i in range(8))
        )
        assert sorted(g.request_id for g in gens) == [f"r{i}" for i in range(8)]


async def test_resend_after_worker_loss_keeps_the_claim() -> None:
    driver = LosingDriver("w0", fail=1, error=_lost)
    fleet = Fleet([driver])
    # The resend waits out the backoff: the id stays claimed in between.
    fleet.worker_loss = rb.WorkerLossPolicy(backoff_s=0.3, max_backoff_s=0.3)
    first = asyncio.ensure_future(fleet.generate(_req("r")))
    for _ in range(500):
        if driver.attempts:
            break
        await asyncio.sleep(0.002)
    with pytest.raises(rb.InvalidRequest) as ei:
        await fleet.generate(_req("r"))
    assert ei.value.field == "request_id"
    gen = await first
    assert gen.output_ids == (7, 8, 9) and driver.attempts == ["r", "r"]  # resent under the same id
    assert fleet.resends_after_worker_loss == 1
    await fleet.aclose()
