"""The reference server's /generate boundary: one strictness rule (the codec's), typed 400s naming
the caller's field, never a 500; text like stock SGLang; nothing lost while refusing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from fake_engine import FakeEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_backends.adapters.reference._server import build_app
from tests.native_bodies import BAD_VALUES, serve_in_thread, valid_bodies, with_value

VOCAB, CONTEXT = 64, 32
#: What the reference server accepts where the codec's default rules do not (prefill only).
_ACCEPTED_HERE = {"sampling_params.max_new_tokens": 0}
SERVER_BAD = [b for b in BAD_VALUES if _ACCEPTED_HERE.get(b[2], object()) != b[1]]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine(vocab_size=VOCAB, max_context=CONTEXT)

    async def make() -> web.Application:
        return build_app(engine, model_path="/models/tiny", health_generation=False)

    with serve_in_thread(make) as url:
        yield url, engine


@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(valid_bodies(vocab=VOCAB, context=CONTEXT), st.sampled_from(SERVER_BAD))
def test_any_bad_value_is_a_400_naming_the_field(
    server: tuple[str, FakeEngine], body: dict[str, Any], bad: tuple[tuple[str, ...], Any, str]
) -> None:
    url, _ = server
    where, value, field = bad
    bad_body = with_value(body, where, value)
    if where == ("sampling_params", "min_new_tokens"):
        bad_body["sampling_params"]["max_new_tokens"] = 4
    r = httpx.post(f"{url}/generate", json=bad_body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err


@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(valid_bodies(vocab=VOCAB, context=CONTEXT))
def test_any_valid_body_is_served(server: tuple[str, FakeEngine], body: dict[str, Any]) -> None:
    url, _ = server
    r = httpx.post(f"{url}/generate", json=body, timeout=10)
    assert r.status_code == 200, r.text
    out = r.json()
    assert "text" not in out  # no tokenizer: token ids only, as --skip-tokenizer-init
    assert 1 <= len(out["output_ids"]) <= body["sampling_params"]["max_new_tokens"]


def test_refusals_lose_nothing_and_the_server_stays_healthy(server: tuple[str, FakeEngine]) -> None:
    url, engine = server
    # 28 tokens x 100 ms (the context is 32): the first request stays in flight while the refusals go by (at 20 x 10 ms
    # it had finished before the duplicate rid arrived on a loaded 2-core machine).
    engine.step_s = 0.1
    try:
        with httpx.Client(timeout=30) as c:
            long_body = {"input_ids": [1, 2], "rid": "keep", "sampling_params": {"max_new_tokens": 28}}

            def run_long() -> httpx.Response:
                return c.post(f"{url}/generate", json=long_body)

            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                running = pool.submit(run_long)
                for _ in range(100):
                    if "keep" in engine._inflight:
                        break
                    time.sleep(0.005)
                # A duplicate in-flight rid is refused; it neither aborts nor disturbs the first. (First:
                # the long request must still run, and the refusals below take a while.)
                dup = c.post(f"{url}/generate", json=long_body)
                assert dup.status_code == 400 and dup.json()["error"]["param"] == "rid"
                for where, value, _field in SERVER_BAD:
                    assert c.post(f"{url}/generate", json=with_value(long_body, where, value)).status_code == 400
                # Deep nesting past what the JSON parser takes: a typed 400, not a 500.
                deep = "[" * 5000 + "]" * 5000
                r = c.post(f"{url}/generate", content=deep, headers={"Content-Type": "application/json"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "body"
                first = running.result()
            assert first.status_code == 200
            meta = first.json()["meta_info"]
            assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 28
            assert c.get(f"{url}/health").status_code == 200
            ok = c.post(f"{url}/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
            assert ok.status_code == 200
    finally:
        engine.step_s = 0.0


class _Encoding:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class ByteTokenizer:
    """A stand-in for ``tokenizers.Tokenizer``: one token per character (mod the vocabulary)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        return _Encoding([ord(ch) % VOCAB for ch in text])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


async def test_text_in_and_out_like_stock_sglang() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    engine = FakeEngine(vocab_size=VOCAB, max_context=CONTEXT)
    app = build_app(engine, model_path="/models/tiny", health_generation=False, tokenizer=ByteTokenizer())
    async with TestClient(TestServer(app)) as c:
        r = await c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
        out = await r.json()
        assert r.status == 200, out
        assert out["text"] == ByteTokenizer().decode(out["output_ids"]) and len(out["output_ids"]) == 3
        info = await (await c.get("/server_info")).json()
        assert info["skip_tokenizer_init"] is False


async def test_the_real_tokenizer_is_loaded_unless_skipped(model_dir: Any) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    engine = FakeEngine(vocab_size=VOCAB, max_context=CONTEXT)
    for skip, has_text in ((False, True), (True, False)):
        app = build_app(engine, model_path=str(model_dir), health_generation=False, skip_tokenizer_init=skip)
        async with TestClient(TestServer(app)) as c:
            r = await c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
            out = await r.json()
            assert r.status == 200 and ("text" in out) is has_text and (not has_text or isinstance(out["text"], str))


@pytest.mark.parametrize(
    "key",
    ["return_routed_experts", "return_hidden_states", "image_data", "video_data", "audio_data",
     "custom_logit_processor", "lora_path", "input_embeds", "session_params", "return_entropy", "bootstrap_host"],
)  # fmt: skip
async def test_what_it_cannot_honour_is_refused(key: str) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    value: Any = True if key.startswith("return_") else ([[0.1]] if key == "input_embeds" else "x")
    if key == "session_params":
        value = {"id": "s"}
    app = build_app(FakeEngine(), model_path="/models/tiny", health_generation=False)
    async with TestClient(TestServer(app)) as c:
        r = await c.post("/generate", json={"input_ids": [1], key: value})
        assert r.status == 400 and (await r.json())["error"]["param"] == key
