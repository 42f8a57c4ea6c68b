"""Results as they finish: ``as_completed`` over any ``RolloutBackend``.

Asynchronous RL consumes samples as they finish (a partial rollout starts training on the first
groups while stragglers run). ``asyncio.as_completed`` over ``backend.generate`` calls does that but
leaks: breaking out of the loop leaves the rest running on the engines, holding KV and GPU time,
and an exception from one of them is never retrieved. Here leaving the ``async with`` block, by
``break``, an exception or a cancellation, aborts every request still in flight on the engines
(``backend.abort(request_id)``, which returns its partial tokens there), then cancels and awaits
their tasks, so nothing runs on and nothing is left unretrieved.

    async with rb.as_completed(backend, requests, max_in_flight=256) as results:
        async for gen in results:
            buffer.append(gen)
            if len(buffer) >= batch_size:
                break          # the rest are aborted on the engines
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from types import TracebackType

from rollout_backends._errors import InvalidRequest
from rollout_backends._protocol import RolloutBackend
from rollout_backends._transaction import group_requests
from rollout_backends._types import GenerateRequest, Generation, SamplingParams

__all__ = ["Completions", "as_completed", "generate_group_as_completed"]


class Completions:
    """The running requests of one ``as_completed`` call; iterate inside ``async with``.

    Yields each ``Generation`` as it finishes (aborted ones too, with their partial tokens). The
    first request that raises ends the iteration with that error, after the others are aborted:
    no sample is silently dropped. ``pending`` lists the request ids not yet yielded.
    """

    def __init__(self, backend: RolloutBackend, requests: Sequence[GenerateRequest], max_in_flight: int | None) -> None:
        self._backend = backend
        self._queue = list(reversed(requests))  # popped from the end: submission order
        self._limit = max_in_flight
        self._running: dict[asyncio.Future[Generation], GenerateRequest] = {}
        self._entered = False
        self._closed = False

    @property
    def pending(self) -> tuple[str, ...]:
        """Request ids started or queued and not yet yielded."""
        return tuple(r.request_id for r in self._running.values()) + tuple(r.request_id for r in reversed(self._queue))

    async def __aenter__(self) -> Completions:
        if self._entered:
            raise InvalidRequest("as_completed", "can be entered once")
        self._entered = True
        self._fill()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[Generation]:
        if not self._entered:
            raise InvalidRequest("as_completed", "iterate inside `async with` (leaving it aborts what is left)")
        return self._iterate()

    def _fill(self) -> None:
        while self._queue and not self._closed and (self._limit is None or len(self._running) < self._limit):
            request = self._queue.pop()
            self._running[asyncio.ensure_future(self._backend.generate(request))] = request

    async def _iterate(self) -> AsyncIterator[Generation]:
        while self._running:
            done, _ = await asyncio.wait(self._running, return_when=asyncio.FIRST_COMPLETED)
            # Those done together are yielded in submission order (deterministic).
            for task in [t for t in self._running if t in done]:
                self._running.pop(task)
                exc = task.exception()
                if exc is not None:
                    await self.aclose()
                    raise exc
                self._fill()
                yield task.result()

    async def aclose(self) -> None:
        """Abort what is still running on the engines, drop what has not started; idempotent."""
        self._closed = True
        self._queue.clear()
        running, self._running = self._running, {}
        if not running:
            return
        live = [r.request_id for t, r in running.items() if not t.done()]
        # Abort on the engines first, so each request ends there (partial tokens returned, KV
        # freed); cancelling the local task alone would leave it running engine-side.
        await asyncio.gather(*(self._backend.abort(rid) for rid in live), return_exceptions=True)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


def as_completed(
    backend: RolloutBackend,
    requests: Iterable[GenerateRequest],
    *,
    max_in_flight: int | None = None,
) -> Completions:
    """Start ``requests`` on ``backend`` and yield their generations as they finish.

    ``max_in_flight`` bounds the requests running at once (the rest start as others finish, in
    order); ``None`` starts all. Request ids must be distinct: abort names requests by id.
    Use inside ``async with`` (see the module docstring).
    """
    reqs = list(requests)
    seen: dict[str, int] = {}
    for i, r in enumerate(reqs):
        if not isinstance(r, GenerateRequest):
            raise InvalidRequest(f"requests[{i}]", f"must be a GenerateRequest, got {type(r).__name__}")
        if r.request_id in seen:
            raise InvalidRequest(
                f"requests[{i}].request_id", f"{r.request_id!r} repeats requests[{seen[r.request_id]}]"
            )
        seen[r.request_id] = i
    if max_in_flight is not None and (
        isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1
    ):
        raise InvalidRequest("max_in_flight", f"must be an int >= 1 or None, got {max_in_flight!r}")
    return Completions(backend, reqs, max_in_flight)


def generate_group_as_completed(
    backend: RolloutBackend,
    input_ids: Sequence[int],
    n: int,
    sampling: SamplingParams | None = None,
    *,
    base_seed: int | None = None,
    group_id: str | None = None,
    max_in_flight: int | None = None,
) -> Completions:
    """``generate_group``'s ``n`` samples (same seeds, ids and routing key), yielded as they finish."""
    requests = group_requests(input_ids, n, sampling, base_seed=base_seed, group_id=group_id)
    return as_completed(backend, requests, max_in_flight=max_in_flight)
