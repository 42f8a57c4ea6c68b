"""A flush that ai-dynamo 1.6.x's ``flush_cache`` route answers "refused: not idle" (issue 30).

1.6.1's route calls SGLang's ``Engine.flush_cache()`` with no wait; SGLang 0.5.16 refuses it with
``success=False`` and an empty message while a request that has just answered still sits in the
running batch (H100, 2026-12-05: ``ControlFailed: flush_cache failed: 127.0.0.1:8081
[flush_cache]: `` right after a generation). The driver sends it again within the flush's wait;
past the wait the failure carries SGLang's answer; no other refusal is resent.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollout_backends import ControlFailed, PauseMode
from rollout_backends._http import HttpClient, HttpRequest, HttpResponse, MockTransport
from rollout_backends.adapters.dynamo import DynamoWire
from rollout_backends.kit import FlushCache, HttpDriver, HttpLink, Pause, Worker

W0 = Worker(id="127.0.0.1:8081", control_url="http://127.0.0.1:8081", instance_id=111)

#: What 1.6.1's route answers for SGLang 0.5.16's ``FlushCacheReqOutput`` (``normalize_engine_route_result``
#: of the msgspec struct: BaseReq's ``rid``, ``http_worker_ipc``, then ``success``, ``message``).
BUSY = {"rid": None, "http_worker_ipc": None, "success": False, "message": ""}
DONE = {**BUSY, "success": True}


def _driver(answers: list[dict[str, Any]], flavor: str = "sglang16") -> tuple[HttpDriver, list[HttpRequest]]:
    """A driver whose worker answers ``answers`` in turn (the last one from then on)."""
    seen: list[HttpRequest] = []

    def handler(req: HttpRequest) -> HttpResponse:
        seen.append(req)
        return HttpResponse.from_json(answers[min(len(seen), len(answers)) - 1])

    wire = DynamoWire(frontend_url="http://fe", model="tiny", router_mode="round-robin", flavor=flavor)
    link = HttpLink(wire, HttpClient(MockTransport(handler)))
    return HttpDriver(link, W0, wire.capabilities()), seen


async def test_flush_refused_while_busy_is_sent_again() -> None:
    driver, seen = _driver([BUSY, BUSY, DONE])
    await driver.control(FlushCache(wait_s=2.0))
    assert len(seen) == 3 and all(r.url == "http://127.0.0.1:8081/engine/flush_cache" for r in seen)


async def test_flush_still_busy_after_its_wait_fails_with_sglangs_answer() -> None:
    driver, seen = _driver([BUSY])
    with pytest.raises(ControlFailed) as ei:
        await driver.control(FlushCache(wait_s=0.2))
    assert ei.value.workers == (W0.id,) and len(seen) >= 2
    msg = ei.value.failures[0].message
    assert "pending" in msg and '"success": false' in msg and "0.2 s" in msg, msg


async def test_other_refusals_are_not_resent_and_say_why() -> None:
    """SGLang's other flush refusal has a message: it is the failure, sent once. An empty refusal
    of another command names the engine's whole answer, never an empty reason."""
    busy_other = {**BUSY, "message": "Another flush_cache is already in progress."}
    driver, seen = _driver([busy_other, DONE])
    with pytest.raises(ControlFailed, match="Another flush_cache is already in progress"):
        await driver.control(FlushCache(wait_s=2.0))
    assert len(seen) == 1
    driver, seen = _driver([{"success": False, "message": ""}, DONE])
    with pytest.raises(ControlFailed) as ei:
        await driver.control(Pause(PauseMode.IN_PLACE))
    assert len(seen) == 1 and '"success": false' in ei.value.failures[0].message


async def test_1_4_flush_waits_in_sglang_not_here() -> None:
    """1.4.x passes the wait to SGLang (``timeout_s``), which defers the flush: an empty refusal
    there is not a busy one and is not resent."""
    refused = {"result": "FlushCacheReqOutput(rid=None, http_worker_ipc=None, success=False, message='')"}
    driver, seen = _driver([refused, {"result": "FlushCacheReqOutput(success=True, message='')"}], "sglang14")
    with pytest.raises(ControlFailed, match="FlushCacheReqOutput"):
        await driver.control(FlushCache(wait_s=2.0))
    assert len(seen) == 1 and seen[0].json["kwargs"] == {"timeout_s": 2.0}


def test_busy_answer_is_what_ai_dynamo_1_6_sends() -> None:
    """``BUSY`` is 1.6.x's normalization of SGLang 0.5.16's struct (io_struct.py: ``BaseReq`` is a
    tagged, array_like msgspec struct with ``rid`` and ``http_worker_ipc``)."""
    routes = pytest.importorskip("dynamo.sglang.engine_routes", reason="ai-dynamo 1.4.x has no engine_routes")
    struct: Any = pytest.importorskip("msgspec").Struct

    class BaseReq(struct, tag=True, kw_only=True, array_like=True):  # type: ignore[misc, call-arg]
        rid: str | None = None
        http_worker_ipc: str | None = None

    class FlushCacheReqOutput(BaseReq, kw_only=True):  # type: ignore[call-arg]
        success: bool
        message: str = ""

    assert json.loads(json.dumps(routes.normalize_engine_route_result(FlushCacheReqOutput(success=False)))) == BUSY
