"""When a ``generate`` is resent (no process): the opt-in policy, the errors that allow it, the keys.

A resend must never count tokens twice: only errors that guarantee no engine started the request
(``TransientError.nothing_generated``) are resent, only with ``RetryPolicy(generate_resends=N)``.
"""

from __future__ import annotations

import asyncio

import pytest

from rollout_backends import (
    BackendTimeout,
    BackendUnavailable,
    ConnectionFailed,
    GenerateRequest,
    InvalidRequest,
    PauseMode,
    SamplingParams,
    TransientError,
    WorkerLoss,
    WorkerLossPolicy,
)
from rollout_backends._http import HttpClient, HttpRequest, HttpResponse, MockTransport, RetryPolicy
from rollout_backends._supervisor import free_port
from rollout_backends.adapters.dynamo._wire import DynamoWire
from rollout_backends.adapters.sglang import SGLangWire
from rollout_backends.kit import HttpFleetBackend, Pause, Ready, Worker

SAMPLING = SamplingParams(max_new_tokens=3, temperature=0.0)
FAST = {"backoff_s": 0.001, "max_backoff_s": 0.002}


def _ok(req: HttpRequest) -> HttpResponse:
    body = req.json
    out = [7, 8, 9]
    return HttpResponse.from_json(
        {
            "output_ids": out,
            "meta_info": {
                "id": body["rid"],
                "finish_reason": {"type": "length", "length": 3},
                "prompt_tokens": len(body["input_ids"]),
                "weight_version": "v0",
                "output_token_logprobs": [[-0.1, t, None] for t in out],
            },
        }
    )


SMG_CONNECT_FAILED = HttpResponse.from_json(
    {"error": {"type": "server_error", "code": "call_upstream_connection_failed", "message": "error sending"}}, 500
)
SMG_REQUEST_ERROR = HttpResponse.from_json(
    {"error": {"type": "server_error", "code": "call_upstream_request_error", "message": "connection closed"}}, 500
)


class Script:
    """A MockTransport handler answering from a list (the last answer repeats)."""

    def __init__(self, *answers: HttpResponse | BaseException | str) -> None:
        self.answers = list(answers)
        self.seen: list[HttpRequest] = []

    def __call__(self, req: HttpRequest) -> HttpResponse:
        self.seen.append(req)
        a = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(a, BaseException):
            raise a
        if a == "ok":
            return _ok(req)
        assert isinstance(a, HttpResponse)
        return a


def _backend(script: Script, *, resends: int = 0, attempts: int = 3) -> HttpFleetBackend:
    wire = SGLangWire(entry_url="http://router:1", routing="round_robin")
    client = HttpClient(MockTransport(script), retry=RetryPolicy(attempts=attempts, generate_resends=resends, **FAST))
    workers = [Worker(id=f"w{i}", control_url=f"http://w{i}:1", generate_url=f"http://w{i}:1") for i in range(2)]
    b = HttpFleetBackend(wire, workers, client=client)
    # The transport's resends alone: the fleet's worker-loss resends (tests/test_worker_loss.py)
    # would resend a generation cut off mid-answer whole, which is a different promise.
    b.worker_loss = WorkerLossPolicy(action=WorkerLoss.FAIL)
    return b


def _req() -> GenerateRequest:
    return GenerateRequest(input_ids=[1, 2, 3], sampling=SAMPLING)


async def test_off_by_default() -> None:
    assert RetryPolicy().generate_resends == 0
    script = Script(SMG_CONNECT_FAILED, "ok")
    with pytest.raises(ConnectionFailed) as ei:
        await _backend(script).generate(_req())
    assert ei.value.nothing_generated and len(script.seen) == 1


async def test_resends_only_what_never_started_same_request_id() -> None:
    script = Script(SMG_CONNECT_FAILED, SMG_CONNECT_FAILED, "ok")
    req = _req()
    gen = await _backend(script, resends=2).generate(req)
    assert gen.output_ids == (7, 8, 9) and gen.request_id == req.request_id
    assert [r.json["rid"] for r in script.seen] == [req.request_id] * 3


async def test_resends_are_bounded() -> None:
    script = Script(SMG_CONNECT_FAILED)
    with pytest.raises(ConnectionFailed):
        await _backend(script, resends=3).generate(_req())
    assert len(script.seen) == 4


@pytest.mark.parametrize(
    "failure",
    [
        SMG_REQUEST_ERROR,  # the worker died mid-request: tokens may exist
        HttpResponse.from_json({"error": {"message": "boom"}}, 500),
        BackendTimeout("no answer in 1.0s"),
        ConnectionFailed("POST /generate: ServerDisconnectedError"),  # dropped after sending
        HttpResponse.from_json({"error": {"message": "busy"}}, 503),
    ],
    ids=["mid-request", "plain-500", "timeout", "disconnect", "503"],
)
async def test_never_resends_what_may_have_produced_tokens(failure: HttpResponse | BaseException) -> None:
    script = Script(failure, "ok")
    with pytest.raises((TransientError, BackendUnavailable)) as ei:
        await _backend(script, resends=5).generate(_req())
    assert not getattr(ei.value, "nothing_generated", False)
    assert len(script.seen) == 1, "a generate that may have produced tokens was resent"


async def test_timeouts_are_not_retried_even_when_idempotent() -> None:
    script = Script(BackendTimeout("no answer"), HttpResponse(200, b""))
    client = HttpClient(MockTransport(script), retry=RetryPolicy(attempts=5, **FAST))
    with pytest.raises(BackendTimeout):
        await client.send(HttpRequest("GET", "http://w:1/health", idempotent=True))
    assert len(script.seen) == 1


async def test_refused_connection_is_flagged_and_retried_transparently() -> None:
    port = free_port()  # nothing listens here
    client = HttpClient(retry=RetryPolicy(attempts=2, **FAST))
    try:
        with pytest.raises(ConnectionFailed) as ei:
            await client.send(HttpRequest("POST", f"http://127.0.0.1:{port}/generate", json={}), worker="w9")
    finally:
        await client.aclose()
    assert ei.value.nothing_generated and ei.value.worker == "w9"


def test_wires_flag_only_not_started_failures() -> None:
    sg = SGLangWire(entry_url="http://router:1", routing="round_robin")
    req = _req()
    with pytest.raises(ConnectionFailed) as ei:
        sg.parse_generation(req, SMG_CONNECT_FAILED, 0.0)
    assert ei.value.nothing_generated and "no token was generated" in str(ei.value)
    with pytest.raises(BackendUnavailable):
        sg.parse_generation(req, SMG_REQUEST_ERROR, 0.0)
    no_worker = HttpResponse.from_json({"error": {"code": "model_not_found", "message": "No worker available"}}, 404)
    with pytest.raises(BackendUnavailable):
        sg.parse_generation(req, no_worker, 0.0)
    dy = DynamoWire(frontend_url="http://fe:1", model="m")
    failed = HttpResponse.from_json({"message": "Failed to generate completions: no instance"}, 500)
    with pytest.raises(ConnectionFailed) as ei2:
        dy.parse_generation(req, failed, 0.0)
    assert ei2.value.nothing_generated


async def test_admin_key_on_control_calls_only_and_never_shown() -> None:
    seen: list[HttpRequest] = []

    def handler(req: HttpRequest) -> HttpResponse:
        seen.append(req)
        if req.url.endswith("/generate"):
            return _ok(req)
        return HttpResponse.from_json({"success": True, "message": "ok", "weight_version": "v0"})

    client = HttpClient(MockTransport(handler), api_key="sk-DATA-123", admin_api_key="sk-ADMIN-456")
    wire = SGLangWire(entry_url="http://w0:1")
    backend = HttpFleetBackend(wire, [Worker(id="w0", control_url="http://w0:1", generate_url="http://w0:1")],
                               client=client)  # fmt: skip
    await backend.generate(_req())
    await backend.pause()
    await backend.resume()
    await backend.weight_versions()
    auth = {r.url.rsplit("/", 1)[1]: r.headers.get("Authorization") for r in seen}
    assert auth == {
        "generate": "Bearer sk-DATA-123",
        "pause_generation": "Bearer sk-ADMIN-456",
        "continue_generation": "Bearer sk-ADMIN-456",
        "model_info": "Bearer sk-DATA-123",
    }
    shown = " ".join([repr(client), repr(backend), repr(wire), *(repr(r) for r in seen), str(seen)])
    assert "sk-DATA" not in shown and "sk-ADMIN" not in shown
    assert "***" in repr(seen[0])
    assert wire.control(Pause(PauseMode.RETRACT), backend.worker("w0")) is not None


async def test_resend_delay_is_bounded() -> None:
    """A long resend chain still ends: every delay is capped by ``max_backoff_s``."""
    policy = RetryPolicy(backoff_s=0.01, max_backoff_s=0.02, generate_resends=50)
    assert all(policy.delay(i) <= 0.02 for i in range(60))
    script = Script(SMG_CONNECT_FAILED)
    b = _backend(script, resends=50)
    b.client.retry = policy
    with pytest.raises(ConnectionFailed):
        await asyncio.wait_for(b.generate(_req()), 5)
    assert len(script.seen) == 51


def test_policy_validates() -> None:
    with pytest.raises(InvalidRequest):
        RetryPolicy(generate_resends=-1)
    with pytest.raises(InvalidRequest):
        RetryPolicy(attempts=0)


def test_dynamo_ready_matches_a_restarted_worker_by_rpc_port() -> None:
    """A restarted Dynamo worker registers a new instance id on its fixed request-plane port."""
    wire = DynamoWire(frontend_url="http://fe:1", model="m", worker_rpc_ports={"127.0.0.1:21000": 21001})
    worker = Worker(id="127.0.0.1:21000", control_url="http://127.0.0.1:21000", instance_id=111)
    health = {"instances": [{"endpoint": "generate", "instance_id": 222, "transport": {"tcp": "127.0.0.1:21001/x"}}]}
    assert wire.parse_probe(Ready(), worker, HttpResponse.from_json(health)) is True
    other = {"instances": [{"endpoint": "generate", "instance_id": 333, "transport": {"tcp": "127.0.0.1:29999/x"}}]}
    assert wire.parse_probe(Ready(), worker, HttpResponse.from_json(other)) is False
    assert (
        DynamoWire(frontend_url="http://fe:1", model="m").parse_probe(Ready(), worker, HttpResponse.from_json(health))
        is False
    )
