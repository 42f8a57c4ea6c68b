"""The reference server streams ``/generate`` as SGLang 0.5.16 does (``"stream": true``): cumulative
events, the last one the non-streamed answer, then ``[DONE]``; a client gone away aborts the request."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from test_server import _client

from rollout_backends.adapters.reference import ReferenceEngine
from rollout_backends.adapters.reference._server import SERVER_KEY, ReferenceServer, build_app

PROMPT = [1, 17, 42, 99, 300, 7]
#: Far more tokens than a test reads before it stops: a request left running would produce them all.
LONG = 2000


@pytest.fixture
async def client(engine: ReferenceEngine, model_dir: Path) -> AsyncIterator[TestClient]:
    c = await _client(engine, model_path=str(model_dir))  # the tiny model's tokenizer: ``text`` too
    yield c
    await c.close()


def body(max_new_tokens: int = 12, **kw: Any) -> dict[str, Any]:
    b: dict[str, Any] = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
    }
    b.update(kw)
    return b


def _data(block: str) -> Any:
    assert block.startswith("data: "), block
    data = block[len("data: ") :]
    return data if data == "[DONE]" else json.loads(data)


async def _all_events(r: aiohttp.ClientResponse) -> list[Any]:
    raw = await r.text()
    assert raw.endswith("\n\n"), raw[-200:]
    return [_data(b) for b in raw[:-2].split("\n\n")]


async def _next_event(r: aiohttp.ClientResponse) -> Any:
    return _data((await r.content.readuntil(b"\n\n")).decode()[:-2])


async def _drained(server: ReferenceServer, engine: ReferenceEngine) -> None:
    """Wait until neither the server nor the engine holds a request (bounded, no timing asserted)."""
    for _ in range(3000):
        if not server._inflight and not engine.request_ids:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"still in flight: server {server._inflight}, engine {engine.request_ids}")


def _is_prefix(a: list[Any], b: list[Any]) -> bool:
    return b[: len(a)] == a


async def test_events_are_cumulative_and_the_last_is_the_answer(client: TestClient) -> None:
    async with client.post("/generate", json=body(rid="plain")) as r:
        assert r.status == 200
        plain = await r.json()
    async with client.post("/generate", json=body(rid="s1", stream=True)) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        events = await _all_events(r)
    assert events[-1] == "[DONE]"
    answers = events[:-1]
    assert "[DONE]" not in answers and len(answers) >= 2  # at least one partial event, then the last
    *partials, last = answers
    for e in partials:
        meta = e["meta_info"]
        assert meta["id"] == "s1" and meta["finish_reason"] is None
        assert meta["completion_tokens"] == len(e["output_ids"]) > 0
        assert [t for _, t, _ in meta["output_token_logprobs"]] == e["output_ids"]
        assert isinstance(e["text"], str)
    for a, b in itertools.pairwise(answers):
        assert _is_prefix(a["output_ids"], b["output_ids"])
        assert _is_prefix(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"])
        assert len(a["output_ids"]) < len(b["output_ids"]) or b is last
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert last["output_ids"] == plain["output_ids"]
    assert last["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]
    assert last["text"] == plain["text"]
    assert last["meta_info"]["id"] == "s1"


async def test_top_logprobs_are_cumulative(client: TestClient) -> None:
    async with client.post("/generate", json=body(rid="plain", top_logprobs_num=3)) as r:
        plain = await r.json()
    async with client.post("/generate", json=body(rid="s2", stream=True, top_logprobs_num=3)) as r:
        events = await _all_events(r)
    assert events[-1] == "[DONE]"
    answers = events[:-1]
    assert len(answers) >= 2
    tops = [e["meta_info"]["output_top_logprobs"] for e in answers]
    for e, top in zip(answers, tops, strict=True):
        assert len(top) == len(e["output_ids"]) and all(len(row) == 3 for row in top)
    for a, b in itertools.pairwise(tops):
        assert _is_prefix(a, b)
    assert tops[-1] == plain["meta_info"]["output_top_logprobs"]


@pytest.fixture(params=[False, True], ids=["as-served", "handler-cancelled"])
async def endpoint(
    request: pytest.FixtureRequest, engine: ReferenceEngine, model_dir: Path
) -> AsyncIterator[tuple[str, aiohttp.ClientSession, ReferenceServer]]:
    """The server run as ``serve.py`` runs it (``handler_cancellation=False``: a client gone away
    is seen when a write fails), and with aiohttp cancelling the handler (as TestServer does)."""
    app = build_app(engine, model_path=str(model_dir), health_generation=False)
    runner = web.AppRunner(app, handler_cancellation=request.param)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with aiohttp.ClientSession() as session:
            yield f"http://{host}:{port}", session, app[SERVER_KEY]
    finally:
        await runner.cleanup()


async def test_closing_the_connection_aborts_the_request(
    endpoint: tuple[str, aiohttp.ClientSession, ReferenceServer], engine: ReferenceEngine
) -> None:
    url, session, server = endpoint
    r = await session.post(f"{url}/generate", json=body(LONG, rid="gone", stream=True))
    assert r.status == 200
    for _ in range(2):
        assert (await _next_event(r))["meta_info"]["finish_reason"] is None
    assert "gone" in engine.request_ids
    r.close()  # the connection, not just the response
    await _drained(server, engine)
    assert engine.health().tokens_generated < LONG  # aborted, not run to its end
    async with session.post(f"{url}/generate", json=body(3, rid="after")) as r2:  # the engine still serves
        assert (await r2.json())["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


async def test_abort_request_ends_the_stream_with_an_abort(client: TestClient, engine: ReferenceEngine) -> None:
    async with client.post("/generate", json=body(LONG, rid="cut", stream=True)) as r:
        assert (await _next_event(r))["meta_info"]["finish_reason"] is None
        async with client.post("/abort_request", json={"rid": "cut"}) as a:
            assert a.status == 200
        events = await _all_events(r)
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < LONG
    await _drained(client.app[SERVER_KEY], engine)  # type: ignore[index]


async def test_a_duplicate_rid_while_one_streams_is_an_error_event(client: TestClient, engine: ReferenceEngine) -> None:
    r = await client.post("/generate", json=body(LONG, rid="dup", stream=True))
    try:
        first = await _next_event(r)
        async with client.post("/generate", json=body(rid="dup", stream=True)) as r2:
            assert r2.status == 200
            events = await _all_events(r2)
        assert events == [{"error": {"message": "Duplicate request ID detected: dup"}}, "[DONE]"]
        more = await _next_event(r)  # the first one keeps streaming
        assert more["meta_info"]["finish_reason"] is None
        assert _is_prefix(first["output_ids"], more["output_ids"])
        assert len(more["output_ids"]) > len(first["output_ids"])
    finally:
        r.close()
    await _drained(client.app[SERVER_KEY], engine)  # type: ignore[index]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"top_logprobs_num": 21}, "top_logprobs_num"),
        ({"stream": "yes"}, "stream"),
    ],
)
async def test_a_bad_field_is_still_400_naming_it(client: TestClient, patch: dict[str, Any], param: str) -> None:
    async with client.post("/generate", json={**body(rid="bad", stream=True), **patch}) as r:
        assert r.status == 400
        assert r.content_type == "application/json"
        assert (await r.json())["error"]["param"] == param


async def test_a_prefill_only_stream_is_one_final_event(client: TestClient) -> None:
    async with client.post("/generate", json=body(0, rid="pre", stream=True)) as r:
        events = await _all_events(r)
    assert len(events) == 2 and events[1] == "[DONE]"
    assert events[0]["output_ids"] == []
    assert events[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
