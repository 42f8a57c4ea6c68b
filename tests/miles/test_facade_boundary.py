"""The facade's boundary: ``/generate`` and ``/v1/chat/completions`` parsed by the codec's one rule.

Any bad value anywhere in the request shape is a 400 naming the field as the caller spelled it
(never a 503, which Miles retries 60 times, nor a 500); valid bodies are served; refusals reach no
backend, lose no request in flight and leave the facade healthy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rollout_backends as rb
from rollout_backends.integrations.miles import MilesFacade
from rollout_backends.sglang_native import UnknownKeys
from tests.miles.scripted import ScriptedBackend
from tests.native_bodies import BAD_VALUES, serve_in_thread, valid_bodies, with_value

VOCAB, CONTEXT = 64, 32

#: (a chat key, a wrong value, the field the refusal must name): the chat's own spellings.
CHAT_BAD: list[tuple[str, Any, str]] = [
    ("seed", "7", "seed"),
    ("seed", 2**63, "seed"),
    ("max_tokens", 2**64, "max_tokens"),
    ("max_tokens", True, "max_tokens"),
    ("max_completion_tokens", 4.0, "max_completion_tokens"),
    ("min_tokens", 10**6, "min_tokens"),
    ("temperature", "0.5", "temperature"),
    ("top_p", 0.0, "top_p"),
    ("top_k", 0, "top_k"),
    ("stop_token_ids", [2**70], "stop_token_ids[0]"),
    ("stop_token_ids", [VOCAB], "stop_token_ids[0]"),
    ("stop", ["\n"], "stop"),
    ("logprobs", "true", "logprobs"),
    ("stream", "no", "stream"),
    ("stream", True, "stream"),
    ("n", 2, "n"),
    ("rid", 7, "rid"),
    ("input_ids", [1, -1], "input_ids[1]"),
    ("input_ids", [1, VOCAB], "input_ids[1]"),
    ("input_ids", [[1], [2]], "input_ids"),
    ("return_logprobs", True, "return_logprobs"),
    ("return_routed_experts", True, "return_routed_experts"),
    ("skip_special_tokens", "yes", "skip_special_tokens"),
]


#: The codec's bad values, but a batch (a list of prompts) is served here as SGLang serves it; its
#: bad prompts are refused naming the item.
FACADE_BAD = [b for b in BAD_VALUES if b[1] != [[1], [2]]] + [
    (("input_ids",), [[1], []], "input_ids[1]"),
    (("input_ids",), [[1], [2, 2.0]], "input_ids[1][1]"),
]


def _backend() -> ScriptedBackend:
    backend = ScriptedBackend(("w0", "w1"))
    backend.capabilities = attrs.evolve(backend.capabilities, vocab_size=VOCAB, max_context=CONTEXT)
    return backend


@pytest.fixture(scope="module")
def facade() -> Iterator[tuple[str, ScriptedBackend]]:
    backend = _backend()

    async def make() -> web.Application:
        return MilesFacade(backend, model_path="tiny").app()

    with serve_in_thread(make) as url:
        yield url, backend


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )


@_settings(150)
@given(valid_bodies(vocab=VOCAB, context=CONTEXT), st.sampled_from(FACADE_BAD))
def test_any_bad_generate_value_is_a_400_naming_the_field(
    facade: tuple[str, ScriptedBackend], body: dict[str, Any], bad: tuple[tuple[str, ...], Any, str]
) -> None:
    url, backend = facade
    where, value, field = bad
    bad_body = with_value(body, where, value)
    if where == ("sampling_params", "min_new_tokens"):
        bad_body["sampling_params"]["max_new_tokens"] = 4
    before = len(backend.requests)
    r = httpx.post(f"{url}/generate", json=bad_body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err
    assert len(backend.requests) == before  # refused before any backend saw it


@_settings(60)
@given(valid_bodies(vocab=VOCAB, context=CONTEXT))
def test_any_valid_generate_body_is_served(facade: tuple[str, ScriptedBackend], body: dict[str, Any]) -> None:
    url, backend = facade
    r = httpx.post(f"{url}/generate", json=body, timeout=10)
    assert r.status_code == 200, r.text
    out = r.json()
    sp = body["sampling_params"]
    assert len(out["output_ids"]) == sp["max_new_tokens"] and out["text"] == ""  # no tokenizer
    req = backend.requests[-1]
    assert list(req.input_ids) == body["input_ids"] and req.return_logprobs == body["return_logprob"]
    assert req.sampling.seed == sp.get("sampling_seed") and tuple(sp.get("stop_token_ids", ())) == (
        req.sampling.stop_token_ids
    )
    assert ("output_token_logprobs" in out["meta_info"]) == body["return_logprob"]


@_settings(120)
@given(valid_bodies(vocab=VOCAB, context=CONTEXT), st.sampled_from(CHAT_BAD))
def test_any_bad_chat_value_is_a_400_naming_the_chat_key(
    facade: tuple[str, ScriptedBackend], body: dict[str, Any], bad: tuple[str, Any, str]
) -> None:
    url, backend = facade
    key, value, field = bad
    chat: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    chat["input_ids"] = body["input_ids"]
    chat["max_tokens"] = body["sampling_params"]["max_new_tokens"]
    chat[key] = value
    before = len(backend.requests)
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err
    assert len(backend.requests) == before


def test_a_backend_refusal_is_a_400_in_the_callers_spelling(facade: tuple[str, ScriptedBackend]) -> None:
    """The backend names our fields (``sampling.seed``); the caller reads SGLang's, never a 503."""
    url, backend = facade
    backend.failures.append(rb.InvalidRequest("sampling.seed", "refused by the engine"))
    backend.failures.append(rb.InvalidRequest("sampling.stop_token_ids[0]", "outside the vocabulary"))
    try:
        body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "sampling_seed": 3}}
        r = httpx.post(f"{url}/generate", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.sampling_seed"
        chat = {"messages": [], "input_ids": [1], "max_tokens": 2, "stop_token_ids": [3]}
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids[0]", r.text
    finally:
        backend.failures.clear()


def test_refusals_lose_nothing_and_the_facade_stays_healthy(facade: tuple[str, ScriptedBackend]) -> None:
    url, backend = facade
    backend.hold = rb_event = asyncio.Event()
    try:
        with httpx.Client(timeout=30) as c:
            long_body = {"input_ids": [1, 2], "rid": "keep", "sampling_params": {"max_new_tokens": 20}}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                running = pool.submit(c.post, f"{url}/generate", json=long_body)
                for _ in range(400):
                    if any(r.request_id == "keep" for r in backend.requests):
                        break
                    time.sleep(0.005)
                for where, value, _field in FACADE_BAD:
                    assert c.post(f"{url}/generate", json=with_value(long_body, where, value)).status_code == 400
                # A duplicate in-flight rid is refused; it neither aborts nor disturbs the first.
                dup = c.post(f"{url}/generate", json=long_body)
                assert dup.status_code == 400 and dup.json()["error"]["param"] == "rid", dup.text
                deep = "[" * 5000 + "]" * 5000
                r = c.post(f"{url}/generate", content=deep, headers={"Content-Type": "application/json"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "body"
                assert "abort" not in backend.names() and "abort_all" not in backend.names()
                rb_event.set()
                first = running.result()
            assert first.status_code == 200
            meta = first.json()["meta_info"]
            assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 20
            assert c.get(f"{url}/health").status_code == 200
            ok = c.post(f"{url}/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
            assert ok.status_code == 200
    finally:
        backend.hold = None


async def test_the_lenient_switch_keeps_sglangs_ignore_unknown_keys_rule() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}, "my_extra": 1}
    chat = {"messages": [], "input_ids": [1], "max_tokens": 2, "my_extra": 1}
    for keys, status in ((UnknownKeys.REFUSE, 400), (UnknownKeys.IGNORE, 200)):
        app = MilesFacade(_backend(), model_path="tiny", unknown_keys=keys).app()
        async with TestClient(TestServer(app)) as c:
            r = await c.post("/generate", json=body)
            assert r.status == status, await r.text()
            r = await c.post("/v1/chat/completions", json=chat)
            assert r.status == status, await r.text()
        # Unknown sampling keys are refused in both modes (SGLang's schema gate refuses them too).
        async with TestClient(TestServer(app)) as c:
            r = await c.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_token": 2}})
            assert r.status == 400 and (await r.json())["error"]["param"] == "sampling_params.max_new_token"


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/update_weights_from_disk", {"model_path": "/m", "flush_cache": "false"}, "flush_cache"),
        ("/update_weights_from_disk", {"model_path": "/m", "abort_all_requests": "yes"}, "abort_all_requests"),
        ("/update_weight_version", {"new_version": 3}, "new_version"),
        ("/init_weights_update_group", {"master_address": "h", "master_port": "1", "world_size": 2}, "master_port"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["f"], "shapes": [[-1]]}, "shapes[0][0]"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"], "flush_cache": 1}, "flush_cache"),
        ("/pause_generation", {"mode": "sideways"}, "mode"),
        ("/abort_request", {"abort_all": "true"}, "abort_all"),
        ("/release_memory_occupation", {"tags": ["gpu"]}, "tags[0]"),
        ("/w/w0/update_weights_from_disk", {"model_path": "/m", "weight_version": 1}, "weight_version"),
    ],
)
def test_control_bodies_are_typed(
    facade: tuple[str, ScriptedBackend], route: str, body: dict[str, Any], field: str
) -> None:
    """A control body's wrong value is a 400 naming its key, before any backend call (SGLang's
    ``{"success": false}`` shape where SGLang answers it)."""
    url, backend = facade
    before = len(backend.calls)
    r = httpx.post(f"{url}{route}", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert field in r.text and len(backend.calls) == before


def test_a_bad_query_value_is_a_400_not_a_500(facade: tuple[str, ScriptedBackend]) -> None:
    url, _ = facade
    for q in ("soon", "-1", "nan"):
        r = httpx.get(f"{url}/health_generate", params={"timeout": q}, timeout=10)
        assert r.status_code == 400 and "timeout" in r.text, (q, r.status_code, r.text)
