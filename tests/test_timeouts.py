"""Per-call deadlines with shared timers (``rollout_backends._timeouts``) behave as ``asyncio.timeout``."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import sys
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

import rollout_backends as rb
from rollout_backends._timeouts import MAX_SHARED, Deadline, Deadlines
from rollout_backends.kit import HttpClient, HttpRequest, RetryPolicy
from tests.aiohttp_app import serving

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 uses asyncio.wait_for instead")


# -- the bookkeeping against a model, on a fake clock --------------------------------------------


class _Handle:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class _Loop:
    """A clock and a timer heap, nothing else: ``advance`` runs what is due, in time order."""

    def __init__(self) -> None:
        self.now = 0.0
        self.heap: list[tuple[float, int, _Handle]] = []
        self.seq = itertools.count()

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> _Handle:
        h = _Handle(when, callback)
        heapq.heappush(self.heap, (when, next(self.seq), h))
        return h

    def advance(self, dt: float) -> None:
        self.now += dt
        for _ in range(100_000):  # a timer that keeps re-arming itself in the past is a bug
            if not (self.heap and self.heap[0][0] <= self.now):
                return
            _, _, h = heapq.heappop(self.heap)
            if not h.cancelled:
                h.callback()
        raise AssertionError("timers do not settle")

    @property
    def armed(self) -> int:
        return sum(not h.cancelled for _, _, h in self.heap)


class _Task:
    def __init__(self) -> None:
        self.cancels = 0
        self.requests = 0  # cancel requests still counted (cancelling())

    def cancel(self, msg: Any = None) -> bool:
        self.cancels += 1
        self.requests += 1
        return True

    def cancelling(self) -> int:
        return self.requests

    def uncancel(self) -> int:
        self.requests = max(0, self.requests - 1)
        return self.requests


_ops = st.lists(
    st.one_of(
        # start a call with one of a few timeouts (more distinct values than MAX_SHARED)
        st.tuples(st.just("enter"), st.sampled_from([1.0, 2.0, 5.0, *[float(10 + i) for i in range(MAX_SHARED + 2)]])),
        st.tuples(st.just("exit"), st.integers(0, 400)),  # end the n-th live call (modulo)
        st.tuples(st.just("advance"), st.sampled_from([0.0, 0.5, 1.0, 3.0, 7.0])),
    ),
    max_size=400,
)


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(_ops)
def test_deadlines_fire_exactly_the_overdue_live_calls(ops: list[tuple[str, Any]]) -> None:
    loop = _Loop()
    deadlines = Deadlines()
    live: list[tuple[Deadline, _Task, float]] = []
    ended: list[_Task] = []
    for op, arg in ops:
        if op == "enter":
            task = _Task()
            live.append((deadlines._enter(loop, task, arg), task, loop.now + arg))  # type: ignore[arg-type]
        elif op == "exit" and live:
            d, task, _ = live.pop(arg % len(live))
            fired = task.cancels > 0
            if fired:  # leaving with the timer's cancellation: TimeoutError, as asyncio.timeout
                with pytest.raises(TimeoutError):
                    d.__exit__(asyncio.CancelledError, asyncio.CancelledError(), None)
                assert task.requests == 0
            else:
                d.__exit__(None, None, None)
            ended.append(task)
        elif op == "advance":
            loop.advance(arg)
        # The model: a live call is cancelled once, exactly when its deadline has passed.
        for d, task, when in live:
            assert task.cancels == (1 if when <= loop.now else 0), (when, loop.now)
            assert d.expired == (when <= loop.now)
        assert deadlines.pending == sum(1 for _, t, _ in live if t.cancels == 0)
        # Bounded bookkeeping: a timer per shared value at most, plus one per unshared live call.
        assert loop.armed <= MAX_SHARED + len(live)
    loop.advance(1e6)
    assert all(t.cancels <= 1 for t in ended)  # an ended call is never cancelled afterwards
    assert all(t.cancels == 1 for _, t, _ in live)
    assert deadlines.pending == 0


def test_a_call_that_ended_is_never_cancelled_and_queues_stay_small() -> None:
    loop = _Loop()
    deadlines = Deadlines()
    slow = _Task()
    deadlines._enter(loop, slow, 100.0)  # type: ignore[arg-type]  # stays live: the others queue behind it
    tasks = []
    for _ in range(5000):
        t = _Task()
        deadlines._enter(loop, t, 100.0).__exit__(None, None, None)  # type: ignore[arg-type]
        tasks.append(t)
        loop.advance(0.001)
    assert max(len(q.entries) for q in deadlines._queues.values()) < 600  # compacted, not 5001
    loop.advance(200.0)
    assert slow.cancels == 1 and not any(t.cancels for t in tasks)


def test_odd_timeout_values_get_timers_of_their_own() -> None:
    loop = _Loop()
    deadlines = Deadlines()
    tasks = [_Task() for _ in range(50)]
    for i, t in enumerate(tasks):
        deadlines._enter(loop, t, 1.0 + i / 100)  # type: ignore[arg-type]
    assert len(deadlines._queues) == MAX_SHARED  # the table does not grow with odd values
    loop.advance(2.0)
    assert all(t.cancels == 1 for t in tasks) and deadlines.pending == 0


def test_a_new_event_loop_gets_timers_of_its_own() -> None:
    deadlines = Deadlines()
    old, new = _Loop(), _Loop()
    deadlines._enter(old, _Task(), 1.0)  # type: ignore[arg-type]  # that loop then stops for good
    task = _Task()
    deadlines._enter(new, task, 1.0)  # type: ignore[arg-type]
    new.advance(2.0)
    assert task.cancels == 1


def test_a_cancellation_from_elsewhere_is_not_turned_into_a_timeout() -> None:
    loop, task = _Loop(), _Task()
    d = Deadlines()._enter(loop, task, 1.0)  # type: ignore[arg-type]
    task.cancel()  # someone else cancels the task too
    loop.advance(2.0)
    assert d.expired and task.cancels == 2
    assert d.__exit__(asyncio.CancelledError, asyncio.CancelledError(), None) is None  # propagates
    assert task.requests == 1


# -- through the real transport, against a server that never answers one route -----------------


@pytest.fixture
async def server() -> Any:
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({})

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/hang", hang)
    app.router.add_get("/ok", ok)
    async with serving(app) as base:
        try:
            yield base
        finally:
            release.set()


def _client() -> HttpClient:
    return HttpClient(retry=RetryPolicy(attempts=1))


def _pending(client: HttpClient) -> int:
    deadlines = client.transport._deadlines  # type: ignore[attr-defined]
    assert isinstance(deadlines, Deadlines)
    return deadlines.pending


async def test_timeouts_fire_per_call_whatever_else_is_in_flight(server: str) -> None:
    client = _client()
    try:
        long = asyncio.ensure_future(client.send(HttpRequest("GET", f"{server}/hang", timeout=60.0)))
        ok = [asyncio.ensure_future(client.send(HttpRequest("GET", f"{server}/ok", timeout=60.0))) for _ in range(20)]
        with pytest.raises(rb.BackendTimeout, match="no answer in"):
            await client.send(HttpRequest("GET", f"{server}/hang", timeout=0.05))
        assert all(r.status == 200 for r in await asyncio.gather(*ok))
        assert not long.done()  # its own, longer deadline is still ahead
        # Distinct timeout values beyond the shared ones get timers of their own: same behaviour.
        short = [HttpRequest("GET", f"{server}/hang", timeout=0.05 + i / 1000) for i in range(MAX_SHARED + 3)]
        results = await asyncio.gather(*(client.send(r) for r in short), return_exceptions=True)
        assert all(isinstance(r, rb.BackendTimeout) for r in results)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):  # a cancellation is not a timeout
            await long
        assert _pending(client) == 0
    finally:
        await client.aclose()


async def test_a_call_that_answered_leaves_no_deadline_behind(server: str) -> None:
    client = _client()
    try:
        resp = await client.send(HttpRequest("GET", f"{server}/ok", timeout=0.05))
        assert resp.status == 200 and _pending(client) == 0
        await asyncio.sleep(0.2)  # well past that call's deadline: this task must not be cancelled
        assert (await client.send(HttpRequest("GET", f"{server}/ok", timeout=0.05))).status == 200
    finally:
        await client.aclose()


async def test_cancelling_a_task_during_a_call_propagates(server: str) -> None:
    client = _client()
    try:
        task = asyncio.ensure_future(client.send(HttpRequest("GET", f"{server}/hang", timeout=30.0)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _pending(client) == 0
    finally:
        await client.aclose()
