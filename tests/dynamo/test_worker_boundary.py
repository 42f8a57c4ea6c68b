"""Our Dynamo worker's boundary, called as the frontend calls it (no processes): both request shapes
(1.4.2's preprocessed ``/v1/completions`` request, 1.6's native ``/generate`` body under
``extra_args.sglang_tito``) parsed by the codec's one rule.

Any bad value is refused naming the field, in a chunk the Dynamo wire reads back as
``InvalidRequest`` (never the frontend's 500, which reads as the fleet's failure); valid bodies are
served; a duplicate in-flight request id is refused without disturbing the first; nothing is lost.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_backends import FinishReason, GenerateRequest, Generation, InvalidRequest
from rollout_backends.adapters.dynamo._wire import DynamoFlavor, DynamoWire
from rollout_backends.adapters.dynamo._worker import DynamoWorker, refusal
from rollout_backends.kit import HttpResponse
from tests.native_bodies import BAD_VALUES, valid_bodies, with_value

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from fake_engine import FakeEngine

VOCAB, CONTEXT = 64, 32
_SETTINGS = {"deadline": None, "database": None, "derandomize": True}

#: (where in Dynamo's preprocessed request, a wrong value, the field the refusal names natively)
PREPROCESSED_BAD: list[tuple[tuple[str, ...], Any, str]] = [
    (("token_ids",), [1, VOCAB], "input_ids[1]"),
    (("token_ids",), [1, 2**70], "input_ids[1]"),
    (("token_ids",), [], "input_ids"),
    (("token_ids",), [1] * CONTEXT, "input_ids"),
    (("stop_conditions", "max_tokens"), 2**64, "sampling_params.max_new_tokens"),
    (("stop_conditions", "max_tokens"), CONTEXT, "sampling_params.max_new_tokens"),  # past the context
    (("stop_conditions", "max_tokens"), 0, "sampling_params.max_new_tokens"),
    (("stop_conditions", "min_tokens"), 10**6, "sampling_params.min_new_tokens"),
    (("stop_conditions", "stop_token_ids"), [VOCAB], "sampling_params.stop_token_ids[0]"),
    (("stop_conditions", "stop_token_ids"), [2**70], "sampling_params.stop_token_ids[0]"),
    (("sampling_options", "temperature"), -1.0, "sampling_params.temperature"),
    (("sampling_options", "top_p"), 0.0, "sampling_params.top_p"),
    (("sampling_options", "seed"), 2**64, "sampling_params.sampling_seed"),
    (("sampling_options", "top_k"), 2**64, "sampling_params.top_k"),
]


class CountingEngine(FakeEngine):
    """Records what reached the engine: the request ids generated and aborted."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.generated: list[str] = []
        self.aborted: list[str] = []

    async def generate(self, req: GenerateRequest) -> Any:
        self.generated.append(req.request_id)
        return await super().generate(req)

    async def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        return await super().abort(rid)


def _worker(step_s: float = 0.0) -> tuple[DynamoWorker, CountingEngine]:
    engine = CountingEngine(vocab_size=VOCAB, max_context=CONTEXT, step_s=step_s)
    worker = DynamoWorker(engine, namespace="ns", model_path="/m", served_model_name="tiny", detokenize=False)
    return worker, engine


def _wire() -> DynamoWire:
    return DynamoWire(frontend_url="http://fe", model="tiny", flavor=DynamoFlavor.ROLLOUT, native_generate=True)


def _native_request(body: dict[str, Any]) -> dict[str, Any]:
    return {"token_ids": [], "extra_args": {"sglang_tito": body}}


def _preprocessed(ids: list[int], max_tokens: int, rid: str = "r1") -> dict[str, Any]:
    return {
        "token_ids": ids,
        "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True},
        "sampling_options": {"temperature": 0.0},
        "eos_token_ids": [],
        "annotations": [f"rid:{rid}"],
    }


async def _chunks(worker: DynamoWorker, request: dict[str, Any]) -> list[dict[str, Any]]:
    return [c async for c in worker.generate(request, None)]


def _as_response(chunks: list[dict[str, Any]], *, native: bool) -> HttpResponse:
    """What the frontend makes of the chunks, as far as the wire reads it."""
    if native:
        events = b"".join(b"data: %s\n\n" % json.dumps(c["engine_data"]["sglang_response"]).encode() for c in chunks)
        return HttpResponse(200, events + b"data: [DONE]\n\n")
    last = chunks[-1]
    ids = [t for c in chunks for t in c["token_ids"]]
    choice = {"text": "", "index": 0, "finish_reason": "stop", "logprobs": {"token_logprobs": []}}
    body = {"choices": [choice], "nvext": {"completion_token_ids": ids, "engine_data": last.get("engine_data", {})}}
    return HttpResponse.from_json(body, 200)


@settings(max_examples=150, **_SETTINGS)  # type: ignore[arg-type]
@given(valid_bodies(vocab=VOCAB, context=CONTEXT), st.sampled_from(BAD_VALUES))
def test_any_bad_native_value_is_refused_naming_the_field(
    body: dict[str, Any], bad: tuple[tuple[str, ...], Any, str]
) -> None:
    worker, engine = _worker()
    where, value, field = bad
    bad_body = with_value({**body, "stream": True}, where, value)
    if where == ("sampling_params", "min_new_tokens"):
        bad_body["sampling_params"]["max_new_tokens"] = 4
    chunks = asyncio.run(_chunks(worker, _native_request(bad_body)))
    (chunk,) = chunks
    err = chunk["engine_data"]["sglang_response"]["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err
    assert engine.generated == []  # no engine saw it
    with pytest.raises(InvalidRequest) as info:
        _wire().parse_generation(GenerateRequest(input_ids=[1]), _as_response(chunks, native=True), 0.0)
    assert info.value.field == _our(field)


@settings(max_examples=60, **_SETTINGS)  # type: ignore[arg-type]
@given(valid_bodies(vocab=VOCAB, context=CONTEXT))
def test_any_valid_native_body_is_served(body: dict[str, Any]) -> None:
    worker, _ = _worker()
    chunks = asyncio.run(_chunks(worker, _native_request({**body, "stream": True})))
    req = GenerateRequest(input_ids=body["input_ids"], return_logprobs=body["return_logprob"])
    gen = _wire().parse_generation(req, _as_response(chunks, native=True), 0.0)
    sp = body["sampling_params"]
    stopped = gen.finish_reason is FinishReason.STOP and gen.output_ids[-1] in sp.get("stop_token_ids", ())
    assert len(gen.output_ids) == sp["max_new_tokens"] or stopped
    assert (gen.logprobs is not None) == body["return_logprob"]


@settings(max_examples=80, **_SETTINGS)  # type: ignore[arg-type]
@given(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
    st.integers(1, 8),
    st.sampled_from(PREPROCESSED_BAD),
)
def test_any_bad_preprocessed_value_is_refused_naming_the_field(
    ids: list[int], max_tokens: int, bad: tuple[tuple[str, ...], Any, str]
) -> None:
    worker, engine = _worker()
    where, value, field = bad
    request = with_value(_preprocessed(ids, max_tokens), where, value)
    chunks = asyncio.run(_chunks(worker, request))
    (chunk,) = chunks
    assert chunk["engine_data"]["refused"]["param"] == field, chunk
    assert engine.generated == []
    with pytest.raises(InvalidRequest) as info:
        _wire().parse_generation(GenerateRequest(input_ids=[1]), _as_response(chunks, native=False), 0.0)
    assert info.value.field == _our(field)


def test_a_client_that_is_not_ours_gets_dynamos_http_error() -> None:
    """Without our annotation the caller reads no engine_data: Dynamo's HttpError(400) instead."""
    worker, _ = _worker()
    request = _preprocessed([1, VOCAB], 2)
    del request["annotations"]
    with pytest.raises(Exception) as info:
        asyncio.run(_chunks(worker, request))
    exc = info.value
    assert getattr(exc, "code", None) == 400 or isinstance(exc, InvalidRequest)
    assert "input_ids[1]" in str(exc)
    assert refusal(InvalidRequest("sampling.seed", "x")).args  # constructible with or without Dynamo


def test_a_duplicate_in_flight_rid_is_refused_and_loses_nothing() -> None:
    async def run() -> None:
        worker, engine = _worker(step_s=0.005)
        first = asyncio.ensure_future(_chunks(worker, _preprocessed([1, 2], 20, rid="dup")))
        for _ in range(400):
            if "dup" in engine._inflight:
                break
            await asyncio.sleep(0.005)
        native_dup = {"input_ids": [1], "rid": "dup", "stream": True, "sampling_params": {"max_new_tokens": 2}}
        for request in (_preprocessed([3], 2, rid="dup"), _native_request(native_dup)):
            (chunk,) = await _chunks(worker, request)
            refused = chunk["engine_data"].get("refused") or chunk["engine_data"]["sglang_response"]["error"]
            assert refused["param"] == "rid", chunk
        for where, value, _field in PREPROCESSED_BAD:  # refusals while it runs
            (chunk,) = await _chunks(worker, with_value(_preprocessed([1], 2, rid="other"), where, value))
            assert "refused" in chunk["engine_data"]
        assert engine.aborted == [] and engine.generated == ["dup"]
        chunks = await first
        assert sum(len(c["token_ids"]) for c in chunks) == 20 and chunks[-1]["finish_reason"] == "length"
        assert not worker._inflight
        ok = await _chunks(worker, _preprocessed([1], 2, rid="dup"))  # the id is free again
        assert sum(len(c["token_ids"]) for c in ok) == 2

    asyncio.run(run())


def _our(native: str) -> str:
    from rollout_backends.sglang_native import our_field

    return our_field(native)


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("control/update_weights_from_disk", {"model_path": "/m", "flush_cache": "false"}, "flush_cache"),
        ("control/update_weights_from_disk", {}, "model_path"),
        ("control/update_weight_version", {"new_version": 7}, "new_version"),
        ("control/update_weight_version", {"new_version": "v", "abort_all_requests": "no"}, "abort_all_requests"),
        ("control/update_weights_from_tensor", {"serialized_named_tensors": "x"}, "serialized_named_tensors"),
        ("control/release_memory_occupation", {"tags": ["gpu"]}, "tags[0]"),
    ],
)
def test_engine_route_bodies_are_typed(route: str, body: dict[str, Any], field: str) -> None:
    """A wrong value in an engine route's body is ``success: false`` naming the key (the wire's
    ControlFailed), before the engine sees it; never read by truthiness, never a 500."""
    from rollout_backends.adapters.dynamo._worker import _json_safe

    worker, engine = _worker()
    before = list(engine.calls)
    out = asyncio.run(_json_safe(worker.routes()[route])(body))
    assert out["success"] is False and out["param"] == field, out
    assert engine.calls == before


def test_every_chunk_carries_the_version_of_its_tokens() -> None:
    """From the engine's version_spans (a generation across an update): each token's chunk says
    the version it was generated under, the last chunk too beside the finish's weight_version;
    chunks before the last hold nothing else in engine_data (the wire reads them as not the end)."""
    worker, _ = _worker()
    gen = Generation(
        request_id="r1",
        output_ids=(5, 6, 7, 8),
        logprobs=(-0.5, -0.5, -0.5, -0.5),
        finish_reason=FinishReason.LENGTH,
        weight_version="b",
        prompt_tokens=2,
        version_at_start="a",
        version_spans=((0, "a"), (2, "b")),
    )
    chunks = worker._chunks(gen)
    assert [c["engine_data"]["chunk_weight_version"] for c in chunks] == ["a", "a", "b", "b"]
    assert all(c["engine_data"] == {"chunk_weight_version": "a"} for c in chunks[:2])
    assert chunks[2]["engine_data"] == {"chunk_weight_version": "b"} and "finish_reason" not in chunks[2]
    assert chunks[-1]["engine_data"]["weight_version"] == "b" and chunks[-1]["finish_reason"] == "length"
    # No spans from the engine: every token is the finish's version.
    plain = worker._chunks(attrs.evolve(gen, version_spans=None, version_at_start=None))
    assert [c["engine_data"]["chunk_weight_version"] for c in plain] == ["b"] * 4
