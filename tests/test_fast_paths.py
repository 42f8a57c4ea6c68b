"""Fast paths added for client overhead keep the exact behaviour of the checking code."""

from __future__ import annotations

import enum
import math
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

import rollout_backends as rb
from rollout_backends._types import _checked_token_ids, _token_ids
from rollout_backends.kit import HttpClient, HttpRequest
from rollout_backends.sglang_native import _checked_logprobs, _fast_logprobs
from rollout_backends.sglang_native import parse_answer as parse_native_generation
from tests.aiohttp_app import serving

SETTINGS = settings(max_examples=300, deadline=None, database=None, derandomize=True)


class _Tok(enum.IntEnum):  # an int subclass that is not bool: the loop accepts it
    A = 3


def _outcome(fn: Any, *args: Any) -> Any:
    """A result, or the error's type, field and message: what a caller can observe."""
    try:
        return ("ok", fn(*args))
    except rb.InvalidRequest as exc:
        return ("error", exc.field, str(exc))


_token = st.one_of(
    st.integers(-5, 5),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.floats(allow_nan=True),
    st.just(_Tok.A),
    st.text(max_size=2),
    st.none(),
)
#: Mostly plain non-negative ints (the fast path), with now and then one token of another kind.
_tokens = st.one_of(
    st.lists(st.integers(0, 2**31), max_size=300),
    st.lists(st.one_of(st.integers(0, 50_000), _token), max_size=40),
)


@SETTINGS
@given(_tokens, st.sampled_from([list, tuple, iter]))
def test_token_ids_fast_path_agrees_with_the_loop(tokens: list[Any], container: Any) -> None:
    fast = _outcome(_token_ids, "input_ids", container(tokens))
    assert fast == _outcome(_checked_token_ids, "input_ids", container(tokens))
    if fast[0] == "ok":
        assert type(fast[1]) is tuple and all(type(t) is int for t in fast[1])


@pytest.mark.parametrize(
    ("tokens", "field"),
    [([1, True], "input_ids[1]"), ((0, -1), "input_ids[1]"), ([5, 2.0], "input_ids[1]"), ([None], "input_ids[0]")],
)
def test_generate_request_names_the_bad_token(tokens: Any, field: str) -> None:
    with pytest.raises(rb.InvalidRequest) as info:
        rb.GenerateRequest(input_ids=tokens)
    assert info.value.field == field


CASES: list[tuple[list[Any], list[Any]]] = [
    ([[-0.5, 1, None], [-0.25, 2, None]], [1, 2]),  # the common case
    ([[0, 1, None], [-0.25, 2]], [1, 2]),  # int logprob: accepted by the checking loop
    ([(-0.5, 1), (-0.25, 2)], [1, 2]),  # tuples (in-process callers)
    ([[-0.5, 1], [math.nan, 2]], [1, 2]),  # NaN
    ([[-0.5, 1], [-0.25, 3]], [1, 2]),  # wrong id
    ([[-0.5, 1], [-0.25]], [1, 2]),  # short entry
    ([[-0.5, 1], "x"], [1, 2]),  # not an entry
    ([[-0.5, 1], [True, 2]], [1, 2]),  # bool logprob
]


def _logprobs_outcome(entries: list[Any], out: tuple[Any, ...]) -> Any:
    try:
        return _checked_logprobs(entries, out, None)
    except rb.ContractViolation:
        return rb.ContractViolation


@pytest.mark.parametrize(("entries", "out"), CASES)
def test_fast_logprobs_agree_with_the_checking_loop(entries: list[Any], out: list[Any]) -> None:
    fast = _fast_logprobs(entries, tuple(out))
    if fast is not None:  # the fast path only ever accepts what the loop accepts, with the same values
        assert fast == _logprobs_outcome(entries, tuple(out))


def test_the_common_answer_takes_the_fast_path() -> None:
    entries = [[-0.5, 1, None], [-0.25, 2, "tok"], [-1e-9, 3]]
    assert _fast_logprobs(entries, (1, 2, 3)) == (-0.5, -0.25, -1e-9)


_logprob = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-50, 0),
    st.integers(-3, 0),
    st.booleans(),
    st.none(),
    st.text(max_size=2),
)


@st.composite
def _answers(draw: Any) -> tuple[list[Any], tuple[int, ...]]:
    """Output ids and logprob entries: mostly well-formed, now and then one entry of another shape."""
    out = tuple(draw(st.lists(st.integers(0, 100), max_size=12)))
    entries: list[Any] = []
    for tid in out:
        kind = draw(st.integers(0, 9))
        lp = draw(st.floats(-30, 0)) if kind < 6 else draw(_logprob)
        eid = tid if kind != 7 else draw(st.one_of(st.integers(0, 100), st.floats(0, 100), st.booleans()))
        tail = draw(st.sampled_from([[], [None], ["t"], [None, 1]]))
        entry: Any = [lp, eid, *tail]
        if kind == 8:
            entry = draw(st.sampled_from([tuple(entry), entry[:1], [], "x", None, {"lp": lp}]))
        entries.append(entry)
    return entries, out


@SETTINGS
@given(_answers())
def test_fast_logprobs_agree_with_the_checking_loop_on_any_answer(answer: tuple[list[Any], tuple[int, ...]]) -> None:
    entries, out = answer
    fast = _fast_logprobs(entries, out)
    checked = _logprobs_outcome(entries, out)
    if fast is not None:
        assert fast == checked and all(type(x) is float for x in fast)
    # And the whole parse: a Generation exactly when the loop accepts, else a ContractViolation.
    data = {"output_ids": list(out), "meta_info": {"finish_reason": "length", "output_token_logprobs": entries}}
    try:
        gen: Any = parse_native_generation(rb.GenerateRequest(input_ids=[1]), data, 0.0, worker=None)
    except rb.ContractViolation:
        gen = rb.ContractViolation
    assert (gen is rb.ContractViolation) == (checked is rb.ContractViolation)
    if gen is not rb.ContractViolation:
        assert gen.logprobs == checked and gen.output_ids == out


@pytest.mark.parametrize("out", [[1, True], [1, 2.0], [1, "2"]])
def test_output_ids_must_be_ints(out: list[Any]) -> None:
    data = {"output_ids": out, "meta_info": {"finish_reason": {"type": "length"}}}
    req = rb.GenerateRequest(input_ids=[1], return_logprobs=False)
    with pytest.raises(rb.ContractViolation):
        parse_native_generation(req, data, 0.0, worker=None)


def test_finish_reason_strings_and_members() -> None:
    req = rb.GenerateRequest(input_ids=[1], return_logprobs=False)
    for fr in ("stop", {"type": "length"}, rb.FinishReason.ABORT):
        data = {"output_ids": [1], "meta_info": {"finish_reason": fr}}
        gen = parse_native_generation(req, data, 0.0, worker="w")
        assert isinstance(gen.finish_reason, rb.FinishReason) and gen.worker == "w"


async def test_api_key_rides_on_the_session_and_a_request_header_wins() -> None:
    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/x", handler)
    client = HttpClient(api_key="k1")
    async with serving(app) as base:
        try:
            url = f"{base}/x"
            await client.send(HttpRequest("GET", url))
            await client.send(HttpRequest("GET", url, headers={"Authorization": "Bearer other"}))
        finally:
            await client.aclose()
    assert seen == ["Bearer k1", "Bearer other"]


async def test_json_bodies_go_out_as_before_and_a_request_content_type_wins() -> None:
    seen: list[tuple[str, str | None, bytes, str | None]] = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append((request.method, request.headers.get("Content-Type"), body, request.headers.get("X-Key")))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/x", handler)
    client = HttpClient()
    body = {"input_ids": (1, 2, 3), "rid": "r", "sampling_params": {"temperature": 0.5}}
    async with serving(app) as base:
        try:
            url = f"{base}/x"
            await client.send(HttpRequest("POST", url, json=body))
            await client.send(HttpRequest("POST", url, json=body, headers={"X-Key": "k"}))
            await client.send(HttpRequest("POST", url, json=[1], headers={"Content-Type": "application/x-mine"}))
            await client.send(HttpRequest("GET", url))
        finally:
            await client.aclose()
    wire = b'{"input_ids":[1,2,3],"rid":"r","sampling_params":{"temperature":0.5}}'
    assert seen == [
        ("POST", "application/json", wire, None),
        ("POST", "application/json", wire, "k"),
        ("POST", "application/x-mine", b"[1]", None),
        ("GET", None, b"", None),
    ]
