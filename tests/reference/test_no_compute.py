"""``serve-reference --no-compute N``: the real reference server over ``NoComputeEngine`` (no model)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from rollout_backends import GenerateRequest, SamplingParams
from rollout_backends._errors import InvalidRequest
from rollout_backends._launch import NodeContext
from rollout_backends.adapters.reference import NoComputeEngine, ReferenceServerCommand
from rollout_backends.adapters.reference._server import build_app
from rollout_backends.adapters.reference.serve import load_engine, parse_args


@pytest.fixture
async def client() -> AsyncIterator[TestClient]:
    c = TestClient(TestServer(build_app(NoComputeEngine(8), model_path="no-compute", health_generation=True)))
    await c.start_server()
    yield c
    await c.close()


def _body(max_new_tokens: int = 16, **kw: Any) -> dict[str, Any]:
    return {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": max_new_tokens, **kw}, "return_logprob": True}


async def test_generate_answers_the_fixed_tokens_with_logprobs(client: TestClient) -> None:
    bodies = []
    for _ in range(2):
        resp = await client.post("/generate", json=_body())
        assert resp.status == 200
        bodies.append(await resp.json())
    a, b = bodies
    assert a["output_ids"] == b["output_ids"] == [1000 + 7 * i for i in range(8)]  # N=8 caps the 16 asked
    meta = a["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 8
    assert [e[0] for e in meta["output_token_logprobs"]] == [-(i + 1) / 100 for i in range(8)]
    assert [e[1] for e in meta["output_token_logprobs"]] == a["output_ids"]
    short = await (await client.post("/generate", json=_body(3))).json()
    assert short["output_ids"] == a["output_ids"][:3]
    plain = await (await client.post("/generate", json={**_body(), "return_logprob": False})).json()
    assert "output_token_logprobs" not in plain["meta_info"]
    # The server's own validation still runs in front of the engine.
    bad = await client.post("/generate", json={**_body(), "input_ids": [10**9]})
    assert bad.status == 400


async def test_stop_tokens_and_health(client: TestClient) -> None:
    data = await (await client.post("/generate", json=_body(stop_token_ids=[1014]))).json()
    assert data["output_ids"] == [1000, 1007, 1014]
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": 1014}
    ignored = await (await client.post("/generate", json=_body(stop_token_ids=[1014], ignore_eos=True))).json()
    assert len(ignored["output_ids"]) == 8
    assert (await client.get("/health")).status == 200  # the generating health probe


async def test_control_without_weights(client: TestClient) -> None:
    resp = await client.post("/update_weights_from_disk", json={"model_path": "/x"})
    assert resp.status == 400 and "no weights" in (await resp.json())["message"]
    resp = await client.post("/update_weight_version", json={"new_version": "v2"})
    assert resp.status == 200
    data = await (await client.post("/generate", json=_body(1))).json()
    assert data["meta_info"]["weight_version"] == "v2"
    assert (await client.post("/pause_generation", json={"mode": "in_place"})).status == 200
    pending = asyncio.ensure_future(client.post("/generate", json=_body(1)))
    await asyncio.sleep(0.05)
    assert not pending.done()  # SGLang's pause gate: held until resume
    assert (await client.post("/continue_generation", json={})).status == 200
    assert (await asyncio.wait_for(pending, 5)).status == 200


async def test_our_sglang_adapter_over_it(client: TestClient) -> None:
    from rollout_backends.adapters.sglang import connect

    backend = await connect(str(client.make_url("")).rstrip("/"))
    try:
        gen = await backend.generate(
            GenerateRequest(input_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=8, temperature=1.0))
        )
    finally:
        await backend.aclose()
    assert gen.output_ids == tuple(1000 + 7 * i for i in range(8))
    assert gen.logprobs == tuple(-(i + 1) / 100 for i in range(8))


def test_engine_validates_its_arguments() -> None:
    with pytest.raises(InvalidRequest, match="output_tokens"):
        NoComputeEngine(0)
    with pytest.raises(InvalidRequest, match="vocab_size"):
        NoComputeEngine(8, vocab_size=0)


def test_command_line() -> None:
    args = parse_args(["--no-compute", "4", "--port", "1234"])
    assert args.model_path == "no-compute"
    engine = load_engine(args)
    assert isinstance(engine, NoComputeEngine) and engine.output_tokens == 4
    assert engine.worker_id == "127.0.0.1:1234"
    for bad in ([], ["--no-compute", "0"], ["--no-compute", "4", "--engine-factory", "m:f"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    launch = ReferenceServerCommand(model_path="no-compute", no_compute=8).build(
        NodeContext.on(0, "127.0.0.1", "/tmp", fixed={"http": 30999})
    )
    argv = list(launch.spec.argv)
    assert argv[argv.index("--no-compute") + 1] == "8"
