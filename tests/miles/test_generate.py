"""The custom generate function against Miles' single-turn path, field by field.

Each case scripts one ``Generation`` and writes by hand the SGLang ``/generate`` answer that carries
the same result; Miles' own logic (restated in ``miles_shapes``) applied to that answer must give
exactly the sample the generate function fills.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import inspect
from typing import Any

import httpx
import pytest

import rollout_backends as rb
from rollout_backends.integrations.miles import MilesFacade, backend_url, generate, start_facade
from rollout_backends.integrations.miles import _config as config
from tests.miles.conftest import serve_backend
from tests.miles.miles_shapes import (
    BareSample,
    GenerateFnInput,
    GenerateState,
    Sample,
    Status,
    compute_request_payload,
    compute_routing_headers,
    compute_sampling_params,
    make_args,
    oracle_update_sample_from_response,
    sample_fields,
)
from tests.miles.scripted import ScriptedBackend

MESSAGES = [{"role": "user", "content": "What is 2 + 3? Answer with a number."}]


def prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """Miles' ``compute_prompt_ids_from_sample`` for text prompts."""
    if not isinstance(prompt, str):
        prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, tools=None)
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def sglang_answer(tokenizer: Any, gen: rb.Generation, finish: dict[str, Any]) -> dict[str, Any]:
    """What SGLang answers for ``gen`` to Miles' payload (no_stop_trim=True, skip_special_tokens=False)."""
    meta: dict[str, Any] = {
        "id": gen.request_id,
        "finish_reason": finish,
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": len(gen.output_ids),
        "cached_tokens": gen.cached_tokens,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(gen.logprobs or (), gen.output_ids, strict=True)],
    }
    if gen.weight_version is not None:
        meta["weight_version"] = gen.weight_version
    text = tokenizer.decode(list(gen.output_ids), skip_special_tokens=False)
    return {"text": text, "output_ids": list(gen.output_ids), "meta_info": meta}


def _gen(
    out: tuple[int, ...],
    reason: rb.FinishReason,
    *,
    version: str | None,
    cached: int = 0,
    n_prompt: int,
    matched: int | None = None,
) -> rb.Generation:
    return rb.Generation(
        request_id="r",
        output_ids=out,
        logprobs=tuple(-0.25 * (i + 1) for i in range(len(out))),
        finish_reason=reason,
        weight_version=version,
        prompt_tokens=n_prompt,
        cached_tokens=cached,
        matched_stop=matched,
    )


CASES = {
    # name: (output ids, finish reason, SGLang finish_reason object, version, cached tokens)
    "stop": ((40, 41, 2), rb.FinishReason.STOP, {"type": "stop", "matched": 2}, "3", 16),
    "length": ((40, 41, 42, 43), rb.FinishReason.LENGTH, {"type": "length", "length": 4}, "default", 0),
    "abort": ((40,), rb.FinishReason.ABORT, {"type": "abort", "message": "aborted"}, "7", 0),
    "no_version": ((40, 41), rb.FinishReason.LENGTH, {"type": "length", "length": 2}, None, 0),
    "abort_before_tokens": ((), rb.FinishReason.ABORT, {"type": "abort", "message": "aborted"}, "7", 0),
}


@pytest.mark.parametrize("sample_cls", [Sample, BareSample], ids=["miles_sample", "duck_typed"])
@pytest.mark.parametrize("case", sorted(CASES))
async def test_sample_matches_miles_single_turn(
    case: str, sample_cls: type, scripted: tuple[ScriptedBackend, str], tokenizer: Any
) -> None:
    backend, url = scripted
    out_ids, reason, finish, version, cached = CASES[case]
    args = make_args(rollout_backend_url=url, rollout_max_response_len=32)
    pids = prompt_ids(tokenizer, MESSAGES)
    gen = _gen(
        out_ids,
        reason,
        version=version,
        cached=cached,
        n_prompt=len(pids),
        matched=2 if reason is rb.FinishReason.STOP else None,
    )
    backend.script.append(gen)

    ours = sample_cls(index=3, group_index=1, prompt=MESSAGES, label="5", routing_key="group-1-sample-3")
    expected = copy.deepcopy(ours)
    sp = compute_sampling_params(args)
    output = await generate(GenerateFnInput(GenerateState(args, tokenizer), ours, copy.deepcopy(sp), False))
    assert output.samples is ours

    payload = compute_request_payload(args, pids, sp)
    assert payload is not None
    oracle_update_sample_from_response(args, expected, payload, sglang_answer(tokenizer, gen, finish))
    assert sample_fields(ours) == sample_fields(expected)

    # The request carries Miles' payload: prompt, budget, sampling and the routing key.
    (req,) = backend.requests
    assert list(req.input_ids) == payload["input_ids"]
    assert req.sampling.max_new_tokens == payload["sampling_params"]["max_new_tokens"] == 32
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k) == (1.0, 1.0, -1)
    assert req.return_logprobs is True
    assert req.routing_key == compute_routing_headers(ours)["X-SMG-Routing-Key"]  # type: ignore[index]


async def test_partial_rollout_resume_matches_miles(scripted: tuple[ScriptedBackend, str], tokenizer: Any) -> None:
    """A sample aborted mid-way is resumed from its tokens with the remaining budget (--partial-rollout)."""
    backend, url = scripted
    args = make_args(rollout_backend_url=url, rollout_max_response_len=10, rollout_max_context_len=4096)
    pids = prompt_ids(tokenizer, "Q: 2+3?")
    first = _gen((50, 51, 52), rb.FinishReason.ABORT, version="4", n_prompt=len(pids))
    second = _gen((53, 2), rb.FinishReason.STOP, version="5", n_prompt=len(pids) + 3, cached=8, matched=2)
    backend.script += [first, second]

    ours = Sample(index=0, prompt="Q: 2+3?")
    expected = copy.deepcopy(ours)
    sp = compute_sampling_params(args)
    for gen, finish in ((first, {"type": "abort"}), (second, {"type": "stop", "matched": 2})):
        ours.status = Status.ABORTED if ours.response_length else ours.status
        await generate(GenerateFnInput(GenerateState(args, tokenizer), ours, copy.deepcopy(sp), False))
        # Miles' single_turn: resume from sample.tokens with the budget left.
        budget = dict(sp)
        if expected.response:
            input_ids = expected.tokens
            budget["max_new_tokens"] -= len(expected.tokens) - len(pids)
        else:
            input_ids = pids
        payload = compute_request_payload(args, input_ids, budget)
        assert payload is not None
        oracle_update_sample_from_response(args, expected, payload, sglang_answer(tokenizer, gen, finish))
        assert list(backend.requests[-1].input_ids) == payload["input_ids"]
        assert backend.requests[-1].sampling.max_new_tokens == payload["sampling_params"]["max_new_tokens"]
    assert sample_fields(ours) == sample_fields(expected)
    assert ours.weight_versions == ["4", "5"] and ours.status is Status.COMPLETED
    assert backend.requests[-1].sampling.max_new_tokens == 7


async def test_exhausted_budget_truncates_without_a_request(
    scripted: tuple[ScriptedBackend, str], tokenizer: Any
) -> None:
    backend, url = scripted
    pids = prompt_ids(tokenizer, "Q: 2+3?")
    args = make_args(rollout_backend_url=url, rollout_max_context_len=len(pids))
    sample = Sample(prompt="Q: 2+3?")
    await generate(GenerateFnInput(GenerateState(args, tokenizer), sample, compute_sampling_params(args), False))
    assert sample.status is Status.TRUNCATED and sample.tokens == [] and backend.requests == []

    args = make_args(rollout_backend_url=url, rollout_max_response_len=3)
    sample = Sample(prompt="Q: 2+3?", response="abc", tokens=[*pids, 1, 2, 3], response_length=3)
    sample.status = Status.ABORTED
    await generate(GenerateFnInput(GenerateState(args, tokenizer), sample, compute_sampling_params(args), False))
    assert sample.status is Status.TRUNCATED and backend.requests == []


async def test_seed_stop_ids_and_text_options(scripted: tuple[ScriptedBackend, str], tokenizer: Any) -> None:
    backend, url = scripted
    args = make_args(rollout_backend_url=url, rollout_stop_token_ids=[2, 7], rollout_skip_special_tokens=True)
    sp = {**compute_sampling_params(args), "sampling_seed": 43}
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else 2
    backend.script.append(_gen((40, eos), rb.FinishReason.STOP, version="1", n_prompt=3, matched=eos))
    sample = Sample(prompt="hello")
    await generate(GenerateFnInput(GenerateState(args, tokenizer), sample, sp, False))
    req = backend.requests[0]
    assert req.sampling.seed == 43 and req.sampling.stop_token_ids == (2, 7)
    assert sample.response == tokenizer.decode([40, eos], skip_special_tokens=True)
    assert sample.tokens[-2:] == [40, eos]  # the stop token stays in the tokens (no_stop_trim)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"rollout_stop": ["###"]}, rb.InvalidRequest),
        ({"use_rollout_routing_replay": True}, rb.Unsupported),
        ({"lora_rank": 8}, rb.Unsupported),
    ],
)
async def test_unsupported_payload_features_are_refused(
    overrides: dict[str, Any], error: type, scripted: tuple[ScriptedBackend, str], tokenizer: Any
) -> None:
    backend, url = scripted
    args = make_args(rollout_backend_url=url, **overrides)
    with pytest.raises(error):
        await generate(
            GenerateFnInput(GenerateState(args, tokenizer), Sample(prompt="x"), compute_sampling_params(args), False)
        )
    assert backend.requests == []


async def test_routing_policy_requires_a_key(scripted: tuple[ScriptedBackend, str], tokenizer: Any) -> None:
    _, url = scripted
    args = make_args(rollout_backend_url=url, sglang_router_policy="consistent_hashing")
    with pytest.raises(ValueError, match="routing_key"):
        await generate(
            GenerateFnInput(GenerateState(args, tokenizer), Sample(prompt="x"), compute_sampling_params(args), False)
        )


async def test_retries_only_what_is_safe(
    scripted: tuple[ScriptedBackend, str], tokenizer: Any, fast_retries: None
) -> None:
    backend, url = scripted
    args = make_args(rollout_backend_url=url, rollout_backend_max_retries=2)
    backend.failures = [rb.ConnectionFailed("refused"), rb.BackendUnavailable("down")]
    sample = Sample(prompt="x")
    await generate(GenerateFnInput(GenerateState(args, tokenizer), sample, compute_sampling_params(args), False))
    assert len(backend.requests) == 3 and sample.status is Status.TRUNCATED

    backend.requests.clear()
    backend.failures = [rb.Overloaded("busy")] * 3
    with pytest.raises(rb.Overloaded):
        await generate(
            GenerateFnInput(GenerateState(args, tokenizer), Sample(prompt="x"), compute_sampling_params(args), False)
        )
    assert len(backend.requests) == 3

    backend.requests.clear()
    backend.failures = [rb.ContractViolation("bad answer")]
    with pytest.raises(rb.ContractViolation):
        await generate(
            GenerateFnInput(GenerateState(args, tokenizer), Sample(prompt="x"), compute_sampling_params(args), False)
        )
    assert len(backend.requests) == 1


async def test_backend_opened_once_per_process(tokenizer: Any) -> None:
    opened: list[str] = []
    backend = ScriptedBackend()

    async def opener(url: str, **_: Any) -> ScriptedBackend:
        opened.append(url)
        await asyncio.sleep(0.05)
        return backend

    rb.register_scheme("countingbackend", opener)
    args = make_args(rollout_backend_url="countingbackend://x")
    try:
        await asyncio.gather(
            *(
                generate(
                    GenerateFnInput(
                        GenerateState(args, tokenizer), Sample(prompt="x"), compute_sampling_params(args), False
                    )
                )
                for _ in range(8)
            )
        )
        assert opened == ["countingbackend://x"] and len(backend.requests) == 8
    finally:
        await config.close_backends()
    assert backend.closed


def test_miles_loads_it_as_a_new_style_generate_function() -> None:
    """Miles' ``_is_legacy_generate_fn``: legacy iff >= 3 params and the first is not ``input``."""
    params = list(inspect.signature(generate).parameters)
    assert params == ["input"] and inspect.iscoroutinefunction(generate)
    assert callable(generate.add_arguments)  # type: ignore[attr-defined]


def test_add_arguments_and_backend_url() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollout-backend", default="sglang")  # as Miles #1646 adds it
    parser.add_argument("--sglang-router-ip")
    parser.add_argument("--sglang-router-port", type=int)
    generate.add_arguments(parser)  # type: ignore[attr-defined]
    args = parser.parse_args(
        [
            "--rollout-backend",
            "dynamo",
            "--sglang-router-ip",
            "10.0.0.1",
            "--sglang-router-port",
            "8000",
            "--dynamo-router-mode",
            "kv",
            "--dynamo-page-size",
            "64",
            "--no-dynamo-router-kv-events",
            "--dynamo-router-predicted-ttl-secs",
            "5",
            "--dynamo-stream-interval",
            "50",
            "--dynamo-discovery-backend",
            "etcd",
        ]
    )
    url = backend_url(args)
    assert url.startswith("dynamo://10.0.0.1:8000?")
    query = dict(kv.split("=") for kv in url.split("?", 1)[1].split("&"))
    assert query == {
        "router_mode": "kv",
        "page_size": "64",
        "kv_events": "false",
        "router_predicted_ttl_secs": "5.0",
        "stream_interval": "50",
        "discovery_backend": "etcd",
    }
    # An explicit URL wins, and keeps what it already says.
    args.rollout_backend_url = "dynamo://fe:9000?router_mode=round-robin"
    assert backend_url(args).startswith("dynamo://fe:9000?router_mode=round-robin&page_size=64")
    assert backend_url(make_args()) == "sglang://127.0.0.1:1"
    with pytest.raises(rb.InvalidRequest):
        backend_url(make_args(sglang_router_ip=None))


async def test_generate_equals_miles_over_the_facade_on_the_reference_engine(tokenizer: Any, model_dir: Any) -> None:
    """End to end on a real (CPU) engine: our sample == Miles' single-turn sample through the facade."""
    from rollout_backends.adapters.reference import ReferenceBackend

    backend = ReferenceBackend.create(model_dir, workers=1)
    url = serve_backend(backend)
    facade = await start_facade(MilesFacade(backend, tokenizer=tokenizer), port=0)
    try:
        args = make_args(
            rollout_backend_url=url,
            sglang_router_port=facade.port,
            rollout_max_response_len=12,
            sglang_enable_deterministic_inference=True,
        )
        for idx in range(3):
            sp = {**compute_sampling_params(args), "sampling_seed": args.rollout_seed + idx}
            ours = Sample(index=idx, prompt=MESSAGES, routing_key=f"k{idx}")
            theirs = copy.deepcopy(ours)
            await backend.flush_cache()
            await generate(GenerateFnInput(GenerateState(args, tokenizer), ours, copy.deepcopy(sp), False))
            await backend.flush_cache()
            payload = compute_request_payload(args, prompt_ids(tokenizer, MESSAGES), sp)
            assert payload is not None
            async with httpx.AsyncClient(timeout=60) as client:
                resp = await client.post(
                    f"http://127.0.0.1:{facade.port}/generate", json=payload, headers=compute_routing_headers(theirs)
                )
            resp.raise_for_status()
            oracle_update_sample_from_response(args, theirs, payload, resp.json())
            assert sample_fields(ours) == sample_fields(theirs)
            assert ours.response_length > 0 and ours.weight_versions == ["default"]
    finally:
        await facade.stop()
        await config.close_backends()
        await backend.aclose()


async def test_rollout_stop_strings_equal_miles_over_the_facade_on_the_reference_engine(
    tokenizer: Any, model_dir: Any
) -> None:
    """``--rollout-stop`` strings on a backend that matches them: our sample == Miles' sample
    through the facade, both cut at the string (status COMPLETED, the response shorter)."""
    from rollout_backends.adapters.reference import ReferenceBackend

    backend = ReferenceBackend.create(model_dir, workers=1)
    url = serve_backend(backend)
    facade = await start_facade(MilesFacade(backend, tokenizer=tokenizer), port=0)
    try:
        plain = make_args(rollout_backend_url=url, sglang_router_port=facade.port, rollout_max_response_len=16,
                          rollout_temperature=0.0)  # fmt: skip
        sp = {**compute_sampling_params(plain), "ignore_eos": True}
        full = Sample(index=0, prompt=MESSAGES)
        await generate(GenerateFnInput(GenerateState(plain, tokenizer), full, copy.deepcopy(sp), False))
        ids = full.tokens[-full.response_length :]
        stop = next(
            s
            for i in range(3, 12)
            if (s := tokenizer.decode(ids[i : i + 1]).strip()) and s not in tokenizer.decode(ids[:i])
        )
        args = make_args(rollout_backend_url=url, sglang_router_port=facade.port, rollout_max_response_len=16,
                         rollout_temperature=0.0, rollout_stop=[stop])  # fmt: skip
        sp = {**compute_sampling_params(args), "ignore_eos": True}
        ours, theirs = Sample(index=0, prompt=MESSAGES), Sample(index=0, prompt=MESSAGES)
        await generate(GenerateFnInput(GenerateState(args, tokenizer), ours, copy.deepcopy(sp), False))
        payload = compute_request_payload(args, prompt_ids(tokenizer, MESSAGES), sp)
        assert payload is not None and payload["sampling_params"]["stop"] == [stop]
        async with httpx.AsyncClient(timeout=60) as client:
            resp = await client.post(f"http://127.0.0.1:{facade.port}/generate", json=payload)
        resp.raise_for_status()
        oracle_update_sample_from_response(args, theirs, payload, resp.json())
        assert sample_fields(ours) == sample_fields(theirs)
        assert ours.status is Status.COMPLETED and 0 < ours.response_length < full.response_length
        assert ours.response.endswith(stop)  # Miles sends no_stop_trim: True
    finally:
        await facade.stop()
        await config.close_backends()
        await backend.aclose()
