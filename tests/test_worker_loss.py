"""A generation cut off by a lost worker is resent whole (``Fleet.worker_loss``), and only then."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

import rollout_backends as rb
from rollout_backends._fleet import Fleet
from rollout_backends._ops import AbortRequest, Command, Probe
from rollout_backends._types import Capabilities, FinishReason, GenerateRequest, Generation, SamplingParams

SP = SamplingParams(max_new_tokens=3, temperature=0.0)


class LosingDriver:
    """A worker that fails its first ``fail`` generations with ``error()`` (as a killed worker's
    connection does), then answers; it records every attempt's request id."""

    def __init__(self, wid: str, fail: int, error: Callable[[], Exception], gate: asyncio.Event | None = None) -> None:
        self.id, self.fail, self.error, self.gate = wid, fail, error, gate
        self.attempts: list[str] = []
        self.aborted: list[str] = []

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(worker_pinning=True)

    @property
    def aborts_by_id(self) -> bool:
        return True

    @property
    def ranks(self) -> int:
        return 1

    async def generate(self, request: GenerateRequest) -> Generation:
        self.attempts.append(request.request_id)
        if self.gate is not None:
            await self.gate.wait()
        if len(self.attempts) <= self.fail:
            raise self.error()
        return Generation(
            request_id=request.request_id,
            output_ids=(7, 8, 9),
            logprobs=(-0.1, -0.2, -0.3),
            finish_reason=FinishReason.LENGTH,
            weight_version="v1",
            prompt_tokens=len(request.input_ids),
            worker=self.id,
        )

    async def control(self, op: Command) -> None:
        if isinstance(op, AbortRequest):
            self.aborted.append(op.request_id)

    async def probe(self, op: Probe) -> bool | None:
        return True

    async def served_version(self) -> str | None:
        return "v1"

    async def aclose(self) -> None:
        return None


def _lost() -> Exception:
    return rb.BackendUnavailable("worker w0: stream ended: connection lost", worker="w0")


def _fleet(fail: int, error: Callable[[], Exception] = _lost, **policy: object) -> tuple[Fleet, LosingDriver]:
    d = LosingDriver("w0", fail, error)
    f = Fleet([d])
    if policy:
        f.worker_loss = rb.WorkerLossPolicy(backoff_s=0.0, **policy)  # type: ignore[arg-type]
    else:
        f.worker_loss = rb.WorkerLossPolicy(backoff_s=0.0)
    return f, d


async def test_a_lost_generation_is_resent_whole_with_its_request_id() -> None:
    f, d = _fleet(fail=2)
    req = GenerateRequest(input_ids=(1, 2), sampling=SP, request_id="r1")
    gen = await f.generate(req)
    assert gen.output_ids == (7, 8, 9) and gen.request_id == "r1"
    assert d.attempts == ["r1", "r1", "r1"] and f.resends_after_worker_loss == 2


@pytest.mark.parametrize(
    "error",
    [
        lambda: rb.ConnectionFailed("cut mid-answer", worker="w0"),
        _lost,
        lambda: rb.Overloaded("frontend: HTTP 503: Service temporarily unavailable"),  # ai-dynamo 1.6.1
    ],
)
async def test_default_resends_connection_loss_and_unavailable(error: Callable[[], Exception]) -> None:
    d = LosingDriver("w0", 1, error)
    f = Fleet([d])
    assert f.worker_loss == rb.WorkerLossPolicy() and f.worker_loss.action is rb.WorkerLoss.RESEND
    gen = await f.generate(GenerateRequest(input_ids=(1,), sampling=SP))
    assert gen.finish_reason is FinishReason.LENGTH and len(d.attempts) == 2


@pytest.mark.parametrize(
    "error",
    [
        lambda: rb.BackendTimeout("no answer in 10 s", worker="w0"),  # the call's whole budget
        lambda: rb.InvalidRequest("input_ids", "bad"),
        lambda: rb.BackendClosed("closed"),
    ],
)
async def test_what_is_not_a_lost_worker_is_not_resent(error: Callable[[], Exception]) -> None:
    f, d = _fleet(fail=1, error=error)
    with pytest.raises(type(error())):
        await f.generate(GenerateRequest(input_ids=(1,), sampling=SP))
    assert len(d.attempts) == 1 and f.resends_after_worker_loss == 0


async def test_fail_policy_pinned_requests_and_the_resend_budget() -> None:
    f, d = _fleet(fail=1, action=rb.WorkerLoss.FAIL)
    with pytest.raises(rb.BackendUnavailable):
        await f.generate(GenerateRequest(input_ids=(1,), sampling=SP))
    assert len(d.attempts) == 1
    f, d = _fleet(fail=1)
    with pytest.raises(rb.BackendUnavailable):  # the pinned worker is the one lost
        await f.generate(GenerateRequest(input_ids=(1,), sampling=SP, worker="w0"))
    assert len(d.attempts) == 1
    f, d = _fleet(fail=5, resends=3)
    with pytest.raises(rb.BackendUnavailable):
        await f.generate(GenerateRequest(input_ids=(1,), sampling=SP))
    assert len(d.attempts) == 4 and f.resends_after_worker_loss == 3


async def test_an_abort_between_attempts_ends_it_without_a_resend() -> None:
    d = LosingDriver("w0", 1, _lost)
    f = Fleet([d])
    f.worker_loss = rb.WorkerLossPolicy(backoff_s=0.3, max_backoff_s=0.3)
    task = asyncio.ensure_future(f.generate(GenerateRequest(input_ids=(1,), sampling=SP, request_id="r9")))
    while not d.attempts:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the first attempt failed; the fleet waits to resend
    await f.abort("r9")
    gen = await task
    assert gen.finish_reason is FinishReason.ABORT and gen.output_ids == ()
    assert d.attempts == ["r9"]  # never resent


@pytest.mark.parametrize(
    "bad",
    [{"resends": -1}, {"resends": True}, {"backoff_s": -1.0}, {"max_backoff_s": "1"}, {"action": "resend"}],
)
def test_policy_values_are_checked(bad: dict[str, object]) -> None:
    with pytest.raises(rb.InvalidRequest) as e:
        rb.WorkerLossPolicy(**bad)  # type: ignore[arg-type]
    assert e.value.field == next(iter(bad))
