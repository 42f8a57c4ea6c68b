"""``as_completed``: results in finish order; leaving the block aborts the rest on the engines."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Mapping
from typing import Any

import pytest

import rollout_backends as rb
from rollout_backends import FinishReason, GenerateRequest, Generation, InvalidRequest, TransientError


class GatedBackend:
    """Each request waits for its gate; abort ends it engine-side with ABORT (like SGLang)."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.fail: dict[str, BaseException] = {}
        self.engine_side: set[str] = set()  # requests "on the engine"
        self.aborted: list[str] = []
        self.peak = 0

    def gate(self, rid: str) -> asyncio.Event:
        return self.gates.setdefault(rid, asyncio.Event())

    async def generate(self, request: GenerateRequest) -> Generation:
        rid = request.request_id
        self.engine_side.add(rid)
        self.peak = max(self.peak, len(self.engine_side))
        try:
            await self.gate(rid).wait()
            if rid in self.fail:
                raise self.fail[rid]
            reason = FinishReason.ABORT if rid in self.aborted else FinishReason.LENGTH
            return Generation(
                request_id=rid,
                output_ids=(1,),
                logprobs=(-0.5,),
                finish_reason=reason,
                weight_version="v0",
                prompt_tokens=len(request.input_ids),
            )
        finally:
            self.engine_side.discard(rid)

    async def abort(self, request_id: str) -> None:
        if request_id in self.engine_side:
            self.aborted.append(request_id)
            self.gate(request_id).set()


def reqs(n: int) -> list[GenerateRequest]:
    return [GenerateRequest(input_ids=(1, 2), request_id=f"r{i}") for i in range(n)]


def _b(backend: GatedBackend) -> Any:
    return backend  # structurally enough of a RolloutBackend for as_completed


async def _until(cond: Any) -> None:
    for _ in range(200):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def unretrieved(loop: asyncio.AbstractEventLoop) -> list[Mapping[str, Any]]:
    seen: list[Mapping[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    return seen


async def test_yields_in_finish_order() -> None:
    b = GatedBackend()
    got: list[str] = []
    async with rb.as_completed(_b(b), reqs(3)) as results:
        await _until(lambda: len(b.engine_side) == 3)
        b.gate("r2").set()
        async for gen in results:
            got.append(gen.request_id)
            if gen.request_id == "r2":
                b.gate("r0").set()
            elif gen.request_id == "r0":
                b.gate("r1").set()
    assert got == ["r2", "r0", "r1"]
    assert b.aborted == []


async def test_break_aborts_the_rest_on_the_engine_and_leaks_no_task() -> None:
    b = GatedBackend()
    before = len(asyncio.all_tasks())
    async with rb.as_completed(_b(b), reqs(5)) as results:
        await _until(lambda: len(b.engine_side) == 5)
        b.gate("r3").set()
        async for gen in results:
            assert gen.request_id == "r3"
            break
    assert sorted(b.aborted) == ["r0", "r1", "r2", "r4"]
    assert b.engine_side == set()
    assert len(asyncio.all_tasks()) == before


async def test_a_failure_raises_after_aborting_the_others_and_nothing_is_unretrieved() -> None:
    b = GatedBackend()
    seen = unretrieved(asyncio.get_running_loop())
    b.fail["r1"] = TransientError("worker went away")
    with pytest.raises(TransientError, match="worker went away"):
        async with rb.as_completed(_b(b), reqs(3)) as results:
            await _until(lambda: len(b.engine_side) == 3)
            b.gate("r1").set()
            async for _ in results:
                raise AssertionError("nothing finished before the failure")
    assert sorted(b.aborted) == ["r0", "r2"]
    assert b.engine_side == set()
    gc.collect()
    await asyncio.sleep(0)
    assert seen == []


async def test_cancelling_the_consumer_aborts_the_rest() -> None:
    b = GatedBackend()

    async def consume() -> None:
        async with rb.as_completed(_b(b), reqs(4)) as results:
            async for _ in results:
                pass

    task = asyncio.ensure_future(consume())
    await _until(lambda: len(b.engine_side) == 4)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(b.aborted) == ["r0", "r1", "r2", "r3"]
    assert b.engine_side == set()


async def test_max_in_flight_bounds_the_engine_and_keeps_every_request() -> None:
    b = GatedBackend()
    got: list[str] = []
    async with rb.as_completed(_b(b), reqs(7), max_in_flight=2) as results:
        assert results.pending == tuple(f"r{i}" for i in range(7))

        async def release() -> None:
            for i in range(7):
                await _until(lambda i=i: f"r{i}" in b.engine_side)
                b.gate(f"r{i}").set()

        releaser = asyncio.ensure_future(release())
        async for gen in results:
            got.append(gen.request_id)
        await releaser
    assert got == [f"r{i}" for i in range(7)]
    assert b.peak == 2


async def test_leaving_early_drops_what_never_started() -> None:
    b = GatedBackend()
    async with rb.as_completed(_b(b), reqs(6), max_in_flight=2) as results:
        await _until(lambda: len(b.engine_side) == 2)
        b.gate("r0").set()
        async for _ in results:
            break
    assert "r1" in b.aborted and set(b.aborted) <= {"r1", "r2"}  # r2 may not have reached the engine
    assert b.engine_side == set()
    assert not any(f"r{i}" in b.gates for i in range(3, 6))  # never sent


async def test_inputs_are_checked_under_their_names() -> None:
    b = GatedBackend()
    two = [GenerateRequest(input_ids=(1,), request_id="same"), GenerateRequest(input_ids=(2,), request_id="same")]
    with pytest.raises(InvalidRequest) as e:
        rb.as_completed(_b(b), two)
    assert e.value.field == "requests[1].request_id"
    with pytest.raises(InvalidRequest) as e:
        rb.as_completed(_b(b), [(1, 2)])  # type: ignore[list-item]
    assert e.value.field == "requests[0]"
    for bad in (0, True, 1.5):
        with pytest.raises(InvalidRequest) as e:
            rb.as_completed(_b(b), reqs(1), max_in_flight=bad)  # type: ignore[arg-type]
        assert e.value.field == "max_in_flight"
    with pytest.raises(InvalidRequest) as e:
        rb.as_completed(_b(b), reqs(1)).__aiter__()
    assert e.value.field == "as_completed"


async def test_group_variant_sends_generate_groups_requests() -> None:
    b = GatedBackend()
    sampling = rb.SamplingParams(max_new_tokens=4, seed=10)
    expected = rb.group_requests((5, 6), 3, sampling, group_id="g")
    async with rb.generate_group_as_completed(_b(b), (5, 6), 3, sampling, group_id="g") as results:
        assert results.pending == ("g-0", "g-1", "g-2")
        for r in expected:
            b.gate(r.request_id).set()
        got = [g.request_id async for g in results]
    assert sorted(got) == [r.request_id for r in expected]
    assert [r.sampling.seed for r in expected] == [10, 11, 12]
