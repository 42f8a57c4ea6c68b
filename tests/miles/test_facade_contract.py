"""The facade as Miles' external rollout service (issue 27 items 5 and 6): Stitch's version contract
on ``/generate`` and chat, and batched ``/generate`` as SGLang 0.5.16 serves it.

The contract: ``docs/advanced/disaggregated-rollout.md`` in radixark/miles at 31f1ca961a94 and its
reference implementation, modal-projects/stitch at a250dc3 (``VersionConstraint``, the 409 of
``AdmissionGate._rejection``, ``SGLangEngine.stamp_response``). The batch: Miles'
``prefill_logprobs._build_batch_prefill_scoring_payload`` (same Miles commit) and SGLang 0.5.16's
``GenerateReqInput`` batch normalisation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx
import pytest

import rollout_backends as rb
from rollout_backends.adapters.reference import ReferenceBackend
from rollout_backends.integrations.miles import MilesFacade, RunningFacade, start_facade
from rollout_backends.integrations.miles._versioning import stamp_meta, stamp_top_level, wire_version
from tests.miles.miles_shapes import compute_sampling_params, make_args
from tests.miles.scripted import ScriptedBackend

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as c:
        yield c


@pytest.fixture
async def reference(model_dir: Any, tokenizer: Any) -> AsyncIterator[tuple[ReferenceBackend, RunningFacade]]:
    backend = ReferenceBackend.create(model_dir, workers=2)
    running = await start_facade(MilesFacade(backend, tokenizer=tokenizer, model_path="tiny"), port=0)
    try:
        yield backend, running
    finally:
        await running.stop()
        await backend.aclose()


def _tokens(backend: ReferenceBackend) -> list[int]:
    return [e.health().tokens_generated for e in backend.engines]


async def test_a_version_constraint_routes_to_satisfying_workers_or_is_a_409(
    reference: tuple[ReferenceBackend, RunningFacade], client: httpx.AsyncClient
) -> None:
    backend, facade = reference
    r = await client.post(
        f"{facade.url}/w/ref-1/update_weight_version", json={"new_version": "2", "abort_all_requests": False}
    )
    assert r.json()["success"], r.text
    gen = {"input_ids": [5, 6, 7], "sampling_params": GREEDY, "return_logprob": True}
    for _ in range(4):  # min 2: only ref-1 serves it (round robin would alternate)
        r = await client.post(f"{facade.url}/generate", json={**gen, "weight_version": {"min_version": 2}})
        meta = r.json()["meta_info"]
        assert (meta["weight_version"], meta["weight_version_start"], meta["weight_version_end"]) == ("2", 2, 2)
        r = await client.post(f"{facade.url}/generate", json={**gen, "weight_version": {"exact_version": "default"}})
        assert r.json()["meta_info"]["weight_version"] == "default"
    # Stitch's "none" mode sends both null: no constraint
    r = await client.post(f"{facade.url}/generate", json={**gen, "weight_version": {"min_version": None}})
    assert r.status_code == 200
    before = _tokens(backend)
    for url, want in ((facade.url, {"min_version": 3}), (f"{facade.url}/w/ref-0", {"min_version": 2})):
        r = await client.post(f"{url}/generate", json={**gen, "weight_version": want})
        assert r.status_code == 409, r.text
        body = r.json()
        assert body["type"] == "WeightVersionNotReady" and body["target_version"] == want["min_version"]
        assert body["applied"] == 2 and body["served"] == {"ref-0": "default", "ref-1": 2}
        assert "min_version='" in body["message"]
    assert _tokens(backend) == before  # nothing was sent
    # chat: the same constraint, Stitch's top-level stamps, the choice's meta_info as on /generate
    chat = {"input_ids": [5, 6, 7], "max_tokens": 3, "temperature": 0, "logprobs": True, "return_meta_info": True}
    r = await client.post(f"{facade.url}/v1/chat/completions", json={**chat, "weight_version": {"min_version": 2}})
    out = r.json()
    spans = [{"version": "2", "start": 0, "end": 3}]  # the engine records each token's version
    assert (out["weight_version_start"], out["weight_version_end"]) == (2, 2)
    assert out["metadata"] == {"weight_version": "2", "weight_versions": spans}
    assert out["choices"][0]["meta_info"]["weight_version"] == "2"
    r = await client.post(f"{facade.url}/v1/chat/completions", json={**chat, "weight_version": {"exact_version": 9}})
    assert r.status_code == 409 and r.json()["target_version"] == 9


@pytest.mark.parametrize(
    ("value", "field"),
    [
        (3, "weight_version"),
        ("2", "weight_version"),
        ({"min_version": -1}, "weight_version.min_version"),
        ({"exact_version": True}, "weight_version.exact_version"),
        ({"exact_version": ""}, "weight_version.exact_version"),
        ({"min": 1}, "weight_version.min"),
    ],
)
async def test_a_malformed_constraint_is_a_400_naming_it(
    value: Any, field: str, reference: tuple[ReferenceBackend, RunningFacade], client: httpx.AsyncClient
) -> None:
    _, facade = reference
    for route, body in (
        ("/generate", {"input_ids": [5, 6], "sampling_params": GREEDY}),
        ("/v1/chat/completions", {"input_ids": [5, 6], "max_tokens": 2}),
    ):
        r = await client.post(f"{facade.url}{route}", json={**body, "weight_version": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


async def test_a_request_spanning_an_update_reports_both_versions_and_the_spans(
    tokenizer: Any, client: httpx.AsyncClient
) -> None:
    """What the backend knows of the split reaches the caller: Stitch's start/end stamps, SGLang
    0.5.23's per-token spans, and as the served version the one the request was admitted under
    (which Miles' ``Sample.update_from_meta_info`` and the session server's record append)."""
    backend = ScriptedBackend(("w0", "w1"))
    running = await start_facade(MilesFacade(backend, tokenizer=tokenizer), port=0)
    spanning = rb.Generation(
        request_id="x",
        output_ids=(40, 41, 42, 2),
        logprobs=(-0.5, -0.25, -1.0, -0.125),
        finish_reason=rb.FinishReason.STOP,
        weight_version="4",
        version_at_start="3",
        version_spans=((0, "3"), (2, "4")),
        prompt_tokens=3,
        matched_stop=2,
    )
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 4}]
    try:
        backend.script.append(spanning)
        meta = (await client.post(f"{running.url}/generate", json={"input_ids": [5, 6, 7]})).json()["meta_info"]
        assert (meta["weight_version"], meta["weight_version_start"], meta["weight_version_end"]) == ("3", 3, 4)
        assert meta["weight_versions"] == spans
        backend.script.append(spanning)
        chat = {"input_ids": [5, 6, 7], "logprobs": True, "max_tokens": 8}
        out = (await client.post(f"{running.url}/v1/chat/completions", json=chat)).json()
        assert (out["weight_version_start"], out["weight_version_end"]) == (3, 4)
        assert out["metadata"] == {"weight_version": "3", "weight_versions": spans}
        assert out["choices"][0]["meta_info"]["weight_versions"] == spans
    finally:
        await running.stop()


def test_an_unknown_start_is_never_guessed() -> None:
    """Where the fleet could not tell the start (an update overlapped, the worker unknown), only the end
    is stamped; with nothing known, nothing (a null would read as a version to Miles)."""
    gen = rb.Generation(
        request_id="x", output_ids=(1,), logprobs=None, finish_reason=rb.FinishReason.LENGTH,
        weight_version="4", prompt_tokens=1,
    )  # fmt: skip
    meta: dict[str, Any] = {}
    stamp_meta(meta, gen)
    assert meta == {"weight_version": "4", "weight_version_end": 4}
    out: dict[str, Any] = {}
    stamp_top_level(out, gen)
    assert out == {"weight_version_end": 4, "metadata": {"weight_version": "4"}}
    meta, out = {}, {}
    stamp_meta(meta, attrs.evolve(gen, weight_version=None))
    stamp_top_level(out, attrs.evolve(gen, weight_version=None))
    assert meta == out == {}
    digit_one = "\u0661"  # an Arabic-Indic digit: str.isdigit, but not a version number
    labels = ("0", "12", "012", "v3", "default", "-1", digit_one)
    assert [wire_version(v) for v in labels] == [0, 12, "012", "v3", "default", "-1", digit_one]


# -- batches ------------------------------------------------------------------------------------


def _miles_batch_payload(samples: list[tuple[list[int], int]]) -> dict[str, Any]:
    """Miles' ``_build_batch_prefill_scoring_payload`` for samples ``(tokens, response_length)`` that
    share a prompt length (Miles groups them so): ``input_ids`` a list per sample, one shared
    ``sampling_params`` (its rollout parameters with ``max_new_tokens: 0``, ``temperature: 0``,
    ``skip_special_tokens: False``), ``return_logprob``, ``logprob_start_len`` one before the response."""
    prompt_len = len(samples[0][0]) - samples[0][1]
    sp = {**compute_sampling_params(make_args()), "max_new_tokens": 0, "temperature": 0, "skip_special_tokens": False}
    return {
        "input_ids": [tokens for tokens, _ in samples],
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": prompt_len - 1,
    }


async def test_miles_batched_prefill_rescoring_is_served_as_a_list_in_order(
    reference: tuple[ReferenceBackend, RunningFacade], client: httpx.AsyncClient
) -> None:
    """Miles' default policy batches its prefill re-scoring (``_can_batch_prefill_score``) and reads
    a list of answers, one per sample in order, each with the response tokens' logprobs (its
    ``_extract_response_logprobs``). The facade refused it (400) where SGLang serves it."""
    backend, facade = reference
    samples = [([5, 6, 7, 40, 41], 2), ([8, 9, 10, 50, 51], 2), ([11, 12, 13, 60, 61], 2)]
    r = await client.post(f"{facade.url}/generate", json=_miles_batch_payload(samples))
    assert r.status_code == 200, r.text
    outputs = r.json()
    assert isinstance(outputs, list) and len(outputs) == len(samples)
    for (tokens, response_length), out in zip(samples, outputs, strict=True):
        items = out["meta_info"]["input_token_logprobs"][-response_length:]
        assert [i[1] for i in items] == tokens[-response_length:]
        direct = await backend.generate(
            rb.GenerateRequest(
                input_ids=tokens,
                sampling=rb.SamplingParams(max_new_tokens=0, temperature=0.0),
                prompt_logprobs_start=len(tokens) - response_length - 1,
            )
        )
        assert direct.prompt_logprobs is not None
        assert [i[0] for i in items] == list(direct.prompt_logprobs[-response_length:])


async def test_batch_shapes_follow_sglang(
    reference: tuple[ReferenceBackend, RunningFacade], client: httpx.AsyncClient
) -> None:
    """``rid`` a string: ``{rid}_{i}``; a list: one each. ``sampling_params`` a list: one each; the
    logprob options likewise. ``text`` lists too (a tokenizer is set). Refusals name the item."""
    _, facade = reference
    url = f"{facade.url}/generate"
    body = {
        "input_ids": [[5, 6, 7], [8, 9]],
        "sampling_params": [{**GREEDY, "max_new_tokens": 2}, {**GREEDY, "max_new_tokens": 3}],
        "return_logprob": [True, False],
        "rid": "grp",
    }
    out = (await client.post(url, json=body)).json()
    assert [o["meta_info"]["id"] for o in out] == ["grp_0", "grp_1"]
    assert [len(o["output_ids"]) for o in out] == [2, 3]
    assert "output_token_logprobs" in out[0]["meta_info"] and "output_token_logprobs" not in out[1]["meta_info"]
    out = (await client.post(url, json={**body, "rid": ["a", "b"]})).json()
    assert [o["meta_info"]["id"] for o in out] == ["a", "b"]
    single = (await client.post(url, json={"text": "hello", "sampling_params": GREEDY})).json()
    out = (await client.post(url, json={"text": ["hello", "hi"], "sampling_params": GREEDY})).json()
    assert out[0]["output_ids"] == single["output_ids"] and len(out) == 2
    for change, field in (
        ({"rid": ["a"]}, "rid"),
        ({"rid": ["a", "a"]}, "rid"),
        ({"sampling_params": [GREEDY]}, "sampling_params"),
        ({"sampling_params": [GREEDY, {**GREEDY, "temperature": -1}]}, "sampling_params[1].temperature"),
        ({"sampling_params": {**GREEDY, "top_p": 0.0}}, "sampling_params.top_p"),  # shared: no index
        ({"input_ids": [[5, 6], [5, 10**9]]}, "input_ids[1][1]"),
        ({"input_ids": [[5, 6], []]}, "input_ids[1]"),
        ({"return_logprob": [True, "yes"]}, "return_logprob[1]"),
    ):
        r = await client.post(url, json={**body, **change})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (change, r.text)


async def test_a_failed_batch_item_fails_the_batch_and_aborts_the_rest(
    tokenizer: Any, client: httpx.AsyncClient
) -> None:
    backend = ScriptedBackend(("w0", "w1"))
    backend.hold = asyncio.Event()
    backend.failures.append(rb.Overloaded("busy"))
    running = await start_facade(MilesFacade(backend, tokenizer=tokenizer), port=0)
    try:
        body = {"input_ids": [[5, 6], [7, 8]], "sampling_params": GREEDY, "rid": ["a", "b"]}
        r = await client.post(f"{running.url}/generate", json=body)
        assert r.status_code == 503, r.text
        for _ in range(200):  # the other one is aborted on the backend, not left running
            if backend.aborted & {"a", "b"}:
                break
            await asyncio.sleep(0.01)
        assert len(backend.aborted & {"a", "b"}) == 1
    finally:
        await running.stop()
