"""Call timeouts served by one event-loop timer per timeout value, instead of one per call.

``asyncio.timeout`` arms a loop timer for every call. The loop keeps its timers in a heap whose
comparisons run in Python (``TimerHandle.__lt__``): every push, and every pop of a cancelled
handle once its call has ended, costs a few of them, plus the handle, its context copy and the
two coroutines of ``async with``; with hundreds of calls in flight that was a visible share of
each call in the client-overhead benchmark, and these deadlines cost a fraction of it (the figures:
``docs/benchmarks.md``, "Figures behind the hot path").

Calls that share a timeout value reach their deadlines in the order they started (the loop's
clock is monotonic), so per value a FIFO holds them in deadline order, and one timer, armed for
its oldest live deadline, serves them all. A call that ends marks its entry done (no timer to
cancel); the timer skips done entries when it fires and re-arms for the next live one.

What a deadline does is ``asyncio.timeout``'s (Python 3.11+, which has ``Task.uncancel``): at
the deadline the task is cancelled; leaving the block with that cancellation raises
``TimeoutError``, unless the task was also cancelled from elsewhere, in which case the
``CancelledError`` goes on. A deadline fires at its time to within the loop's clock resolution,
as a loop timer does.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from types import TracebackType
from typing import Any, Protocol, cast

__all__ = ["Deadline", "Deadlines"]

_LIVE, _DONE, _FIRED = 0, 1, 2
#: Distinct timeout values served by shared timers; a call with yet another value gets a timer of
#: its own (as with ``asyncio.timeout``), so that odd per-call values cannot grow the table.
MAX_SHARED = 8
#: Done entries a queue may hold behind a slow live one before it is compacted (memory bound).
_COMPACT_AFTER = 256
#: The loop runs a timer when its time is within the clock's resolution (``BaseEventLoop``).
_RESOLUTION = time.get_clock_info("monotonic").resolution


class _Task(Protocol):
    """What a deadline uses of its task. ``cancelling``/``uncancel`` are 3.11+ (typeshed hides
    them when mypy checks for 3.10, where the HTTP core does not use this module)."""

    def cancel(self, msg: Any = None) -> bool: ...

    def cancelling(self) -> int: ...

    def uncancel(self) -> int: ...


class Deadline:
    """One call's deadline; a (synchronous) context manager around the call's awaits."""

    __slots__ = ("_cancelling", "_handle", "_queue", "_state", "_task", "when")

    def __init__(self, when: float, task: _Task) -> None:
        self.when = when
        self._task: _Task | None = task
        self._cancelling = task.cancelling()
        self._state = _LIVE
        self._queue: _Queue | None = None
        #: Only for a deadline with a timer of its own.
        self._handle: asyncio.TimerHandle | None = None

    @property
    def expired(self) -> bool:
        return self._state == _FIRED

    def __enter__(self) -> Deadline:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state == _LIVE:
            self._state = _DONE
            self._task = None  # a done entry may wait in its queue a while: keep nothing alive
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None
                return
            queue = self._queue
            if queue is None:
                return
            # Drop the done entries at the front; compact when many wait behind a slow live one.
            # (Inline, not a method: this runs once per call.)
            queue.done += 1
            entries = queue.entries
            while entries and entries[0]._state != _LIVE:
                entries.popleft()
                queue.done -= 1
            if queue.done > _COMPACT_AFTER and 2 * queue.done > len(entries):
                queue.entries = deque(e for e in entries if e._state == _LIVE)
                queue.done = 0
            return
        task, self._task = self._task, None
        # Fired: the timer cancelled the task. As asyncio.Timeout.__aexit__: our cancellation
        # becomes TimeoutError unless another cancel request came as well.
        if (
            task is not None
            and task.uncancel() <= self._cancelling
            and exc_type is not None
            and issubclass(exc_type, asyncio.CancelledError)
        ):
            raise TimeoutError from exc

    def _fire(self) -> None:
        self._state = _FIRED
        self._handle = None
        if self._task is not None:
            self._task.cancel()


class _Queue:
    """The live deadlines of one timeout value, oldest first, and the one timer serving them."""

    __slots__ = ("done", "entries", "loop", "owner", "timeout", "timer")

    def __init__(self, owner: Deadlines, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.owner = owner
        self.loop = loop
        self.timeout = timeout
        self.entries: deque[Deadline] = deque()
        self.done = 0  # entries in ``entries`` that are done (fired ones are never kept)
        self.timer: asyncio.TimerHandle | None = None

    def expire(self) -> None:
        """The timer: fire every deadline that is due, then re-arm for the next live one."""
        self.timer = None
        now = self.loop.time() + _RESOLUTION
        entries = self.entries
        while entries:
            head = entries[0]
            if head._state != _LIVE:
                entries.popleft()
                self.done -= 1
            elif head.when <= now:
                entries.popleft()
                head._fire()
            else:
                break
        if entries:
            self.timer = self.loop.call_at(entries[0].when, self.expire)
        elif self.owner._queues.get(self.timeout) is self:
            del self.owner._queues[self.timeout]


class Deadlines:
    """The deadlines of one client's calls, inside one event loop at a time.

    ``with deadlines.enter(timeout): await ...`` bounds the block as
    ``async with asyncio.timeout(timeout)`` does.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[float, _Queue] = {}

    def enter(self, timeout: float) -> Deadline:
        """The current task's deadline, ``timeout`` seconds from now."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a deadline must be entered inside a task")
        return self._enter(loop, cast("_Task", task), timeout)

    def _enter(self, loop: asyncio.AbstractEventLoop, task: _Task, timeout: float) -> Deadline:
        if loop is not self._loop:  # timers of another (finished) loop are gone with it
            self._loop = loop
            self._queues = {}
        deadline = Deadline(loop.time() + timeout, task)
        queue = self._queues.get(timeout)
        if queue is None:
            if len(self._queues) >= MAX_SHARED:
                deadline._handle = loop.call_at(deadline.when, deadline._fire)
                return deadline
            queue = self._queues[timeout] = _Queue(self, loop, timeout)
        deadline._queue = queue
        queue.entries.append(deadline)
        if queue.timer is None:
            # Armed for the oldest entry; a timer left armed for an entry that has since ended
            # fires early, finds nothing due and re-arms: the timer never fires late.
            queue.timer = loop.call_at(queue.entries[0].when, queue.expire)
        return deadline

    @property
    def pending(self) -> int:
        """Live deadlines (diagnostics and tests)."""
        return sum(len(q.entries) - q.done for q in self._queues.values())
