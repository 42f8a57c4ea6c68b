"""The reference server speaks SGLang's native HTTP API: shapes, errors, control routes, auth."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from fake_engine import FakeEngine

from rollout_backends._supervisor import ProcessSpec, Supervisor, free_port
from rollout_backends.adapters.reference._server import (
    SERVER_KEY,
    build_app,
    deserialize_named_tensors,
    serialize_named_tensors,
)
from rollout_backends.sglang_native import UnknownKeys


async def _client(engine: FakeEngine, **kw: Any) -> TestClient:
    kw.setdefault("model_path", "/models/tiny")
    kw.setdefault("health_generation", False)
    client = TestClient(TestServer(build_app(engine, **kw)))
    await client.start_server()
    return client


@pytest.fixture
async def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[TestClient]:
    c = await _client(engine)
    yield c
    await c.close()


def gen_body(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
        "return_logprob": True,
    }
    body.update(kw)
    return body


async def _wait_inflight(engine: FakeEngine, rid: str) -> None:
    for _ in range(200):
        if rid in engine._inflight:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{rid} never started")


# -- /generate ----------------------------------------------------------------------------------


async def test_generate_shape(client: TestClient) -> None:
    r = await client.post("/generate", json=gen_body(rid="r1"))
    assert r.status == 200
    body = await r.json()
    assert set(body) == {"output_ids", "meta_info"}
    assert body["output_ids"] == [7, 8, 9, 10]
    meta = body["meta_info"]
    assert meta["id"] == "r1"
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 4, 0)
    assert meta["weight_version"] == "v0"
    assert isinstance(meta["e2e_latency"], float)
    assert meta["output_token_logprobs"] == [
        [pytest.approx(-0.1 * (i + 1)), t, None] for i, t in enumerate([7, 8, 9, 10])
    ]


async def test_generate_stop_no_logprob_and_prompt_ids(client: TestClient) -> None:
    body = gen_body(return_logprob=False, return_prompt_token_ids=True)
    body["sampling_params"] = {"max_new_tokens": 8, "stop_token_ids": [8], "sampling_seed": -5, "n": 1,
                               "skip_special_tokens": True, "no_stop_trim": True, "stop": []}  # fmt: skip
    r = await client.post("/generate", json=body)
    assert r.status == 200, await r.text()
    out = await r.json()
    assert out["output_ids"] == [7, 8]  # the matched stop token is kept
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 8}
    assert "output_token_logprobs" not in out["meta_info"]
    assert out["prompt_token_ids"] == [1, 2, 3]
    assert len(out["meta_info"]["id"]) == 32  # generated rid


async def test_generate_put_and_prefill_only(client: TestClient) -> None:
    r = await client.put("/generate", json=gen_body(sampling_params={"max_new_tokens": 0}))
    out = await r.json()
    assert r.status == 200 and out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["output_token_logprobs"] == []


async def test_max_new_tokens_past_the_context_is_refused_as_sglang_does(client: TestClient) -> None:
    # context 32, prompt 30: SGLang refuses prompt + max_new_tokens >= context (it does not clamp).
    r = await client.post("/generate", json=gen_body(input_ids=[1] * 30, sampling_params={"max_new_tokens": 2}))
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "sampling_params.max_new_tokens"
    assert "exceeds the model's maximum context length" in err["message"]
    for mnt, n in ((1, 1), (None, 1)):  # null = up to the context; unset = SGLang's 128, capped the same way
        sp = {} if mnt is None else {"max_new_tokens": mnt}
        r = await client.post("/generate", json=gen_body(input_ids=[1] * 30, sampling_params=sp))
        assert (await r.json())["meta_info"]["completion_tokens"] == n


async def test_unknown_keys_are_400_naming_them(client: TestClient) -> None:
    r = await client.post("/generate", json=gen_body(sampling_params={"seed": 1}))
    assert r.status == 400
    err = (await r.json())["error"]
    # SGLang's schema-gate words, and the field as the caller spelled it.
    assert "unknown field `seed`, expected one of" in err["message"] and "`sampling_seed`" in err["message"]
    assert err["param"] == "sampling_params.seed"
    r = await client.post("/generate", json=gen_body(return_logprobs=True))  # a typo of return_logprob
    assert r.status == 400 and (await r.json())["error"]["param"] == "return_logprobs"


async def test_ignore_unknown_keys_keeps_sglangs_rule(engine: FakeEngine) -> None:
    c = await _client(engine, unknown_keys=UnknownKeys.IGNORE)
    try:
        r = await c.post("/generate", json=gen_body(unknown_top_level=1))
        assert r.status == 200
    finally:
        await c.close()


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"input_ids": [1, 64]}, "vocabulary"),
        ({"input_ids": [1] * 32}, "longer than the model's context length"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": "abc"}, "input_ids"),
        ({"input_ids": [1, 2.5]}, "int"),
        ({"input_ids": [1, True]}, "int"),
        ({"input_ids": [[1, 2], [3]]}, "batch"),
        ({"input_ids": None, "text": "hi"}, "tokenizer"),
        ({"input_ids": None}, "input_ids"),
        ({"return_logprob": "yes"}, "return_logprob"),
        ({"logprob_start_len": 3}, "logprob_start_len"),
        ({"logprob_start_len": 0, "return_logprob": False}, "return_logprobs"),
        ({"top_logprobs_num": 21}, "top_logprobs_num"),
        ({"top_logprobs_num": 2, "return_logprob": False}, "return_logprob=true"),
        ({"sampling_params": {"max_new_tokens": 16.0}}, "max_new_tokens"),
        ({"sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"sampling_params": {"ignore_eos": 1}}, "ignore_eos"),
        ({"sampling_params": {"top_p": 0.0}}, "top_p"),
        ({"sampling_params": {"top_k": 0}}, "top_k"),
        ({"sampling_params": {"stop": ["</s>"]}}, "stop strings"),
        ({"sampling_params": {"n": 2}}, "n > 1"),
        ({"sampling_params": {"regex": "a+"}}, "regex"),
        ({"sampling_params": [{"max_new_tokens": 1}]}, "batch"),
    ],
)
async def test_invalid_input_is_400_error_message(client: TestClient, patch: dict[str, Any], needle: str) -> None:
    body = gen_body()
    for k, v in patch.items():
        if v is None:
            body.pop(k, None)
        else:
            body[k] = v
    r = await client.post("/generate", json=body)
    assert r.status == 400, await r.text()
    err = (await r.json())["error"]
    assert isinstance(err, dict) and needle in err["message"], err


async def test_non_json_body(client: TestClient) -> None:
    r = await client.post("/generate", data=b"{nope")
    assert r.status == 400 and "invalid JSON" in (await r.json())["error"]["message"]


async def test_duplicate_inflight_rid(engine: FakeEngine, client: TestClient) -> None:
    engine.step_s = 0.02
    first = asyncio.ensure_future(
        client.post("/generate", json=gen_body(rid="dup", sampling_params={"max_new_tokens": 20}))
    )
    await _wait_inflight(engine, "dup")
    r = await client.post("/generate", json=gen_body(rid="dup"))
    assert r.status == 400 and "Duplicate request ID" in (await r.json())["error"]["message"]
    assert (await first).status == 200
    # once finished, the rid may be reused
    assert (await client.post("/generate", json=gen_body(rid="dup"))).status == 200


# -- abort, pause -------------------------------------------------------------------------------


async def test_abort_request_returns_partial_with_200(engine: FakeEngine, client: TestClient) -> None:
    engine.step_s = 0.02
    task = asyncio.ensure_future(
        client.post("/generate", json=gen_body(rid="a1", sampling_params={"max_new_tokens": 28}))
    )
    await _wait_inflight(engine, "a1")
    await asyncio.sleep(0.1)
    r = await client.post("/abort_request", json={"rid": "a1"})
    assert r.status == 200 and await r.read() == b""
    resp = await task
    assert resp.status == 200
    out = await resp.json()
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "message" in fr
    assert 0 < len(out["output_ids"]) < 28
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    # unknown rid, empty body: still 200
    assert (await client.post("/abort_request", json={"rid": "nope"})).status == 200
    assert (await client.post("/abort_request")).status == 200


async def test_abort_all(engine: FakeEngine, client: TestClient) -> None:
    engine.step_s = 0.02
    long = {"max_new_tokens": 28}  # prompt 3 + 28 < context 32
    tasks = [asyncio.ensure_future(client.post("/generate", json=gen_body(rid=f"b{i}", sampling_params=long)))
             for i in range(3)]  # fmt: skip
    for i in range(3):
        await _wait_inflight(engine, f"b{i}")
    assert (await client.post("/abort_request", json={"abort_all": True})).status == 200
    for t in tasks:
        assert (await (await t).json())["meta_info"]["finish_reason"]["type"] == "abort"


async def test_pause_retract_blocks_then_continue(engine: FakeEngine, client: TestClient) -> None:
    r = await client.post("/pause_generation", json={"mode": "retract"})
    assert r.status == 200 and await r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    assert (await client.get("/ready")).status == 503
    task = asyncio.ensure_future(client.post("/generate", json=gen_body()))
    await asyncio.sleep(0.1)
    assert not task.done()  # blocks while paused, does not fail
    r = await client.post("/continue_generation", json={"torch_empty_cache": True})
    assert r.status == 200 and (await r.json())["status"] == "ok"
    assert (await task).status == 200
    assert (await client.get("/ready")).status == 200


async def test_pause_default_mode_is_abort_and_bad_mode(engine: FakeEngine, client: TestClient) -> None:
    await client.post("/pause_generation", json={})
    assert engine.calls[-1][1].value == "abort"
    r = await client.post("/pause_generation", json={"mode": "freeze"})
    assert r.status == 400 and "mode" in (await r.json())["error"]["message"]


# -- health -------------------------------------------------------------------------------------


async def test_health_probe(engine: FakeEngine) -> None:
    c = await _client(engine, health_generation=True, health_timeout=0.3)
    try:
        assert (await c.get("/health")).status == 200
        assert (await c.get("/health_generate")).status == 200
        await c.post("/pause_generation", json={"mode": "retract"})
        assert (await c.get("/health_generate")).status == 503  # the probe cannot finish while paused
        assert not engine._inflight  # the timed-out probe was aborted/cancelled
        await c.post("/continue_generation")
        assert (await c.get("/health")).status == 200
    finally:
        await c.close()


async def test_health_without_generation(
    engine: FakeEngine, client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await client.post("/pause_generation", json={"mode": "retract"})
    assert (await client.get("/health")).status == 200  # no probe: answers while paused
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "0.2")
    c = await _client(engine, health_generation=None)
    try:
        assert c.server.app[SERVER_KEY].health_generation is False
        assert (await c.get("/health")).status == 200
        assert (await c.get("/health_generate")).status == 503  # still probes
    finally:
        await c.close()


# -- info ---------------------------------------------------------------------------------------


async def test_info_routes(client: TestClient) -> None:
    for path in ("/model_info", "/get_model_info"):
        info = await (await client.get(path)).json()
        assert info["model_path"] == "/models/tiny" and info["weight_version"] == "v0" and info["is_generation"]
    for path in ("/server_info", "/get_server_info"):
        si = await (await client.get(path)).json()
        assert si["version"] == "0.5.16" and si["page_size"] == 16 and si["weight_version"] == "v0"
        assert si["deployment_info"] == {"page_size": 16} and si["context_length"] == 32
        assert si["reference"]["worker_id"] == "fake-0"
    models = await (await client.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "/models/tiny"
    nf = await client.get("/get_weight_version")
    assert nf.status == 404 and await nf.json() == {"detail": "Not Found"}


async def test_openapi_and_begin_end_presence(engine: FakeEngine, client: TestClient) -> None:
    paths = (await (await client.get("/openapi.json")).json())["paths"]
    assert "post" in paths["/generate"] and "get" in paths["/flush_cache"] and "post" in paths["/flush_cache"]
    assert "/update_weights_from_tensor" in paths and "/begin_weight_update" not in paths
    assert (await client.post("/begin_weight_update", json={})).status == 404
    c = await _client(FakeEngine(), with_begin_end=True)
    try:
        paths = (await (await c.get("/openapi.json")).json())["paths"]
        assert "/begin_weight_update" in paths and "/end_weight_update" in paths
        assert (await (await c.get("/server_info")).json())["version"] == "0.5.23"
    finally:
        await c.close()


# -- control ------------------------------------------------------------------------------------


async def test_flush_cache_text(engine: FakeEngine, client: TestClient) -> None:
    for method in ("GET", "POST"):
        r = await client.request(method, "/flush_cache")
        assert r.status == 200 and r.content_type == "text/plain" and (await r.text()).startswith("Cache flushed.")
    engine.step_s = 0.02
    task = asyncio.ensure_future(
        client.post("/generate", json=gen_body(rid="busy", sampling_params={"max_new_tokens": 28}))
    )
    await _wait_inflight(engine, "busy")
    r = await client.post("/flush_cache")
    assert r.status == 400 and "pending requests" in await r.text()
    assert ("flush_cache", 0.0) in engine.calls
    r = await client.post("/flush_cache?timeout=2.5")  # SGLang's wait-for-idle, handed to the engine
    assert ("flush_cache", 2.5) in engine.calls
    for bad in ("x", "-1", "nan", "1e9"):
        r = await client.post(f"/flush_cache?timeout={bad}")
        assert r.status == 400 and "timeout" in await r.text()
    await client.post("/abort_request", json={"rid": "busy"})
    await task


async def test_update_weight_version_aborts_by_default(engine: FakeEngine, client: TestClient) -> None:
    engine.step_s = 0.02
    task = asyncio.ensure_future(
        client.post("/generate", json=gen_body(rid="w", sampling_params={"max_new_tokens": 28}))
    )
    await _wait_inflight(engine, "w")
    r = await client.post("/update_weight_version", json={"new_version": "v1"})
    assert r.status == 200
    assert await r.json() == {"success": True, "message": "Weight version updated to v1", "new_version": "v1"}
    assert (await (await task).json())["meta_info"]["finish_reason"]["type"] == "abort"
    # abort_all_requests=false keeps it running
    task = asyncio.ensure_future(
        client.post("/generate", json=gen_body(rid="w2", sampling_params={"max_new_tokens": 10}))
    )
    await _wait_inflight(engine, "w2")
    r = await client.post("/update_weight_version", json={"new_version": "v2", "abort_all_requests": False})
    out = await (await task).json()
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["meta_info"]["weight_version"] == "v2"
    assert (await (await client.get("/model_info")).json())["weight_version"] == "v2"
    r = await client.post("/update_weight_version", json={})
    assert r.status == 400 and (await r.json())["success"] is False


async def test_update_weights_from_disk(engine: FakeEngine, client: TestClient) -> None:
    r = await client.post(
        "/update_weights_from_disk",
        json={"model_path": "/ckpt/2", "load_format": "safetensors", "weight_version": "s2"},
    )
    assert r.status == 200
    body = await r.json()
    assert body["success"] is True and body["num_paused_requests"] == 0 and isinstance(body["message"], str)
    assert engine.calls[-1] == ("disk", "/ckpt/2", "safetensors", "s2", True)
    info = await (await client.get("/model_info")).json()
    assert info["model_path"] == "/ckpt/2" and info["weight_version"] == "s2"
    r = await client.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
    body = await r.json()
    assert r.status == 400 and body["success"] is False and "no checkpoint" in body["message"]
    assert (await client.post("/update_weights_from_disk", json={})).status == 400


async def test_update_weights_from_tensor_roundtrip(engine: FakeEngine) -> None:
    torch = pytest.importorskip("torch")
    named = [
        ("layer.weight", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("b", torch.ones(2, dtype=torch.bfloat16)),
    ]
    payload = serialize_named_tensors(named)
    back = deserialize_named_tensors(payload)
    assert [n for n, _ in back] == ["layer.weight", "b"] and torch.equal(back[0][1], named[0][1])

    c = await _client(engine, with_begin_end=True)
    try:
        body = {"serialized_named_tensors": [payload], "flush_cache": True, "weight_version": "t1"}
        r = await c.post("/update_weights_from_tensor", json=body)
        out = await r.json()
        assert r.status == 400 and out["success"] is False and "begin_weight_update" in out["message"]
        assert (await c.post("/begin_weight_update", json={"selector": "all"})).status == 200
        r = await c.post("/update_weights_from_tensor", json=body)
        assert r.status == 200 and (await r.json())["success"] is True
        assert (await (await c.post("/end_weight_update", json={})).json())["success"] is True
        call = [x for x in engine.calls if x[0] == "tensors"][-1]
        assert call[2:] == ("t1", True) and torch.equal(call[1][0][1], named[0][1])
        assert call[1][1][1].dtype == torch.bfloat16
        # two TP entries, garbage, a forbidden pickle
        r = await c.post("/begin_weight_update", json={})
        for bad in ([payload, payload], ["!!notbase64"]):
            r = await c.post("/update_weights_from_tensor", json={"serialized_named_tensors": bad})
            assert r.status == 400 and (await r.json())["success"] is False
        import base64
        import pickle

        evil = base64.b64encode(pickle.dumps([("x", os.getcwd)])).decode()
        r = await c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
        assert r.status == 400 and "refusing to unpickle" in (await r.json())["message"]
        evil = base64.b64encode(pickle.dumps([("x", torch.load)])).decode()
        r = await c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
        assert r.status == 400 and "refusing to unpickle" in (await r.json())["message"]
    finally:
        await c.close()


async def test_distributed_group_routes(engine: FakeEngine, client: TestClient) -> None:
    init = {
        "master_address": "127.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "g",
        "backend": "gloo",
    }
    r = await client.post("/init_weights_update_group", json=init)
    assert r.status == 200 and (await r.json())["success"] is True
    assert engine.calls[-1] == ("init_group", "127.0.0.1", 29500, 1, 2, "g", "gloo")
    r = await client.post("/init_weights_update_group", json={**init, "backend": "nccl"})
    out = await r.json()
    assert r.status == 400 and out == {"success": False, "message": out["message"]} and "nccl" in out["message"]
    assert (await client.post("/init_weights_update_group", json={"master_address": "x"})).status == 400
    upd = {
        "names": ["w"],
        "dtypes": ["bfloat16"],
        "shapes": [[2, 3]],
        "group_name": "g",
        "weight_version": "d1",
        "flush_cache": False,
    }
    r = await client.post("/update_weights_from_distributed", json=upd)
    assert r.status == 200 and (await r.json())["success"] is True
    assert engine.calls[-1] == ("dist", ["w"], ["bfloat16"], [[2, 3]], "g", "d1", False)
    r = await client.post("/update_weights_from_distributed", json={**upd, "names": ["w", "v"]})
    assert r.status == 400
    r = await client.post("/destroy_weights_update_group", json={"group_name": "g"})
    assert r.status == 200 and engine.calls[-1] == ("destroy_group", "g")


async def test_memory_routes(engine: FakeEngine, client: TestClient) -> None:
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        r = await client.post(path, json={"tags": ["kv_cache"]})
        assert r.status == 200 and await r.read() == b"null"
        r = await client.get(path)
        assert r.status == 200 and await r.json() is None
        r = await client.post(path, json={"tags": ["gpu"]})
        assert r.status == 400 and "memory tag" in (await r.json())["error"]["message"]
    assert ("release", ["kv_cache"]) in engine.calls and ("resume_memory", None) in engine.calls


# -- auth ---------------------------------------------------------------------------------------


async def test_api_key(engine: FakeEngine) -> None:
    c = await _client(engine, api_key="k-data")
    try:
        r = await c.post("/generate", json=gen_body())
        assert r.status == 401 and await r.json() == {"error": "Unauthorized"}
        ok = {"Authorization": "Bearer k-data"}
        assert (await c.post("/generate", json=gen_body(), headers=ok)).status == 200
        assert (await c.get("/model_info")).status == 401
        assert (await c.post("/flush_cache", headers=ok)).status == 200  # no admin key: the API key opens control
        assert (await c.get("/health")).status == 200  # SGLang lets /health* through
    finally:
        await c.close()


async def test_admin_api_key(engine: FakeEngine) -> None:
    c = await _client(engine, api_key="k-data", admin_api_key="k-admin")
    data, admin = {"Authorization": "Bearer k-data"}, {"Authorization": "Bearer k-admin"}
    try:
        assert (await c.post("/pause_generation", json={"mode": "retract"}, headers=data)).status == 401
        assert (await c.post("/pause_generation", json={"mode": "retract"}, headers=admin)).status == 200
        assert (await c.post("/continue_generation", headers=admin)).status == 200
        assert (await c.post("/generate", json=gen_body(), headers=data)).status == 200
        assert (await c.get("/server_info", headers=data)).status == 200
        si = await (await c.get("/server_info", headers=data)).json()
        assert "k-data" not in str(si) and "k-admin" not in str(si)
    finally:
        await c.close()
    c = await _client(FakeEngine(), admin_api_key="k-admin")  # admin key only: data routes open
    try:
        assert (await c.post("/generate", json=gen_body())).status == 200
        assert (await c.post("/abort_request", json={"abort_all": True})).status == 401
    finally:
        await c.close()


# -- the command line, in a real process --------------------------------------------------------


async def test_cli_subprocess(tmp_path: Path) -> None:
    port = free_port()
    here = Path(__file__).parent
    env = {"PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "rollout_backends.adapters.reference.serve", "--model-path", "/m",
            "--port", str(port), "--engine-factory", "fake_engine:factory", "--weight-version", "v7",
            "--admin-api-key", "sekret"]  # fmt: skip
    async with Supervisor(tmp_path, grace=5) as sup:
        await sup.start(
            ProcessSpec(name="ref", argv=argv, env=env, ready=f"http://127.0.0.1:{port}/health", ports=[port])
        )
        await sup.wait_ready(timeout=30)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/generate", json=gen_body()) as r:
                out = await r.json()
                assert out["meta_info"]["weight_version"] == "v7"
            async with s.get(f"http://127.0.0.1:{port}/server_info") as r:
                assert (await r.json())["reference"]["worker_id"] == f"127.0.0.1:{port}"
            async with s.post(f"http://127.0.0.1:{port}/flush_cache") as r:
                assert r.status == 401
        code = await sup.stop("ref")
        assert code == 0  # SIGTERM is a clean shutdown
    assert "sekret" not in (tmp_path / "ref.log").read_text()
