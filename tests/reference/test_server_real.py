"""The reference server over a real ``ReferenceEngine``, in its own process (started by the Supervisor)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rollout_backends._supervisor import ProcessSpec, Supervisor, free_port
from rollout_backends.adapters.reference._server import serialize_named_tensors

pytestmark = pytest.mark.slow

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
async def server(model_dir: Path, tmp_path: Path) -> AsyncIterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "rollout_backends.adapters.reference.serve", "--model-path", str(model_dir),
            "--port", str(port), "--weight-version", "v0", "--worker-id", "ref-a"]  # fmt: skip
    async with Supervisor(tmp_path / "logs", grace=5) as sup:
        await sup.start(ProcessSpec(name="ref", argv=argv, ready=f"http://127.0.0.1:{port}/health", ports=[port],
                                    env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}))  # fmt: skip
        await sup.wait_ready(timeout=120)
        yield f"http://127.0.0.1:{port}"


async def _post(s: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


async def test_real_engine_generate_and_updates(server: str, model_dir: Path, model_dir_b: Path) -> None:
    from safetensors.torch import load_file

    prompt = {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY, "return_logprob": True}
    async with aiohttp.ClientSession() as s:
        st, a = await _post(s, f"{server}/generate", prompt)
        assert st == 200, a
        assert len(a["output_ids"]) == 6 and a["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        assert [e[1] for e in a["meta_info"]["output_token_logprobs"]] == a["output_ids"]
        assert all(
            isinstance(e[0], float) and e[0] <= 0 and e[2] is None for e in a["meta_info"]["output_token_logprobs"]
        )
        st, again = await _post(s, f"{server}/generate", prompt)
        assert again["output_ids"] == a["output_ids"]  # greedy is deterministic
        assert again["meta_info"]["cached_tokens"] >= 0

        st, err = await _post(s, f"{server}/generate", {**prompt, "input_ids": [10**6]})
        assert st == 400 and "vocabulary" in err["error"]["message"]

        # disk: model B, then back to A through the tensor route (a ForkingPickler payload)
        st, body = await _post(s, f"{server}/update_weights_from_disk",
                               {"model_path": str(model_dir_b), "weight_version": "b1"})  # fmt: skip
        assert st == 200 and body["success"], body
        st, b = await _post(s, f"{server}/generate", prompt)
        assert b["meta_info"]["weight_version"] == "b1" and b["output_ids"] != a["output_ids"]

        named = list(load_file(str(model_dir / "model.safetensors")).items())
        payload = serialize_named_tensors(named)
        st, body = await _post(s, f"{server}/update_weights_from_tensor",
                               {"serialized_named_tensors": [payload], "weight_version": "a2"})  # fmt: skip
        assert st == 200 and body["success"], body
        st, a2 = await _post(s, f"{server}/generate", prompt)
        assert a2["output_ids"] == a["output_ids"] and a2["meta_info"]["weight_version"] == "a2"
        for x, y in zip(a2["meta_info"]["output_token_logprobs"], a["meta_info"]["output_token_logprobs"], strict=True):
            assert x[0] == pytest.approx(y[0], abs=1e-5)

        st, body = await _post(s, f"{server}/update_weights_from_disk", {"model_path": "/nonexistent"})
        assert st == 400 and body["success"] is False
        async with s.get(f"{server}/model_info") as r:
            info = await r.json()
            assert info["weight_version"] == "a2" and info["model_path"] == str(model_dir_b)
        async with s.get(f"{server}/health_generate") as r:
            assert r.status == 200


async def test_rescoring_answers_input_token_logprobs(server: str) -> None:
    """Miles' --recompute-logprobs-via-prefill body: max_new_tokens 0, logprob_start_len = prompt_len - 1."""
    async with aiohttp.ClientSession() as s:
        greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        _, first = await _post(s, f"{server}/generate", {"input_ids": [1, 2, 3], "sampling_params": greedy,
                                                          "return_logprob": True})  # fmt: skip
        seq = [1, 2, 3, *first["output_ids"]]
        zero = {"max_new_tokens": 0}
        body = {"input_ids": seq, "sampling_params": zero, "return_logprob": True, "logprob_start_len": 2}
        status, out = await _post(s, f"{server}/generate", body)
    assert status == 200 and out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == seq[2:] and entries[0][0] is None
    for (lp, tid, _), (want, wid, _) in zip(entries[1:], first["meta_info"]["output_token_logprobs"], strict=True):
        assert tid == wid and abs(lp - want) < 1e-4
