"""The SGLang codec: round trips in both directions and the one strictness rule (hypothesis)."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rollout_backends as rb
from rollout_backends import sglang_native as sn
from tests.native_bodies import BAD_VALUES, with_value

SETTINGS = settings(max_examples=200, deadline=None, database=None, derandomize=True)

_ids = st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=40)
_temperature = st.one_of(st.just(0.0), st.floats(1e-6, 100.0, allow_nan=False))


@st.composite
def sampling_params(draw: st.DrawFn) -> rb.SamplingParams:
    m = draw(st.integers(1, 2**40))
    return rb.SamplingParams(
        max_new_tokens=m,
        temperature=draw(_temperature),
        top_p=draw(st.floats(1e-6, 1.0)),
        top_k=draw(st.one_of(st.just(-1), st.integers(1, 2**40))),
        min_p=draw(st.floats(0.0, 1.0)),
        min_new_tokens=draw(st.integers(0, min(m, 2**20))),
        stop_token_ids=draw(st.lists(st.integers(0, 2**63 - 1), max_size=5)),
        ignore_eos=draw(st.booleans()),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))),
        repetition_penalty=draw(st.floats(1e-3, 2.0)),
        frequency_penalty=draw(st.floats(-2.0, 2.0)),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        top_logprobs=draw(st.integers(0, 20)),
        stop=draw(st.lists(st.text(min_size=1, max_size=8), max_size=3)),
        no_stop_trim=draw(st.booleans()),
    )


@st.composite
def requests(draw: st.DrawFn, *, rescoring: bool = False) -> rb.GenerateRequest:
    sampling = draw(sampling_params())
    ids = draw(_ids)
    start = draw(st.one_of(st.none(), st.integers(0, len(ids) - 1)))
    if rescoring:  # zero budget: prompt logprobs only (what Miles' recompute path sends)
        sampling, start = sampling.replace(max_new_tokens=0, min_new_tokens=0), draw(st.integers(0, len(ids) - 1))
    return rb.GenerateRequest(
        input_ids=ids,
        sampling=sampling,
        request_id=draw(st.text(min_size=1, max_size=30)),
        # Top and prompt logprobs come only with the logprobs.
        return_logprobs=draw(st.booleans()) or sampling.top_logprobs > 0 or start is not None,
        prompt_logprobs_start=start,
    )


#: A server with a tokenizer: stop strings accepted.
STOPS = sn.ParseRules(stop_strings=True)


def _wire(body: dict[str, Any]) -> Any:
    """What the other side reads: the body through JSON."""
    return json.loads(json.dumps(body))


@SETTINGS
@given(requests())
def test_request_round_trips(request: rb.GenerateRequest) -> None:
    parsed = sn.parse_request(_wire(sn.request_body(request)), rules=STOPS)
    assert parsed.request == request
    assert not parsed.prefill_only and not parsed.stream and not parsed.return_prompt_token_ids
    # The body asks for raw ids in the text too (what an RL client wants).
    trim = request.sampling.no_stop_trim
    assert parsed.text_options == sn.TextOptions(skip_special_tokens=False, no_stop_trim=trim)
    if request.sampling.stop:  # a server without a tokenizer refuses them, as SGLang does
        with pytest.raises(rb.InvalidRequest) as e:
            sn.parse_request(_wire(sn.request_body(request)))
        assert e.value.field == "sampling_params.stop"


@SETTINGS
@given(requests(rescoring=True))
def test_rescoring_request_round_trips_where_prefill_is_allowed(request: rb.GenerateRequest) -> None:
    body = _wire(sn.request_body(request))
    assert body["sampling_params"]["max_new_tokens"] == 0
    assert body["logprob_start_len"] == request.prompt_logprobs_start
    with pytest.raises(rb.InvalidRequest) as e:
        sn.parse_request(body, rules=STOPS)
    assert e.value.field == "sampling_params.max_new_tokens"
    parsed = sn.parse_request(body, rules=sn.ParseRules(allow_prefill_only=True, stop_strings=True))
    assert parsed.prefill_only and parsed.request == request


@SETTINGS
@given(requests(), st.text(min_size=1, max_size=10))
def test_streamed_request_round_trips_where_streaming_is_allowed(request: rb.GenerateRequest, key: str) -> None:
    body = _wire(sn.request_body(request, stream=True))
    with pytest.raises(rb.InvalidRequest) as e:
        sn.parse_request(body)
    assert e.value.field == "stream"
    rules = sn.ParseRules(allow_stream=True, stop_strings=True)
    parsed = sn.parse_request(body, rules=rules, routing_key=key, worker="w1")
    assert parsed.stream and parsed.request == attrs.evolve(request, routing_key=key, worker="w1")


@st.composite
def generations(draw: st.DrawFn) -> tuple[rb.GenerateRequest, rb.Generation]:
    out = tuple(draw(st.lists(st.integers(0, 2**63 - 1), max_size=20)))
    want_lp = draw(st.booleans())
    reason = draw(st.sampled_from(list(rb.FinishReason)))
    lps = tuple(draw(st.lists(st.floats(-1e6, 0.0), min_size=len(out), max_size=len(out)))) if want_lp else None
    matched = (
        draw(st.one_of(st.none(), st.integers(0, 2**63 - 1), st.text(min_size=1, max_size=5)))
        if reason is rb.FinishReason.STOP
        else None
    )
    k = draw(st.integers(0, 20)) if want_lp else 0
    tops = None
    if k:
        position = st.lists(st.tuples(st.integers(0, 2**63 - 1), st.floats(-1e6, 0.0)), min_size=1, max_size=k,
                            unique_by=lambda p: p[0])  # fmt: skip
        drawn = draw(st.lists(position, min_size=len(out), max_size=len(out)))
        tops = tuple(tuple(sorted(p, key=lambda e: (-e[1], e[0]))) for p in drawn)
    ids = draw(_ids)
    start = draw(st.one_of(st.none(), st.integers(0, len(ids) - 1))) if want_lp else None
    request = rb.GenerateRequest(
        input_ids=ids, sampling=rb.SamplingParams(top_logprobs=k), return_logprobs=want_lp, prompt_logprobs_start=start
    )
    prompt_lps = None
    if start is not None:
        rest = draw(st.lists(st.floats(-1e6, 0.0), min_size=len(ids) - start - 1, max_size=len(ids) - start - 1))
        prompt_lps = (None, *rest)
    gen = rb.Generation(
        request_id=draw(st.text(min_size=1, max_size=30)),
        output_ids=out,
        logprobs=lps,
        finish_reason=reason,
        weight_version=draw(st.one_of(st.none(), st.text(min_size=1, max_size=10))),
        prompt_tokens=len(ids) if start is not None else draw(st.integers(0, 2**31)),
        cached_tokens=draw(st.integers(0, 2**31)),
        worker=draw(st.one_of(st.none(), st.text(min_size=1, max_size=10))),
        latency_s=draw(st.floats(0.0, 1e4)),
        matched_stop=matched,
        top_logprobs=tops,
        prompt_logprobs=prompt_lps,
        text=draw(st.one_of(st.none(), st.text(max_size=20))),
    )
    return request, gen


@SETTINGS
@given(generations(), st.one_of(st.none(), st.text(max_size=20)))
def test_generation_round_trips(pair: tuple[rb.GenerateRequest, rb.Generation], text: str | None) -> None:
    request, gen = pair
    body = _wire(
        sn.answer_body(
            gen, return_logprob=request.return_logprobs, text=text, worker="ignored-name", input_ids=request.input_ids
        )
    )
    assert ("text" in body) == (text is not None or gen.text is not None)
    back = sn.parse_answer(request, body, gen.latency_s, worker=gen.worker)
    assert back == attrs.evolve(gen, text=text if text is not None else gen.text)


def test_one_abort_shape() -> None:
    gen = rb.Generation(request_id="r", output_ids=(1,), logprobs=None, finish_reason=rb.FinishReason.ABORT,
                        weight_version=None, prompt_tokens=1)  # fmt: skip
    assert sn.finish_reason_body(gen) == {"type": "abort", "message": sn.ABORT_MESSAGE, "status_code": None,
                                          "err_type": None}  # fmt: skip
    assert "weight_version" not in sn.meta_info(gen, return_logprob=False)


# -- the strictness rule ---------------------------------------------------------------------------


def _base_body() -> dict[str, Any]:
    return _wire(sn.request_body(rb.GenerateRequest(input_ids=[1, 2, 3], sampling=rb.SamplingParams(max_new_tokens=4))))


@pytest.mark.parametrize(("where", "value", "field"), BAD_VALUES, ids=[f for _, _, f in BAD_VALUES])
def test_each_bad_value_names_its_field(where: tuple[str, ...], value: Any, field: str) -> None:
    with pytest.raises(rb.InvalidRequest) as e:
        sn.parse_request(with_value(_base_body(), where, value))
    assert e.value.field == field, e.value


@SETTINGS
@given(requests(), st.sampled_from(BAD_VALUES))
def test_any_request_with_a_bad_value_is_refused_naming_it(
    request: rb.GenerateRequest, bad: tuple[tuple[str, ...], Any, str]
) -> None:
    where, value, field = bad
    body = with_value(_wire(sn.request_body(request)), where, value)
    if where == ("sampling_params", "min_new_tokens"):
        body["sampling_params"]["max_new_tokens"] = 4
    if where != ("sampling_params", "stop") and type(body.get("sampling_params")) is dict:
        body["sampling_params"].pop("stop", None)  # this server has no tokenizer: stops are refused too
    with pytest.raises(rb.InvalidRequest) as e:
        sn.parse_request(body)
    assert e.value.field == field


def test_unknown_keys_refused_unless_lenient() -> None:
    body = {**_base_body(), "return_logprob": False, "return_logprobs": True}
    with pytest.raises(rb.InvalidRequest, match="unknown field"):
        sn.parse_request(body)
    lenient = sn.ParseRules(unknown_keys=sn.UnknownKeys.IGNORE)
    assert sn.parse_request(body, rules=lenient).request.return_logprobs is False  # SGLang's rule: dropped
    # Unknown sampling keys: SGLang refuses them too, so lenient does as well.
    with pytest.raises(rb.InvalidRequest) as e:
        sn.parse_request(with_value(body, ("sampling_params", "seeed"), 1), rules=lenient)
    assert e.value.field == "sampling_params.seeed"


def test_what_smg_adds_is_accepted() -> None:
    # docs/sglang.md (smg's /generate forwarding): smg adds these to every body it forwards.
    added = {"model": "unknown", "log_metrics": True, "background": False, "no_logs": False,
             "return_bytes": False, "return_entropy": False, "logprob_start_len": -1, "top_logprobs_num": 0,
             "return_text_in_logprobs": False, "stream": False}  # fmt: skip
    assert sn.parse_request({**_base_body(), **added}).request.input_ids == (1, 2, 3)


def test_vocabulary_and_context_rules() -> None:
    rules = sn.ParseRules(vocab_size=10, max_context=8)
    for where, value, field in [
        (("input_ids",), [1, 10], "input_ids[1]"),
        (("sampling_params", "stop_token_ids"), [3, 12], "sampling_params.stop_token_ids[1]"),
        (("input_ids",), list(range(8)), "input_ids"),
        (("sampling_params", "max_new_tokens"), 5, "sampling_params.max_new_tokens"),  # 3 + 5 >= 8: refused
    ]:
        with pytest.raises(rb.InvalidRequest) as e:
            sn.parse_request(with_value(_base_body(), where, value), rules=rules)
        assert e.value.field == field
    ok = sn.parse_request(with_value(_base_body(), ("sampling_params", "max_new_tokens"), 4), rules=rules)
    assert ok.request.sampling.max_new_tokens == 4
    unlimited = sn.parse_request(with_value(_base_body(), ("sampling_params", "max_new_tokens"), None), rules=rules)
    assert unlimited.request.sampling.max_new_tokens == 4  # up to the context


def test_prefill_only_and_text_prompts() -> None:
    body = with_value(_base_body(), ("sampling_params", "max_new_tokens"), 0)
    assert sn.parse_request(body, rules=sn.ParseRules(allow_prefill_only=True)).prefill_only
    text_body = {"text": "abc", "sampling_params": {"max_new_tokens": 2}}
    parsed = sn.parse_request(text_body, encode=lambda s: [ord(c) for c in s])
    assert parsed.request.input_ids == (97, 98, 99)


def test_python_api_refuses_integers_wider_than_64_bits() -> None:
    with pytest.raises(rb.InvalidRequest) as e:
        rb.GenerateRequest(input_ids=[1, 2**70])
    assert e.value.field == "input_ids[1]"
    with pytest.raises(rb.InvalidRequest) as e:
        rb.SamplingParams(max_new_tokens=2**64)
    assert e.value.field == "sampling.max_new_tokens"
    with pytest.raises(rb.InvalidRequest) as e:
        rb.SamplingParams(stop_token_ids=[2**64])
    assert e.value.field == "sampling.stop_token_ids[0]"


def test_top_logprobs_need_the_logprobs() -> None:
    with pytest.raises(rb.InvalidRequest) as e:
        sn.parse_request({**_base_body(), "return_logprob": False, "top_logprobs_num": 3})
    assert e.value.field == "top_logprobs_num"
    with pytest.raises(rb.InvalidRequest) as e:
        rb.GenerateRequest(input_ids=[1], sampling=rb.SamplingParams(top_logprobs=3), return_logprobs=False)
    assert e.value.field == "sampling.top_logprobs"
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(rb.InvalidRequest) as e:
            rb.SamplingParams(top_logprobs=bad)
        assert e.value.field == "sampling.top_logprobs"
    parsed = sn.parse_request({**_base_body(), "top_logprobs_num": 3})
    assert parsed.request.sampling.top_logprobs == 3


def test_field_names_both_ways() -> None:
    pairs = [("sampling.top_logprobs", "top_logprobs_num"), ("prompt_logprobs_start", "logprob_start_len")]
    pairs += [("sampling.seed", "sampling_params.sampling_seed"), ("sampling.stop_token_ids[2]",
             "sampling_params.stop_token_ids[2]"), ("request_id", "rid"), ("return_logprobs", "return_logprob"),
             ("input_ids[3]", "input_ids[3]")]  # fmt: skip
    for ours, native in pairs:
        assert sn.native_field(ours) == native and sn.our_field(native) == ours


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"error": {"message": "x", "param": "sampling_params.sampling_seed"}}, "sampling.seed"),
        ({"error": "unknown field `seed`, expected one of `max_new_tokens`"}, "sampling.seed"),
        (
            {"error": {"message": "Requested token count exceeds the model's maximum context length of 8"}},
            "sampling.max_new_tokens",
        ),
        (
            {"error": {"message": "The input (9 tokens) is longer than the model's context length (8 tokens)."}},
            "input_ids",
        ),
        ({"error": {"message": "Duplicate request ID detected: r"}}, "request_id"),
        ({"error": {"message": "sampling.stop_token_ids[0]: token id 99 >= vocab size 10"}}, "sampling.stop_token_ids"),
        ({"error": {"message": "something else entirely"}}, "request"),
        # a refusal's own form (str(InvalidRequest)), wherever it sits: the field exactly, in our spelling
        ({"error": {"message": "HTTP 400: sampling_params.sampling_seed: 2**64 does not fit"}}, "sampling.seed"),
        ({"error": {"message": "rid: Duplicate request ID detected: r"}}, "request_id"),
        ({"error": {"message": "input_ids[3]: token id 600 is outside the vocabulary"}}, "input_ids[3]"),
    ],
)
def test_error_field(body: dict[str, Any], field: str) -> None:
    assert sn.error_field(body, sn.error_message(body, "")) == field


def test_error_body_carries_the_callers_field() -> None:
    body = sn.error_body(rb.InvalidRequest("sampling_params.top_k", "must be -1 or >= 1"))
    assert body["error"]["param"] == "sampling_params.top_k" and "must be" in body["error"]["message"]
    assert sn.error_field(body, "") == "sampling.top_k"


# -- control bodies both ways ----------------------------------------------------------------------

_label = st.one_of(st.none(), st.text(min_size=1, max_size=8))
_name = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=8)


@settings(max_examples=100, deadline=None, database=None, derandomize=True)
@given(
    st.text(min_size=1, max_size=20), _label, st.one_of(st.none(), _name), st.booleans(),
    st.lists(st.tuples(_name, st.sampled_from(["float32", "bfloat16"]), st.lists(st.integers(0, 9), max_size=3)),
             min_size=1, max_size=4, unique_by=lambda t: t[0]),
    _name, st.sampled_from(list(rb.PauseMode)), st.lists(st.sampled_from(list(rb.MemoryTag)), max_size=3),
)  # fmt: skip
def test_control_bodies_round_trip(
    path: str, version: str | None, load_format: str | None, flush: bool, specs: list[Any], group: str,
    mode: rb.PauseMode, tags: list[rb.MemoryTag],
) -> None:  # fmt: skip
    """What the wires build, the facade parses back to the same values (SGLang's wire format once)."""
    from rollout_backends.kit import Pause, SetVersion, UpdateFromDisk, UpdateFromDistributed

    disk = UpdateFromDisk(path=path, version=version, load_format=load_format, flush_cache=flush)
    assert sn.parse_disk_body(json.loads(json.dumps(sn.disk_body(disk)))) == (disk, False)
    bucket = rb.WeightBucket([rb.TensorSpec(n, d, tuple(s)) for n, d, s in specs])
    dist = UpdateFromDistributed(bucket=bucket, group_name=group, version=version, flush_cache=flush)
    assert sn.parse_distributed_body(json.loads(json.dumps(sn.distributed_body(dist)))) == (dist, False)
    g = rb.WeightGroup(master_address="10.0.0.1", master_port=29500, world_size=3, rank_offset=1, group_name=group,
                       backend="gloo")  # fmt: skip
    op = sn.parse_init_group_body(json.loads(json.dumps(sn.init_group_body(g, 1))))
    assert op.group == g and op.rank_offset == 1
    assert sn.parse_set_version_body(sn.set_version_body(group)) == (SetVersion(version=group), False)
    assert sn.parse_memory_body(sn.memory_body(tuple(tags))) == tuple(tags)
    assert sn.parse_memory_body(sn.memory_body(None)) is None
    assert sn.parse_pause_body({"mode": mode.value}) == Pause(mode=mode)


@pytest.mark.parametrize(
    ("parse", "body", "field"),
    [
        (sn.parse_disk_body, {"model_path": "/m", "flush_cache": "false"}, "flush_cache"),
        (sn.parse_disk_body, {"model_path": "/m", "abort_all_requests": 1}, "abort_all_requests"),
        (sn.parse_disk_body, {"model_path": 7}, "model_path"),
        (sn.parse_disk_body, {}, "model_path"),
        (sn.parse_disk_body, {"model_path": "/m", "weight_version": 3}, "weight_version"),
        (sn.parse_distributed_body, {"names": ["a"], "dtypes": ["f"], "shapes": [[1, -1]]}, "shapes[0][1]"),
        (sn.parse_distributed_body, {"names": "a", "dtypes": ["f"], "shapes": [[1]]}, "names"),
        (sn.parse_distributed_body, {"names": ["a"], "dtypes": [], "shapes": [[1]]}, "names"),
        (sn.parse_distributed_body, {"names": [5], "dtypes": ["f"], "shapes": [[1]]}, "names[0]"),
        (sn.parse_init_group_body, {"master_address": "h", "master_port": "29500", "world_size": 2}, "master_port"),
        (sn.parse_init_group_body, {"master_address": "h", "master_port": 70000, "world_size": 2}, "master_port"),
        (sn.parse_init_group_body, {"master_address": "h", "master_port": 1, "world_size": 2**70}, "world_size"),
        (sn.parse_init_group_body, {"master_port": 1, "world_size": 2}, "master_address"),
        (sn.parse_set_version_body, {"new_version": 2}, "new_version"),
        (sn.parse_set_version_body, {"new_version": "v", "abort_all_requests": "no"}, "abort_all_requests"),
        (sn.parse_memory_body, {"tags": "weights"}, "tags"),
        (sn.parse_memory_body, {"tags": ["weights", "gpu"]}, "tags[1]"),
        (sn.parse_pause_body, {"mode": "sideways"}, "mode"),
        (sn.parse_pause_body, {"mode": 1}, "mode"),
        (sn.parse_abort_body, {"abort_all": "true"}, "abort_all"),
        (sn.parse_abort_body, {"rid": 5}, "rid"),
        (sn.parse_destroy_group_body, {"group_name": ["g"]}, "group_name"),
        (sn.parse_tensors_body, {"serialized_named_tensors": "x"}, "serialized_named_tensors"),
        (sn.parse_tensors_body, {"serialized_named_tensors": [1]}, "serialized_named_tensors[0]"),
        (sn.parse_tensors_body, {"serialized_named_tensors": ["x"], "flush_cache": "0"}, "flush_cache"),
        (sn.parse_disk_body, [1], "body"),
    ],
)
def test_control_bodies_name_the_bad_key(parse: Any, body: Any, field: str) -> None:
    with pytest.raises(rb.InvalidRequest) as info:
        parse(body)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("stop", "field"),
    [
        ([""], "sampling_params.stop[0]"),
        (["ok", 5], "sampling_params.stop[1]"),
        (["x" * 513], "sampling_params.stop[0]"),
        ([f"s{i}" for i in range(33)], "sampling_params.stop"),
        (5, "sampling_params.stop"),
        ({"a": 1}, "sampling_params.stop"),
    ],
)
def test_bad_stop_strings_name_their_field(stop: Any, field: str) -> None:
    with pytest.raises(rb.InvalidRequest) as e:
        sn.parse_request(with_value(_base_body(), ("sampling_params", "stop"), stop), rules=STOPS)
    assert e.value.field == field, e.value
    one = sn.parse_request(with_value(_base_body(), ("sampling_params", "stop"), "</s>"), rules=STOPS)
    assert one.request.sampling.stop == ("</s>",)  # SGLang takes one string too


def test_stop_strings_in_python() -> None:
    for bad, field in [("ab", "sampling.stop"), (["a", 1], "sampling.stop[1]"), ([""], "sampling.stop[0]")]:
        with pytest.raises(rb.InvalidRequest) as e:
            rb.SamplingParams(stop=bad)
        assert e.value.field == field
    with pytest.raises(rb.InvalidRequest) as e:
        rb.SamplingParams(no_stop_trim=1)  # type: ignore[arg-type]
    assert e.value.field == "sampling.no_stop_trim"
    assert rb.SamplingParams(stop=["a", "b"]).stop == ("a", "b")


# The answer SGLang 0.5.16 gave on the H200 (2026-12-03, docs/sglang.md "Prompt logprobs", the
# tier's tiny model: 512 ids) for the 8th parity prompt scored from 0: the prompt's id 511 (the
# vocabulary's last) is named 0, its logprob is 511's (transformers: -12.2546).
_CLIPPED_PROMPT = (156, 485, 105, 160, 392, 51, 188, 352, 511, 370, 500, 470)
_CLIPPED_LPS = (None, -14.0086, -9.6193, -11.0842, -6.6172, -5.7678, -14.5193, -15.2859, -12.2735, -13.7558,
                -12.6407, -14.7027)  # fmt: skip


def _scored_answer(named: tuple[int, ...]) -> dict[str, Any]:
    return {
        "output_ids": [409],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": len(named),
            "completion_tokens": 1,
            "cached_tokens": 0,
            "weight_version": "default",
            "output_token_logprobs": [[-0.5, 409, None]],
            "input_token_logprobs": [[lp, t, None] for lp, t in zip(_CLIPPED_LPS, named, strict=True)],
        },
    }


def test_prompt_logprobs_of_sglangs_clipped_last_id() -> None:
    request = rb.GenerateRequest(input_ids=_CLIPPED_PROMPT, sampling=rb.SamplingParams(max_new_tokens=1),
                                 prompt_logprobs_start=0)  # fmt: skip
    named = tuple(0 if t == 511 else t for t in _CLIPPED_PROMPT)
    gen = sn.parse_answer(request, _scored_answer(named), 0.1, worker="w")
    assert gen.prompt_logprobs == _CLIPPED_LPS
    # Still refused: the prompt shifted by one (a misaligned answer), and 0 named for an id that
    # is not the prompt's largest (SGLang clips only ids >= vocab_size - 1).
    shifted = (*_CLIPPED_PROMPT[1:], 7)
    for bad in (shifted, tuple(0 if t == 500 else t for t in _CLIPPED_PROMPT)):
        with pytest.raises(rb.ContractViolation, match="input_token_logprobs"):
            sn.parse_answer(request, _scored_answer(bad), 0.1, worker="w")
