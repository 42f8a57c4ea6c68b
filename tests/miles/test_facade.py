"""The facade fed Miles' exact requests: generation, chat (session server), abort, weight updates.

Requests are sent with httpx, as Miles' ``http_utils`` sends them; answers are checked with Miles'
own parsing (restated in ``miles_shapes``) and with the SGLang adapter's strict parser.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx
import pytest

import rollout_backends as rb
from rollout_backends.integrations.miles import MilesFacade, RunningFacade, start_facade
from rollout_backends.sglang_native import parse_answer as parse_native_generation
from tests.miles.miles_shapes import (
    Sample,
    Status,
    compute_request_payload,
    compute_sampling_params,
    extract_completion,
    make_args,
    oracle_update_sample_from_response,
    worker_base_urls,
)
from tests.miles.scripted import ScriptedBackend


@pytest.fixture
async def scripted_facade(tokenizer: Any) -> AsyncIterator[tuple[ScriptedBackend, RunningFacade]]:
    backend = ScriptedBackend(("w0", "w1"))
    running = await start_facade(MilesFacade(backend, tokenizer=tokenizer, model_path="tiny"), port=0)
    yield backend, running
    await running.stop()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as c:
        yield c


def miles_payload(input_ids: list[int], **arg_overrides: Any) -> dict[str, Any]:
    args = make_args(**arg_overrides)
    sp = {**compute_sampling_params(args), "sampling_seed": 42}
    payload = compute_request_payload(args, input_ids, sp)
    assert payload is not None
    return payload


async def test_generate_answers_what_miles_parses(
    scripted_facade: tuple[ScriptedBackend, RunningFacade], client: httpx.AsyncClient, tokenizer: Any
) -> None:
    backend, facade = scripted_facade
    backend.versions["w0"] = "12"
    backend.script.append(
        rb.Generation(
            request_id="x",
            output_ids=(40, 41, 2),
            logprobs=(-0.5, -1.25, -0.125),
            finish_reason=rb.FinishReason.STOP,
            weight_version="12",
            prompt_tokens=3,
            cached_tokens=2,
            matched_stop=2,
        )
    )
    payload = miles_payload([5, 6, 7], rollout_max_response_len=16)
    resp = await client.post(f"{facade.url}/generate", json=payload, headers={"X-SMG-Routing-Key": "group-9"})
    assert resp.status_code == 200
    body = resp.json()

    # SGLang's exact shapes.
    meta = body["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 40, None], [-1.25, 41, None], [-0.125, 2, None]]
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert (meta["weight_version"], meta["cached_tokens"], meta["prompt_tokens"], meta["completion_tokens"]) == (
        "12",
        2,
        3,
        3,
    )
    assert body["output_ids"] == [40, 41, 2]
    assert body["text"] == tokenizer.decode([40, 41, 2], skip_special_tokens=False)

    # Miles fills its sample from it; the SGLang adapter's strict parser accepts it.
    sample = Sample(prompt="x")
    oracle_update_sample_from_response(make_args(), sample, payload, body)
    assert sample.tokens == [5, 6, 7, 40, 41, 2] and sample.rollout_log_probs == [-0.5, -1.25, -0.125]
    assert sample.status is Status.COMPLETED and sample.weight_versions == ["12"]
    assert sample.prefix_cache_info.cached_tokens == 2 and sample.prefix_cache_info.total_prompt_tokens == 3
    request = rb.GenerateRequest(input_ids=[5, 6, 7])
    gen = parse_native_generation(request, body, 0.0, worker=None)
    assert gen.output_ids == (40, 41, 2) and gen.weight_version == "12"

    # The request reached the backend as Miles sent it.
    (req,) = backend.requests
    assert req.routing_key == "group-9" and list(req.input_ids) == [5, 6, 7]
    assert req.sampling.max_new_tokens == 16 and req.sampling.seed == 42 and req.return_logprobs


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (rb.FinishReason.LENGTH, ({"type": "length", "length": 2}, Status.TRUNCATED)),
        (rb.FinishReason.ABORT, ({"type": "abort"}, Status.ABORTED)),
    ],
)
async def test_finish_reasons(
    reason: rb.FinishReason,
    expected: tuple[dict[str, Any], Status],
    scripted_facade: tuple[ScriptedBackend, RunningFacade],
    client: httpx.AsyncClient,
) -> None:
    backend, facade = scripted_facade
    backend.script.append(
        rb.Generation(
            request_id="x",
            output_ids=(40, 41),
            logprobs=(-0.5, -0.5),
            finish_reason=reason,
            weight_version=None,
            prompt_tokens=1,
        )
    )
    payload = miles_payload([5])
    body = (await client.post(f"{facade.url}/generate", json=payload)).json()
    finish, status = expected
    assert {k: body["meta_info"]["finish_reason"][k] for k in finish} == finish
    assert "weight_version" not in body["meta_info"]  # unknown: absent, never null
    sample = Sample(prompt="x")
    oracle_update_sample_from_response(make_args(), sample, payload, body)
    assert sample.status is status and sample.weight_versions == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"sampling_params": {"max_new_tokens": 4, "stop": ["\n"]}}, "sampling_params.stop"),
        ({"sampling_params": {"max_new_tokens": 4, "seed": 1}}, "sampling_params.seed"),
        ({"return_routed_experts": True}, "return_routed_experts"),
        ({"lora_path": "policy"}, "lora_path"),
        ({"input_ids": [[1, 2], []]}, "input_ids[1]"),  # a batch is served; its empty prompt is not
        ({"top_logprobs_num": 2}, "top_logprobs_num"),
    ],
)
async def test_generate_refuses_what_it_cannot_honour(
    change: dict[str, Any],
    field: str,
    scripted_facade: tuple[ScriptedBackend, RunningFacade],
    client: httpx.AsyncClient,
) -> None:
    backend, facade = scripted_facade
    resp = await client.post(f"{facade.url}/generate", json={**miles_payload([5]), **change})
    assert resp.status_code == 400
    assert field in resp.json()["error"]["message"]
    assert backend.requests == []


async def test_worker_lists_and_abort_reach_every_worker(
    scripted_facade: tuple[ScriptedBackend, RunningFacade], client: httpx.AsyncClient
) -> None:
    """Miles' abort(): GET /workers (or /list_workers), then POST <url>/abort_request {"abort_all": true}."""
    backend, facade = scripted_facade
    smg = (await client.get(f"{facade.url}/workers")).json()
    assert smg["total"] == 2 and smg["stats"]["regular_count"] == 2
    assert all(w["is_healthy"] and w["worker_type"] == "regular" for w in smg["workers"])
    legacy = (await client.get(f"{facade.url}/list_workers")).json()
    urls = worker_base_urls(smg, list_workers=False)
    assert urls == worker_base_urls(legacy, list_workers=True) == [f"{facade.url}/w/w0", f"{facade.url}/w/w1"]

    # In-flight generations on both workers come back aborted, with their partial tokens.
    backend.hold = asyncio.Event()
    pending = [asyncio.ensure_future(client.post(f"{url}/generate", json=miles_payload([5]))) for url in urls]
    while len(backend.requests) < 2:
        await asyncio.sleep(0.01)
    results = await asyncio.gather(*(client.post(f"{url}/abort_request", json={"abort_all": True}) for url in urls))
    assert [r.status_code for r in results] == [200, 200]
    assert [c for c in backend.calls if c[0] == "abort_all"] == [
        ("abort_all", {"workers": ("w0",)}),
        ("abort_all", {"workers": ("w1",)}),
    ]
    bodies = [(await p).json() for p in pending]
    assert [b["meta_info"]["finish_reason"]["type"] for b in bodies] == ["abort", "abort"]
    assert sorted(r.worker or "" for r in backend.requests) == ["w0", "w1"]


async def test_public_url_and_unsafe_worker_ids(tokenizer: Any, client: httpx.AsyncClient) -> None:
    backend = ScriptedBackend(("10.0.0.1:30000", "dynamo/instance 7"))
    running = await start_facade(MilesFacade(backend, public_url="http://router.example:9"), port=0)
    try:
        urls = (await client.get(f"{running.url}/list_workers")).json()["urls"]
        assert urls == ["http://router.example:9/w/10.0.0.1:30000", "http://router.example:9/w/worker-1"]
        r = await client.post(f"{running.url}/w/worker-1/abort_request", json={"abort_all": True})
        assert r.status_code == 200 and backend.calls[-1] == ("abort_all", {"workers": ("dynamo/instance 7",)})
        assert (await client.post(f"{running.url}/w/nope/abort_request", json={})).status_code == 404
    finally:
        await running.stop()


async def test_chat_completions_for_the_session_server(
    scripted_facade: tuple[ScriptedBackend, RunningFacade], client: httpx.AsyncClient, tokenizer: Any
) -> None:
    """The request as Miles' session server rewrites it (prepare_chat_request), checked by extract_completion."""
    backend, facade = scripted_facade
    backend.versions["w0"] = "3"
    backend.script.append(
        rb.Generation(
            request_id="c1",
            output_ids=(40, 41, 2),
            logprobs=(-0.5, -0.25, -0.125),
            finish_reason=rb.FinishReason.STOP,
            weight_version="3",
            prompt_tokens=4,
            matched_stop=2,
        )
    )
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "input_ids": [5, 6, 7, 8],
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": True,
        "return_meta_info": True,
        "no_stop_trim": False,
    }
    resp = await client.post(
        f"{facade.url}/v1/chat/completions", json=request, headers={"X-SMG-Routing-Key": "session-1"}
    )
    assert resp.status_code == 200
    body = resp.json()
    choice, message, ids = extract_completion(body)
    assert ids == [40, 41, 2]
    assert choice["finish_reason"] == "stop" and choice["meta_info"]["weight_version"] == "3"
    assert message["content"] == tokenizer.decode([40, 41], skip_special_tokens=True)  # stop token trimmed
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-0.5, -0.25, -0.125]
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    (req,) = backend.requests
    assert list(req.input_ids) == [5, 6, 7, 8] and req.sampling.seed == 7 and req.routing_key == "session-1"

    # Without input_ids the facade applies the chat template itself.
    del request["input_ids"]
    assert (await client.post(f"{facade.url}/v1/chat/completions", json=request)).status_code == 200
    expected = tokenizer.apply_chat_template(request["messages"], tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert list(backend.requests[-1].input_ids) == list(expected)

    bad = await client.post(f"{facade.url}/v1/chat/completions", json={**request, "stream": True})
    assert bad.status_code == 400 and "stream" in bad.json()["error"]["message"]


#: Chat answers' token entries (SGLang's ChatCompletionTokenLogprob, TopLogprob: no other keys).
_TOKEN_KEYS = {"token", "logprob", "bytes", "top_logprobs"}
_TOP_KEYS = {"token", "logprob", "bytes"}


def _check_top_logprobs(
    content: list[dict[str, Any]],
    output_ids: tuple[int, ...],
    logprobs: tuple[float, ...],
    tops: tuple[tuple[tuple[int, float], ...], ...],
    k: int,
    tokenizer: Any,
) -> None:
    """``content`` is the Generation's: its tokens and logprobs, then per token its ``k`` alternatives
    in the backend's order, each token decoded alone (SGLang's return_text_in_logprobs)."""
    assert len(content) == len(output_ids) == len(tops)
    for entry, tid, lp, top in zip(content, output_ids, logprobs, tops, strict=True):
        assert set(entry) == _TOKEN_KEYS and all(set(t) == _TOP_KEYS for t in entry["top_logprobs"])
        assert (entry["token"], entry["logprob"]) == (tokenizer.decode([tid]), lp)
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert len(top) == len(entry["top_logprobs"]) == k
        assert [(t["token"], t["logprob"]) for t in entry["top_logprobs"]] == [
            (tokenizer.decode([i]), v) for i, v in top
        ]
        assert all(t["bytes"] == list(t["token"].encode("utf-8")) for t in entry["top_logprobs"])
        chosen = [v for i, v in top if i == tid]
        assert chosen in ([], [lp])  # the sampled token's logprob is its top-k entry's


async def test_chat_top_logprobs_are_the_backends(client: httpx.AsyncClient, tokenizer: Any) -> None:
    """OpenAI's logprobs + top_logprobs: k reach the backend as SamplingParams.top_logprobs, and the
    answer lists the Generation's alternatives in its order (SGLang 0.5.x serving_chat's shape)."""
    backend = ScriptedBackend(("w0",), top_logprobs=5)
    running = await start_facade(MilesFacade(backend, tokenizer=tokenizer, model_path="tiny"), port=0)
    # The sampled token is second at position 0, outside the top 3 at position 1, first at position 2.
    tops = (
        ((41, -0.25), (40, -0.5), (7, -2.0)),
        ((3, -0.0625), (4, -0.125), (5, -3.0)),
        ((2, -0.125), (9, -4.0), (8, -5.0)),
    )
    gen = rb.Generation(
        request_id="t1",
        output_ids=(40, 41, 2),
        logprobs=(-0.5, -2.5, -0.125),
        finish_reason=rb.FinishReason.STOP,
        weight_version="default",
        prompt_tokens=4,
        matched_stop=2,
        top_logprobs=tops,
    )
    backend.script.append(gen)
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "input_ids": [5, 6, 7, 8],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 3,
    }
    try:
        resp = await client.post(f"{running.url}/v1/chat/completions", json=request)
    finally:
        await running.stop()
    assert resp.status_code == 200, resp.text
    (req,) = backend.requests
    assert req.sampling.top_logprobs == 3 and req.return_logprobs
    choice = resp.json()["choices"][0]
    _check_top_logprobs(choice["logprobs"]["content"], gen.output_ids, gen.logprobs or (), tops, 3, tokenizer)
    assert choice["meta_info"]["output_top_logprobs"] == [[[lp, i, None] for i, lp in top] for top in tops]


async def test_chat_top_logprobs_on_the_reference_engine(
    model_dir: Any, client: httpx.AsyncClient, tokenizer: Any
) -> None:
    """End to end on the CPU reference engine: the chat answer's alternatives are the engine's for
    the same seeded request (bit-reproducible), k per token, most likely first."""
    backend = await rb.open_backend(f"reference://{model_dir}?workers=1")
    running = await start_facade(MilesFacade(backend, tokenizer=tokenizer, model_path="tiny"), port=0)
    prompt, k = [5, 6, 7, 8], 4
    request = {
        "messages": [{"role": "user", "content": "hi"}],
        "input_ids": prompt,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 11,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": k,
    }
    try:
        resp = await client.post(f"{running.url}/v1/chat/completions", json=request)
        sampling = rb.SamplingParams(max_new_tokens=6, temperature=1.0, seed=11, ignore_eos=True, top_logprobs=k)
        direct = await backend.generate(rb.GenerateRequest(input_ids=prompt, sampling=sampling, return_logprobs=True))
    finally:
        await running.stop()
        await backend.aclose()
    assert resp.status_code == 200, resp.text
    assert direct.top_logprobs is not None and len(direct.output_ids) == 6
    choice = resp.json()["choices"][0]
    ids = tuple(e[1] for e in choice["meta_info"]["output_token_logprobs"])
    assert ids == direct.output_ids
    content = choice["logprobs"]["content"]
    _check_top_logprobs(content, direct.output_ids, direct.logprobs or (), direct.top_logprobs, k, tokenizer)
    for top in direct.top_logprobs:
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


@pytest.mark.parametrize(
    "change",
    [
        {"logprobs": True, "top_logprobs": 3},  # past the backend's Capabilities.top_logprobs (2)
        {"logprobs": True, "top_logprobs": 21},  # past OpenAI's limit (20)
        {"logprobs": True, "top_logprobs": -1},
        {"logprobs": True, "top_logprobs": "2"},
        {"logprobs": True, "top_logprobs": True},
        {"top_logprobs": 2},  # without logprobs: true (OpenAI refuses it; SGLang would drop it)
        {"logprobs": False, "top_logprobs": 1},
    ],
)
async def test_chat_refuses_top_logprobs_it_cannot_honour(
    change: dict[str, Any], client: httpx.AsyncClient, tokenizer: Any
) -> None:
    backend = ScriptedBackend(("w0",), top_logprobs=2)
    running = await start_facade(MilesFacade(backend, tokenizer=tokenizer), port=0)
    body = {"messages": [{"role": "user", "content": "x"}], "input_ids": [5], "max_tokens": 2, **change}
    try:
        resp = await client.post(f"{running.url}/v1/chat/completions", json=body)
        # Nothing asked: no refusal (top_logprobs 0 or null, with or without logprobs).
        fine = [
            await client.post(f"{running.url}/v1/chat/completions", json={**body, "top_logprobs": v, "logprobs": lp})
            for v in (0, None)
            for lp in (False, True)
        ]
    finally:
        await running.stop()
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "top_logprobs"
    assert [r.status_code for r in fine] == [200] * 4
    assert len(backend.requests) == 4 and all(r.sampling.top_logprobs == 0 for r in backend.requests)


def _payload(obj: Any) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's shared-memory reductions)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


async def test_trainer_weight_update_sequence_through_the_facade(
    scripted_facade: tuple[ScriptedBackend, RunningFacade], client: httpx.AsyncClient
) -> None:
    """Miles' distributed updater, per engine URL: pause → flush → begin → buckets → version → end → continue."""
    backend, facade = scripted_facade
    w = f"{facade.url}/w/w1"
    posts: list[tuple[str, dict[str, Any]]] = [
        ("/pause_generation", {"mode": "retract"}),
        ("/begin_weight_update", {"selector": "all"}),
        (
            "/init_weights_update_group",
            {
                "master_address": "10.0.0.9",
                "master_port": 29500,
                "rank_offset": 3,
                "world_size": 5,
                "group_name": "miles-pp_0",
                "backend": "nccl",
            },
        ),
        (
            "/update_weights_from_distributed",
            {
                "names": ["a", "b"],
                "dtypes": ["bfloat16", "float32"],
                "shapes": [[2, 3], [4]],
                "group_name": "miles-pp_0",
                "flush_cache": False,
                "selector": "all",
                "weight_version": "1",
            },
        ),
        ("/update_weight_version", {"new_version": "1", "abort_all_requests": False}),
        ("/end_weight_update", {}),
        ("/continue_generation", {}),
    ]
    flush = await client.get(f"{w}/flush_cache")  # SGLangEngine.flush_cache is a GET
    assert flush.status_code == 200 and flush.text.startswith("Cache flushed.")
    for path, body in posts:
        r = await client.post(f"{w}{path}", json=body)
        assert r.status_code == 200, (path, r.text)
        if path not in ("/pause_generation", "/continue_generation"):
            assert r.json()["success"] is True
    assert backend.names() == [
        "flush_cache",
        "pause",
        "begin",
        "init_weight_group",
        "update_distributed",
        "set_version",
        "end",
        "resume",
    ]
    assert all(kw["workers"] == ("w1",) for _, kw in backend.calls)
    _, init = backend.calls[3]
    assert init["group"] == rb.WeightGroup(
        master_address="10.0.0.9",
        master_port=29500,
        world_size=5,
        rank_offset=3,
        group_name="miles-pp_0",
        backend="nccl",
    )
    _, upd = backend.calls[4]
    assert upd["bucket"].names == ["a", "b"] and upd["bucket"].dtypes == ["bfloat16", "float32"]
    assert upd["bucket"].shapes == [[2, 3], [4]] and upd["version"] == "1" and upd["flush_cache"] is False
    assert backend.calls[1][1]["mode"] is rb.PauseMode.RETRACT
    info = (await client.get(f"{w}/model_info")).json()
    assert info["weight_version"] == "1"
    assert (await client.get(f"{facade.url}/w/w0/model_info")).json()["weight_version"] == "default"


async def test_tensor_disk_memory_and_failures(
    scripted_facade: tuple[ScriptedBackend, RunningFacade], client: httpx.AsyncClient
) -> None:
    import torch

    backend, facade = scripted_facade
    w = f"{facade.url}/w/w0"
    named = [("x", torch.arange(6, dtype=torch.float32).reshape(2, 3))]
    r = await client.post(
        f"{w}/update_weights_from_tensor",
        json={
            "serialized_named_tensors": [_payload(named)] * 2,
            "load_format": None,
            "flush_cache": False,
            "selector": "all",
            "weight_version": "2",
        },
    )
    assert r.status_code == 200 and r.json()["success"] is True
    _, kw = backend.calls[-1]
    assert kw["version"] == "2" and kw["workers"] == ("w0",) and torch.equal(kw["named"][0][1], named[0][1])

    r = await client.post(f"{w}/update_weights_from_disk", json={"model_path": "/ckpt/3", "weight_version": "3"})
    assert r.status_code == 200 and r.json()["success"] is True and backend.versions["w0"] == "3"
    assert backend.calls[-1] == (
        "update_disk",
        {"path": "/ckpt/3", "version": "3", "load_format": None, "flush_cache": True, "workers": ("w0",)},
    )
    r = await client.post(f"{w}/update_weights_from_disk", json={"model_path": "/missing"})
    assert r.status_code == 400 and r.json()["success"] is False and "no such dir" in r.json()["message"]

    r = await client.post(f"{w}/release_memory_occupation", json={"tags": ["weights"]})
    assert r.status_code == 200 and r.json() is None
    r = await client.post(f"{w}/resume_memory_occupation", json={"tags": ["weights"]})
    assert r.status_code == 200
    assert [n for n, _ in backend.calls[-2:]] == ["release_memory", "resume_memory"]

    # SGLang's default for update_weight_version aborts every request; Miles sends False.
    await client.post(f"{w}/update_weight_version", json={"new_version": "4"})
    assert [n for n, _ in backend.calls[-2:]] == ["abort_all", "set_version"]
    r = await client.post(f"{w}/weights_checker", json={"action": "checksum"})
    assert r.status_code == 400 and r.json()["success"] is False
    r = await client.post(f"{w}/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and r.json()["success"] is False
    # Fleet-wide at the root.
    await client.post(f"{facade.url}/pause_generation", json={"mode": "in_place"})
    assert backend.calls[-1] == ("pause", {"mode": rb.PauseMode.IN_PLACE, "workers": ("w0", "w1")})
    assert (await client.get(f"{w}/health_generate")).status_code == 200
    assert (await client.get(f"{facade.url}/health")).status_code == 200


async def test_weight_update_on_the_reference_engine(
    tokenizer: Any, model_dir: Any, tmp_path: Any, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The full trainer sequence through the facade on a real CPU engine, with a request in flight:
    retract-paused, it finishes after continue, under the new version, and is never aborted."""
    import torch
    from safetensors.torch import load_file

    from rollout_backends.adapters.reference import ReferenceBackend, make_tiny_model

    _install_fake_sglang_bucket_module(monkeypatch)
    backend = ReferenceBackend.create(model_dir, workers=2)
    facade = await start_facade(MilesFacade(backend, tokenizer=tokenizer), port=0)
    try:
        urls = worker_base_urls((await client.get(f"{facade.url}/workers")).json(), list_workers=False)
        payload = miles_payload([5, 6, 7], rollout_max_response_len=400)
        payload["sampling_params"]["ignore_eos"] = True
        in_flight = asyncio.ensure_future(client.post(f"{urls[0]}/generate", json=payload))
        while backend.engines[0].num_running == 0:
            await asyncio.sleep(0.01)
        other = make_tiny_model(tmp_path / "m2", seed=1)
        new = load_file(str(other / "model.safetensors"))
        names = sorted(new)
        half = len(names) // 2
        for url in urls:
            assert (await client.post(f"{url}/pause_generation", json={"mode": "retract"})).status_code == 200
            assert (await client.get(f"{url}/flush_cache")).status_code == 200
            assert (await client.post(f"{url}/begin_weight_update", json={"selector": "all"})).json()["success"]
        for url in urls:
            # Bucket 1: a plain list; bucket 2: Miles' colocated flattened bucket (one dtype per bucket).
            r = await client.post(
                f"{url}/update_weights_from_tensor",
                json={
                    "serialized_named_tensors": [_payload([(n, new[n]) for n in names[:half]])],
                    "load_format": None,
                    "flush_cache": False,
                    "weight_version": "1",
                },
            )
            assert r.json()["success"], r.text
            rest = [(n, new[n]) for n in names[half:]]
            flat = torch.cat([t.reshape(-1) for _, t in rest])
            meta, start = [], 0
            for n, t in rest:
                meta.append(_FakeMeta(n, t.shape, t.dtype, start, start + t.numel(), t.numel()))
                start += t.numel()
            r = await client.post(
                f"{url}/update_weights_from_tensor",
                json={
                    "serialized_named_tensors": [_payload({"flattened_tensor": flat, "metadata": meta})],
                    "load_format": "flattened_bucket",
                    "flush_cache": False,
                    "weight_version": "1",
                },
            )
            assert r.json()["success"], r.text
        for url in urls:
            r = await client.post(
                f"{url}/update_weight_version", json={"new_version": "1", "abort_all_requests": False}
            )
            assert r.json()["new_version"] == "1"
            assert (await client.post(f"{url}/end_weight_update", json={})).json()["success"]
            assert (await client.post(f"{url}/continue_generation", json={})).status_code == 200
        assert not in_flight.done()  # retracted, waiting for continue
        body = (await in_flight).json()
        assert body["meta_info"]["finish_reason"]["type"] == "length"  # not aborted
        assert len(body["output_ids"]) == 400
        # It spanned the update: Stitch's stamps (the version it was admitted under first, what
        # Miles records), the end, and the engine's per-token spans (SGLang 0.5.23's shape).
        meta = body["meta_info"]
        assert (meta["weight_version"], meta["weight_version_start"], meta["weight_version_end"]) == (
            "default",
            "default",
            1,
        )
        spans = meta["weight_versions"]
        assert spans[0]["start"] == 0 and spans[-1] == {"version": "1", "start": spans[-1]["start"], "end": 400}
        assert all(a["end"] == b["start"] for a, b in itertools.pairwise(spans))
        assert {s["version"] for s in spans} <= {"default", "1"}
        for url in urls:
            assert (await client.get(f"{url}/model_info")).json()["weight_version"] == "1"
        # The new weights are served: greedy output equals a fresh engine on the new checkpoint.
        greedy = {
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
            "return_logprob": True,
        }
        got = [(await client.post(f"{url}/generate", json=greedy)).json()["output_ids"] for url in urls]
        fresh = ReferenceBackend.create(other, workers=1)
        try:
            ref = await fresh.generate(
                rb.GenerateRequest(input_ids=[5, 6, 7], sampling=rb.SamplingParams(max_new_tokens=8, temperature=0.0))
            )
        finally:
            await fresh.aclose()
        assert got == [list(ref.output_ids)] * 2
    finally:
        await facade.stop()
        await backend.aclose()


class _FakeMeta:
    """Pickles as ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` (a dataclass)."""

    def __init__(self, name: str, shape: Any, dtype: Any, start_idx: int, end_idx: int, numel: int) -> None:
        self.name, self.shape, self.dtype = name, shape, dtype
        self.start_idx, self.end_idx, self.numel = start_idx, end_idx, numel


_FakeMeta.__module__ = "sglang.srt.weight_sync.tensor_bucket"
_FakeMeta.__qualname__ = _FakeMeta.__name__ = "FlattenedTensorMetadata"


def _install_fake_sglang_bucket_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """So that pickle finds ``_FakeMeta`` where SGLang's class lives (sglang is not installed)."""
    import sys
    import types

    parts = ["sglang", "srt", "weight_sync", "tensor_bucket"]
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setattr(
        sys.modules["sglang.srt.weight_sync.tensor_bucket"], "FlattenedTensorMetadata", _FakeMeta, raising=False
    )


async def test_per_worker_ports_serve_sglang_engines_http_surface(client: httpx.AsyncClient) -> None:
    """What SGLangEngine calls on an external engine (``--rollout-external``), at a worker port's root."""
    backend = ScriptedBackend(("w0", "w1"))
    running = await start_facade(
        MilesFacade(backend, server_info={"tp_size": 2}), port=0, worker_ports={"w0": 0, "w1": 0}
    )
    try:
        w1 = running.worker_urls["w1"]
        assert (await client.get(f"{w1}/health_generate")).status_code == 200
        assert (await client.get(f"{w1}/flush_cache")).status_code == 200
        info = (await client.get(f"{w1}/get_server_info")).json()
        assert info["tp_size"] == 2 and info["rollout_backends"]["workers"] == ["w1"]
        r = await client.post(f"{w1}/update_weight_version", json={"new_version": "5", "abort_all_requests": False})
        assert r.json() == {"success": True, "message": "Weight version updated to 5", "new_version": "5"}
        assert (await client.get(f"{w1}/model_info")).json()["weight_version"] == "5"
        assert backend.versions == {"w0": "default", "w1": "5"}
        body = (await client.post(f"{w1}/generate", json=miles_payload([5]))).json()
        assert body["meta_info"]["weight_version"] == "5" and backend.requests[-1].worker == "w1"
    finally:
        await running.stop()


async def test_the_router_answers_one_served_version_while_workers_disagree(client: httpx.AsyncClient) -> None:
    """The router's /model_info answers from one worker in SGLang: a version some worker serves."""
    backend = ScriptedBackend(("w0", "w1", "w2"))
    running = await start_facade(MilesFacade(backend), port=0)

    async def router_version() -> Any:
        return (await client.get(f"{running.url}/model_info")).json()["weight_version"]

    try:
        await backend.set_weight_version("5")
        await backend.set_weight_version("6", workers=["w1", "w2"])
        assert await router_version() == "5"  # the expected version, though most workers serve 6
        backend.expect_version("9")  # served by none: the version most workers serve
        assert await router_version() == "6"
        await backend.set_weight_version("7", workers=["w2"])
        assert await router_version() == "5"  # a three-way tie: the first worker's
    finally:
        await running.stop()


async def test_generate_prompt_logprobs_and_prefill_only_on_the_reference_engine(
    model_dir: Any, client: httpx.AsyncClient, tokenizer: Any
) -> None:
    """Miles' --recompute-logprobs-via-prefill: ``max_new_tokens: 0`` with ``logprob_start_len``
    answers the prompt's logprobs from that index (SGLang's ``input_token_logprobs``), the engine's
    own; with new tokens too. (The facade answered HTTP 500 here: no input ids for the answer.)"""
    backend = await rb.open_backend(f"reference://{model_dir}?workers=1")
    running = await start_facade(MilesFacade(backend, tokenizer=tokenizer, model_path="tiny"), port=0)
    prompt = [5, 6, 7, 8, 9, 10]
    try:
        for new, start in ((0, 1), (4, 0), (0, 3)):
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
                "return_logprob": True,
                "logprob_start_len": start,
            }
            resp = await client.post(f"{running.url}/generate", json=body)
            assert resp.status_code == 200, resp.text
            sampling = rb.SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
            direct = await backend.generate(
                rb.GenerateRequest(
                    input_ids=prompt, sampling=sampling, return_logprobs=True, prompt_logprobs_start=start
                )
            )
            assert direct.prompt_logprobs is not None and len(direct.prompt_logprobs) == len(prompt) - start
            entries = resp.json()["meta_info"]["input_token_logprobs"]
            assert [e[1] for e in entries] == prompt[start:]
            assert [e[0] for e in entries] == list(direct.prompt_logprobs)
            assert resp.json()["output_ids"] == list(direct.output_ids) and len(direct.output_ids) == new
    finally:
        await running.stop()
        await backend.aclose()


async def test_generate_stop_strings_on_the_reference_engine(
    model_dir: Any, client: httpx.AsyncClient, tokenizer: Any
) -> None:
    """``--rollout-stop`` strings reach a backend that matches them: the answer stops at the string
    (SGLang's ``finish_reason`` ``{"type": "stop", "matched": s}``), its ids and text the engine's,
    the text trimmed unless ``no_stop_trim``."""
    backend = await rb.open_backend(f"reference://{model_dir}?workers=1")
    running = await start_facade(MilesFacade(backend, tokenizer=tokenizer, model_path="tiny"), port=0)
    prompt = [5, 6, 7, 8]
    greedy = rb.SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    try:
        full = await backend.generate(rb.GenerateRequest(input_ids=prompt, sampling=greedy))
        ids = list(full.output_ids)
        # A stop string first completed by a token past the 3rd: the answer must end early.
        stop = next(
            s
            for i in range(3, 12)
            if (s := tokenizer.decode(ids[i : i + 1]).strip()) and s not in tokenizer.decode(ids[:i])
        )
        for keep in (False, True):
            sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop], "no_stop_trim": keep}
            resp = await client.post(f"{running.url}/generate", json={"input_ids": prompt, "sampling_params": sp})
            assert resp.status_code == 200, resp.text
            direct = await backend.generate(
                rb.GenerateRequest(input_ids=prompt, sampling=attrs.evolve(greedy, stop=(stop,), no_stop_trim=keep))
            )
            body = resp.json()
            assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
            assert body["output_ids"] == list(direct.output_ids) and len(direct.output_ids) < 16
            assert body["text"] == direct.text
            assert body["text"].endswith(stop) is keep
    finally:
        await running.stop()
        await backend.aclose()
