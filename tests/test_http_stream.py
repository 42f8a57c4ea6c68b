"""Token streaming over HTTP: the SSE decoder, SGLang's cumulative events and Dynamo's delta chunks
(parsed from answers captured on an H200), early exit, and the errors a stream can end in."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rollout_backends as rb
from rollout_backends.adapters.dynamo import DynamoWire
from rollout_backends.adapters.sglang import SGLangWire
from rollout_backends.kit import (
    HttpClient,
    HttpFleetBackend,
    HttpRequest,
    HttpResponse,
    MockTransport,
    SseDecoder,
    Worker,
)

DATA = json.loads((Path(__file__).parent / "data" / "h200_answers_2026-12-03.json").read_text())
SSE = {"Content-Type": "text/event-stream"}
URL = "http://w0:30000"
W0 = Worker(id="w0", control_url=URL, generate_url=URL)


def _answer(body: str, stream: bool) -> HttpResponse:
    return HttpResponse(200, body.encode(), SSE if stream else {"Content-Type": "application/json"})


def _sglang_request(captured: dict[str, Any]) -> rb.GenerateRequest:
    """The captured request, under the id SGLang gave it (the probe sent none)."""
    body = captured["request"]
    rid = json.loads(captured["body"].split("\n")[0].removeprefix("data: "))["meta_info"]["id"]
    sp = body["sampling_params"]
    return rb.GenerateRequest(
        input_ids=body["input_ids"],
        sampling=rb.SamplingParams(
            max_new_tokens=sp["max_new_tokens"],
            temperature=sp["temperature"],
            top_logprobs=body.get("top_logprobs_num", 0),
        ),
        return_logprobs=body.get("return_logprob", False),
        prompt_logprobs_start=body.get("logprob_start_len"),
        request_id=rid,
    )


class _SpansDeclaredWire(SGLangWire):
    """The SGLang wire declaring stream_version_spans (an engine proven to stamp chunks exactly)."""

    def capabilities(self) -> rb.Capabilities:
        return attrs.evolve(super().capabilities(), stream_version_spans=True)


def _sglang_fleet(handler: Any, *, stream_version_spans: bool = False) -> tuple[HttpFleetBackend, MockTransport]:
    transport = MockTransport(handler)
    wire = (_SpansDeclaredWire if stream_version_spans else SGLangWire)(entry_url=URL)
    fleet = HttpFleetBackend(wire, [W0], client=HttpClient(transport, retry=None))
    return fleet, transport


async def _collect(backend: rb.RolloutBackend, request: rb.GenerateRequest) -> list[rb.TokenChunk]:
    async with backend.stream(request) as chunks:
        return [c async for c in chunks]


def _same(a: rb.Generation, b: rb.Generation) -> None:
    """Equal but for what differs between two calls (the time, the worker's cache)."""
    assert attrs.evolve(a, latency_s=0.0, cached_tokens=0) == attrs.evolve(b, latency_s=0.0, cached_tokens=0)


# -- the decoder ------------------------------------------------------------------------------------

_EVENTS = st.lists(st.text(st.characters(blacklist_characters="\r\n"), max_size=30), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(_EVENTS, st.lists(st.integers(0, 400), max_size=8), st.sampled_from([b"\n", b"\r\n"]))
def test_sse_events_survive_any_split(events: list[str], cuts: list[int], eol: bytes) -> None:
    raw = b"".join(b": a comment" + eol + b"event: x" + eol + b"data: " + e.encode() + eol + eol for e in events)
    points = sorted({min(c, len(raw)) for c in cuts})
    decoder = SseDecoder()
    got: list[bytes] = []
    for a, b in zip([0, *points], [*points, len(raw)], strict=True):
        got += decoder.feed(raw[a:b])
    got += decoder.close()
    assert got == [e.encode() for e in events]


def test_sse_multiline_data_and_an_unterminated_last_event() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"data: a\ndata:b\n\ndata: c") == [b"a\nb"]
    assert decoder.close() == [b"c"]


# -- SGLang 0.5.16 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["stream", "stream-topk", "stream-prompt", "stream-nologprob"])
async def test_sglang_stream_adds_up_to_the_captured_answer(name: str) -> None:
    captured = DATA["sglang"][name]
    plain = DATA["sglang"]["plain"]["body"]

    def handler(req: HttpRequest) -> HttpResponse:
        assert req.json is not None
        return _answer(captured["body"] if req.json.get("stream") else plain, bool(req.json.get("stream")))

    fleet, _ = _sglang_fleet(handler)
    request = _sglang_request(captured)
    chunks = await _collect(fleet, request)
    final = chunks[-1].final
    assert final is not None and all(c.final is None for c in chunks[:-1])
    assert len(chunks) >= 10  # one event per token: the stream was not read whole
    assert tuple(t for c in chunks for t in c.output_ids) == final.output_ids
    assert [c.index for c in chunks[1:]] == [c.end for c in chunks[:-1]]
    if request.return_logprobs:
        assert tuple(x for c in chunks for x in c.logprobs or ()) == final.logprobs
    if request.sampling.top_logprobs:
        tops = tuple(t for c in chunks for t in c.top_logprobs or ())
        assert tops == final.top_logprobs and len(tops) == len(final.output_ids)
        assert all(top[0][0] == tid for top, tid in zip(tops, final.output_ids, strict=True))  # greedy
    if name != "stream-prompt":  # the same greedy request as the plain one
        plain_request = attrs.evolve(request, sampling=attrs.evolve(request.sampling, top_logprobs=0))
        whole = await fleet.generate(attrs.evolve(plain_request, request_id="plain"))
        assert whole.output_ids == final.output_ids
        if request.return_logprobs:
            assert whole.logprobs == final.logprobs
    else:
        assert final.prompt_logprobs is not None and len(final.prompt_logprobs) == len(request.input_ids)
    await fleet.aclose()


async def test_sglang_stream_aborted_on_the_engine_ends_with_abort() -> None:
    captured = DATA["sglang"]["stream-abort"]
    fleet, _ = _sglang_fleet(lambda req: _answer(captured["body"], True))
    request = attrs.evolve(_sglang_request(captured), sampling=rb.SamplingParams(max_new_tokens=400))
    chunks = await _collect(fleet, request)
    final = chunks[-1].final
    assert final is not None and final.finish_reason is rb.FinishReason.ABORT and len(final.output_ids) == 6
    await fleet.aclose()


def _events(*answers: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(a).encode() + b"\n\n" for a in answers) + b"data: [DONE]\n\n"


def _partial(ids: list[int], finished: bool = False) -> dict[str, Any]:
    fr = {"type": "length", "length": len(ids)} if finished else None
    return {"output_ids": ids, "meta_info": {"id": "r", "finish_reason": fr, "prompt_tokens": 1, "weight_version": "v"}}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (_events(_partial([5]), _partial([6, 7], True)), rb.ContractViolation),  # a token taken back
        (_events(_partial([5]), _partial([5, 6])), rb.ContractViolation),  # ended before finishing
        (b'data: {"error": {"message": "Duplicate request ID detected: r"}}\n\ndata: [DONE]\n\n', rb.InvalidRequest),
        (
            _events(_partial([5])).replace(b"data: [DONE]", b'data: {"error": {"message": "boom"}}'),
            rb.BackendUnavailable,
        ),
        (b"data: not json\n\n", rb.ContractViolation),
    ],
)
async def test_sglang_streams_that_go_wrong_raise_typed(body: bytes, error: type[Exception]) -> None:
    fleet, _ = _sglang_fleet(lambda req: HttpResponse(200, body, SSE))
    request = rb.GenerateRequest(
        input_ids=[1], sampling=rb.SamplingParams(max_new_tokens=2), request_id="r", return_logprobs=False
    )
    with pytest.raises(error):
        await _collect(fleet, request)
    # Nothing is left running: the fleet frees the id (a second call is not a duplicate) ...
    with pytest.raises(error):
        await _collect(fleet, request)
    await fleet.aclose()


async def test_sglang_refused_head_is_the_generate_error() -> None:
    refusal = {"error": {"message": "max_new_tokens: must be >= 0", "param": "max_new_tokens"}}
    fleet, _ = _sglang_fleet(lambda req: HttpResponse.from_json(refusal, status=400))
    with pytest.raises(rb.InvalidRequest) as e:
        await _collect(fleet, rb.GenerateRequest(input_ids=[1], request_id="r"))
    with pytest.raises(rb.InvalidRequest) as g:
        await fleet.generate(rb.GenerateRequest(input_ids=[1], request_id="r"))
    assert (e.value.field, e.value.reason) == (g.value.field, g.value.reason)
    assert e.value.field == "max_new_tokens"
    await fleet.aclose()


async def test_leaving_an_sglang_stream_early_closes_it_and_aborts_the_request() -> None:
    closed = asyncio.Event()
    more = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        try:
            yield _events(_partial([5])).removesuffix(b"data: [DONE]\n\n")
            await more.wait()  # the engine is paused: no event comes
            yield _events(_partial([5, 6], True))
        finally:
            closed.set()

    def handler(req: HttpRequest) -> HttpResponse | AsyncIterator[bytes]:
        if req.url.endswith("/generate"):
            return body()
        return HttpResponse.from_json({"success": True, "message": "ok"})

    fleet, transport = _sglang_fleet(handler)
    request = rb.GenerateRequest(
        input_ids=[1], sampling=rb.SamplingParams(max_new_tokens=2), request_id="left", return_logprobs=False
    )
    async with fleet.stream(request) as chunks:
        async for chunk in chunks:
            assert chunk.output_ids == (5,)
            break
    assert closed.is_set()  # the connection was closed before the block was left ...
    aborts = [r.json for r in transport.requests if r.url.endswith("/abort_request")]
    assert aborts == [{"rid": "left", "abort_all": False}]  # ... and the engine told to drop the request
    await fleet.aclose()


# -- Dynamo 1.4.2 frontend, dynamo.sglang + shim ------------------------------------------------------


def _dynamo_fleet(handler: Any) -> HttpFleetBackend:
    wire = DynamoWire(
        frontend_url="http://fe", model="tiny", flavor="sglang14-shim", instance_workers={3305988649386292161: "w0"}
    )
    return HttpFleetBackend(wire, [W0], client=HttpClient(MockTransport(handler), retry=None))


def _dynamo_request(captured: dict[str, Any]) -> rb.GenerateRequest:
    body = captured["request"]
    return rb.GenerateRequest(
        input_ids=body["prompt"],
        sampling=rb.SamplingParams(max_new_tokens=body["max_tokens"], temperature=0.0, top_logprobs=body["logprobs"]),
        prompt_logprobs_start=0 if "prompt_logprobs" in body else None,
        request_id=body["nvext"]["annotations"][0].removeprefix("rid:"),
    )


@pytest.mark.parametrize("name", ["plain", "prompt", "topk"])
async def test_dynamo_stream_adds_up_to_the_captured_answer(name: str) -> None:
    streamed = DATA["dynamo"][f"{name}-stream"]
    whole = DATA["dynamo"].get(name)

    def handler(req: HttpRequest) -> HttpResponse:
        assert req.json is not None
        if req.json.get("stream"):
            return _answer(streamed["body"], True)
        assert whole is not None
        return _answer(whole["body"], False)

    fleet = _dynamo_fleet(handler)
    request = _dynamo_request(streamed)
    chunks = await _collect(fleet, request)
    final = chunks[-1].final
    assert final is not None and len(chunks) == 2  # the frontend sent the first token, then the rest
    assert tuple(t for c in chunks for t in c.output_ids) == final.output_ids and len(final.output_ids) == 12
    assert tuple(x for c in chunks for x in c.logprobs or ()) == final.logprobs
    assert final.worker == "w0" and final.weight_version == "default"
    if name == "topk":
        tops = tuple(t for c in chunks for t in c.top_logprobs or ())
        assert tops == final.top_logprobs and [t[0][0] for t in tops] == list(final.output_ids)
    if whole is not None:
        _same(await fleet.generate(request), final)
    await fleet.aclose()


async def test_dynamo_stream_error_chunk_raises_typed() -> None:
    first = DATA["dynamo"]["plain-stream"]["body"].split("\n\n")[0]
    body = first + '\n\ndata: {"error": {"message": "worker gone"}}\n\n'
    fleet = _dynamo_fleet(lambda req: HttpResponse(200, body.encode(), SSE))
    with pytest.raises(rb.BackendUnavailable, match="after 1 tokens"):
        await _collect(fleet, _dynamo_request(DATA["dynamo"]["plain-stream"]))
    await fleet.aclose()


def _versioned(ids: list[int], version: str, finished: bool = False) -> dict[str, Any]:
    answer = _partial(ids, finished)
    answer["meta_info"]["weight_version"] = version
    return answer


async def test_sglang_stream_versions_per_event_become_the_spans() -> None:
    # SGLang stamps every event with the version it holds when the event is built: tokens before an
    # update come with the old one, those after with the new one.
    body = _events(_versioned([5], "v0"), _versioned([5, 6], "v0"), _versioned([5, 6, 7], "v1"),
                   _versioned([5, 6, 7, 8], "v1", finished=True))  # fmt: skip
    last = _versioned([5, 6, 7, 8], "v1", finished=True)

    def handler(req: HttpRequest) -> HttpResponse:
        assert req.json is not None
        return HttpResponse(200, body, SSE) if req.json.get("stream") else HttpResponse.from_json(last)

    fleet, _ = _sglang_fleet(handler)
    # Carried per chunk, but not made into spans: unproven on SGLang 0.5.16 (see the wire).
    assert not fleet.capabilities.stream_version_spans
    request = rb.GenerateRequest(
        input_ids=[1], sampling=rb.SamplingParams(max_new_tokens=4), request_id="r", return_logprobs=False
    )
    chunks = await _collect(fleet, request)
    assert [c.weight_version for c in chunks] == ["v0", "v0", "v1", "v1"]
    final = chunks[-1].final
    assert final is not None and final.weight_version == "v1"
    # The STAMPED rule, as for generate: no update of the worker overlapped, one span.
    plain = await fleet.generate(attrs.evolve(request, request_id="r2"))
    assert plain.version_spans == ((0, "v1"),) and plain.weight_version == "v1"
    assert final.version_spans == plain.version_spans
    await fleet.aclose()


async def test_stream_version_spans_from_chunk_versions_where_declared() -> None:
    # Where a wire declares stream_version_spans, the fleet puts the chunks' versions together.
    body = _events(_versioned([5], "v0"), _versioned([5, 6], "v0"), _versioned([5, 6, 7], "v1"),
                   _versioned([5, 6, 7, 8], "v1", finished=True))  # fmt: skip

    def handler(req: HttpRequest) -> HttpResponse:
        return HttpResponse(200, body, SSE)

    fleet, _ = _sglang_fleet(handler, stream_version_spans=True)
    request = rb.GenerateRequest(
        input_ids=[1], sampling=rb.SamplingParams(max_new_tokens=4), request_id="r", return_logprobs=False
    )
    final = (await _collect(fleet, request))[-1].final
    assert final is not None and final.version_spans == ((0, "v0"), (2, "v1"))
    assert final.version_at_start == "v0" and final.weight_version == "v1"
    await fleet.aclose()
