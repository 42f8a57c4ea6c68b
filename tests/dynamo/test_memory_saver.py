"""``connect`` asks the workers whether SGLang's memory saver is on (``_memory_saver.py``), without
processes (MockTransport): a user's own ``dynamo.sglang`` fleet without ``--enable-memory-saver``
declared ``memory_release`` (the GRPO bench's Dynamo row released and resumed every step, its
SGLang row did not). The real 1.4.2 route's answer is ``test_sglang_shim.py``'s; our worker's in
a real fleet, ``test_dynamo_reference.py``'s."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_backends import ConnectionFailed
from rollout_backends._http import HttpClient, HttpRequest, HttpResponse, MockTransport
from rollout_backends.adapters.dynamo import connect, open_from_url
from rollout_backends.adapters.dynamo._memory_saver import DEFAULT_MEMORY_SAVER, memory_saver_of
from rollout_backends.adapters.dynamo._worker import DynamoWorker
from rollout_backends.adapters.reference._engine import ENABLE_MEMORY_SAVER, ReferenceEngine
from rollout_backends.kit import HttpFleetBackend

WORKERS = ["http://w:1", "http://w:2"]
TM_CALL = {"method": "get_internal_state", "args": [], "kwargs": {}}


def _state(on: bool | None) -> dict[str, Any]:
    """One DP rank's ``internal_state`` (SGLang 0.5.16: ``vars(ServerArgs)`` and load figures)."""
    state: dict[str, Any] = {"page_size": 16, "tp_size": 1, "last_gen_throughput": 0.0}
    if on is not None:
        state["enable_memory_saver"] = on
    return state


def _fleet(engine: dict[str, HttpResponse]) -> MockTransport:
    """A frontend with one model and two workers; ``engine`` answers ``<worker>/engine/<route>``
    (``w:1/call_tokenizer_manager``), every other engine route is missing."""

    def handler(req: HttpRequest) -> HttpResponse:
        host, path = req.url.split("://", 1)[1].split("/", 1)
        if path == "v1/models":
            return HttpResponse.from_json({"data": [{"id": "tiny"}]})
        if path == "health":  # one instance: a fleet connected without worker URLs has it
            return HttpResponse.from_json({"instances": [{"endpoint": "generate", "instance_id": 9}]})
        route = path.removeprefix("engine/")
        if route == "call_tokenizer_manager":
            assert req.json == TM_CALL
        answer = engine.get(f"{host}/{route}")
        if answer is None:
            return HttpResponse.from_json({"message": f"Route not found: POST /{path}"}, 404)
        return answer

    return MockTransport(handler)


def _asked(transport: MockTransport) -> list[str]:
    return [r.url for r in transport.requests if "/engine/" in r.url]


async def _connect(transport: MockTransport, flavor: str, **kw: Any) -> HttpFleetBackend:
    return await connect("http://fe:1", workers=WORKERS, flavor=flavor, client=HttpClient(transport), **kw)


def _tm(*states: dict[str, Any]) -> HttpResponse:
    """dynamo.sglang 1.4.2's answer to a list result (``RLMixin._normalize_result``)."""
    return HttpResponse.from_json({"result": list(states)})


def test_memory_saver_of_the_answers() -> None:
    assert memory_saver_of({"result": [_state(True), _state(True)]}) is True
    assert memory_saver_of({"result": [_state(True), _state(False)]}) is False  # one DP rank without it
    assert memory_saver_of({"enable_memory_saver": False, "page_size": 16}) is False  # the shim's server args
    for unreadable in ({"result": [_state(None)]}, {"result": []}, {"result": "x"}, {"status": "error"}, None, []):
        with pytest.raises(ValueError):
            memory_saver_of(unreadable)


@pytest.mark.parametrize("flavor", ["sglang14", "sglang14-shim", "rollout"])
@pytest.mark.parametrize(("w1", "w2", "release"), [(True, True, True), (True, False, False), (False, False, False)])
async def test_read_from_every_worker_through_the_tokenizer_manager(
    flavor: str, w1: bool, w2: bool, release: bool
) -> None:
    transport = _fleet({"w:1/call_tokenizer_manager": _tm(_state(w1)), "w:2/call_tokenizer_manager": _tm(_state(w2))})
    b = await _connect(transport, flavor)
    try:
        assert b.capabilities.memory_release is release
        wire: Any = b.wire
        assert (wire.memory_saver, wire.memory_saver_source) == (release, "workers")
        if not release:
            off = [w for w, on in (("w:1", w1), ("w:2", w2)) if not on]
            assert wire.memory_saver_note == f"enable_memory_saver is off on {', '.join(off)}"
        assert sorted(u for u in _asked(transport) if u.endswith("call_tokenizer_manager")) == [
            f"{w}/engine/call_tokenizer_manager" for w in WORKERS
        ]
    finally:
        await b.aclose()


async def test_read_through_the_shims_server_args_on_1_6() -> None:
    """1.6.x has no ``call_tokenizer_manager``; the shim's ``rollout/server_args`` shows SGLang's args."""
    off = HttpResponse.from_json({"enable_memory_saver": False, "page_size": 16})
    on = HttpResponse.from_json({"enable_memory_saver": True, "page_size": 16})
    transport = _fleet({"w:1/rollout/server_args": on, "w:2/rollout/server_args": off})
    b = await _connect(transport, "sglang16-shim")
    try:
        wire: Any = b.wire
        assert not b.capabilities.memory_release and wire.memory_saver_source == "workers"
    finally:
        await b.aclose()


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (HttpResponse.from_json({"error": "Handler error", "message": "AttributeError: get_internal_state"}, 500),
         "HTTP 500"),
        (_tm(_state(None)), "no enable_memory_saver"),
        (HttpResponse(status=200, body=b"not json"), "ContractViolation"),
    ],
)  # fmt: skip
async def test_an_unreadable_answer_keeps_the_default(answer: HttpResponse, why: str) -> None:
    """A route error or a missing key never fails the connect: the old default, and the note says why."""
    transport = _fleet({"w:1/call_tokenizer_manager": _tm(_state(True)), "w:2/call_tokenizer_manager": answer})
    b = await _connect(transport, "sglang14")
    try:
        wire: Any = b.wire
        assert b.capabilities.memory_release is DEFAULT_MEMORY_SAVER is True
        assert wire.memory_saver_source == "default"
        assert wire.memory_saver_note.startswith("assumed True: not read (w:2: ") and why in wire.memory_saver_note
    finally:
        await b.aclose()


async def test_a_worker_that_does_not_answer_keeps_the_default() -> None:
    def handler(req: HttpRequest) -> HttpResponse:
        if "/engine/" in req.url:
            raise ConnectionFailed(f"{req.url}: connection refused")
        return _fleet({}).handler(req)  # type: ignore[return-value]

    b = await _connect(MockTransport(handler), "sglang14")
    try:
        wire: Any = b.wire
        assert b.capabilities.memory_release and wire.memory_saver_source == "default"
        assert "ConnectionFailed" in wire.memory_saver_note
    finally:
        await b.aclose()


@pytest.mark.parametrize(
    ("flavor", "workers", "why"),
    [
        ("vllm", WORKERS, "dynamo.vllm serves no route that shows --enable-sleep-mode"),
        ("sglang14", None, "no worker control URLs to ask"),  # the frontend's instances only
        ("mocker", WORKERS, "mocker workers serve no memory routes"),
    ],
)
async def test_not_asked_where_no_route_shows_it(flavor: str, workers: list[str] | None, why: str) -> None:
    off = _tm(_state(False))  # what would be read, were these routes asked
    transport = _fleet({f"w:{i}/{r}": off for i in (1, 2) for r in ("call_tokenizer_manager", "rollout/server_args")})
    b = await connect("http://fe:1", workers=workers, flavor=flavor, client=HttpClient(transport))
    try:
        wire: Any = b.wire
        assert (wire.memory_saver, wire.memory_saver_source) == (True, "default")
        assert wire.memory_saver_note == f"assumed True: {why}"
        assert b.capabilities.memory_release is (flavor != "mocker")
        assert not any("call_tokenizer_manager" in u or "server_" in u for u in _asked(transport))
    finally:
        await b.aclose()


@pytest.mark.parametrize("allowlisted", [True, False])
async def test_stock_1_6_is_read_where_server_info_is_allowlisted(allowlisted: bool) -> None:
    """Stock 1.6.x: ``--engine-route server_info=get_server_info`` serves SGLang's
    ``Engine.get_server_info`` (the server args at the top level); without it, the default."""
    info = HttpResponse.from_json({"enable_memory_saver": False, "internal_states": [_state(False)], "version": "x"})
    transport = _fleet({f"w:{i}/server_info": info for i in (1, 2)} if allowlisted else {})
    b = await _connect(transport, "sglang16")
    try:
        wire: Any = b.wire
        assert sorted(u for u in _asked(transport) if u.endswith("server_info")) == [
            f"{w}/engine/server_info" for w in WORKERS
        ]
        if allowlisted:
            assert (b.capabilities.memory_release, wire.memory_saver_source) == (False, "workers")
        else:
            assert (b.capabilities.memory_release, wire.memory_saver_source) == (True, "default")
            assert wire.memory_saver_note == (
                "assumed True: sglang16 workers serve no route that shows SGLang's server args"
                " (none allowlisted as server_info)"
            )
    finally:
        await b.aclose()


@pytest.mark.parametrize("said", [True, False])
async def test_the_caller_wins_and_nothing_is_asked(said: bool) -> None:
    transport = _fleet({f"w:{i}/call_tokenizer_manager": _tm(_state(not said)) for i in (1, 2)})
    b = await _connect(transport, "sglang14", memory_saver=said)
    try:
        wire: Any = b.wire
        assert b.capabilities.memory_release is said and wire.memory_saver_source == "caller"
        assert not any(u.endswith("call_tokenizer_manager") for u in _asked(transport))
    finally:
        await b.aclose()


@pytest.mark.parametrize(("key", "release", "source"), [("&memory_saver=0", False, "caller"),
                                                        ("&memory_saver=1", True, "caller"),
                                                        ("", False, "workers")])  # fmt: skip
async def test_the_url_key_wins_too(key: str, release: bool, source: str) -> None:
    transport = _fleet({f"w:{i}/call_tokenizer_manager": _tm(_state(False)) for i in (1, 2)})
    url = f"dynamo://fe:1?workers=w:1,w:2&flavor=sglang14{key}"
    b = await open_from_url(url, client=HttpClient(transport))
    try:
        wire: Any = b.wire
        assert b.capabilities.memory_release is release and wire.memory_saver_source == source
    finally:
        await b.aclose()


async def test_our_worker_answers_get_internal_state_as_dynamo_sglang_does() -> None:
    """``{"result": [state]}`` (1.4.2's normalised list) with the engine's ``enable_memory_saver``:
    the reference engine's is the reference server's (``ENABLE_MEMORY_SAVER``); an engine that does
    not say leaves the key out, so connect keeps its default."""
    from tests.reference.fake_engine import FakeEngine

    async def answer(engine: Any) -> dict[str, Any]:
        worker = DynamoWorker(engine, namespace="ns", model_path="/m", served_model_name="tiny", detokenize=False)
        said: dict[str, Any] = await worker.routes()["call_tokenizer_manager"](dict(TM_CALL))
        assert set(said) == {"result"} and len(said["result"]) == 1
        assert said["result"][0] == {**await worker.routes()["rollout/server_args"]({}), "last_gen_throughput": 0.0}
        return said

    assert ReferenceEngine.enable_memory_saver is ENABLE_MEMORY_SAVER is True
    for value in (True, False):
        engine = FakeEngine()
        engine.enable_memory_saver = value  # type: ignore[attr-defined]
        assert memory_saver_of(await answer(engine)) is value
    with pytest.raises(ValueError, match="no enable_memory_saver"):
        memory_saver_of(await answer(FakeEngine()))
