"""Value types validate at construction and name the offending field."""

from __future__ import annotations

import attrs
import pytest

import rollout_backends as rb


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": -3}, "sampling.max_new_tokens"),
        ({"max_new_tokens": 2.0}, "sampling.max_new_tokens"),
        ({"max_new_tokens": True}, "sampling.max_new_tokens"),
        ({"temperature": -0.1}, "sampling.temperature"),
        ({"temperature": float("nan")}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_k": 0}, "sampling.top_k"),
        ({"min_p": 2.0}, "sampling.min_p"),
        ({"seed": -1}, "sampling.seed"),
        ({"seed": 2**63}, "sampling.seed"),
        ({"stop_token_ids": [1, "a"]}, "sampling.stop_token_ids[1]"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
        ({"frequency_penalty": 3.0}, "sampling.frequency_penalty"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "sampling.min_new_tokens"),
    ],
)
def test_sampling_params_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(rb.InvalidRequest) as info:
        rb.SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field
    assert field in str(info.value)


def test_sampling_from_mapping_rejects_unknown_key() -> None:
    with pytest.raises(rb.InvalidRequest) as info:
        rb.SamplingParams.from_mapping({"max_new_tokens": 4, "temprature": 0.0})
    assert info.value.field == "sampling.temprature"


def test_sampling_defaults_and_greedy() -> None:
    s = rb.SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[3, 4])
    assert s.greedy and s.stop_token_ids == (3, 4)
    assert not rb.SamplingParams().greedy


@pytest.mark.parametrize(
    ("input_ids", "field"),
    [
        ([], "input_ids"),
        ([1, -2], "input_ids[1]"),
        ([1, 2.0], "input_ids[1]"),
        ("abc", "input_ids"),
        ([True], "input_ids[0]"),
    ],
)
def test_generate_request_rejects(input_ids: object, field: str) -> None:
    with pytest.raises(rb.InvalidRequest) as info:
        rb.GenerateRequest(input_ids=input_ids)  # type: ignore[arg-type]
    assert info.value.field == field


def test_generate_request_is_frozen_and_has_unique_ids() -> None:
    a = rb.GenerateRequest(input_ids=[1, 2])
    b = rb.GenerateRequest(input_ids=(1, 2))
    assert a.input_ids == (1, 2) and a.request_id != b.request_id
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.input_ids = (3,)  # type: ignore[misc]


def test_generation_lengths_must_agree() -> None:
    # The engine's breach of the protocol, typed (a RolloutBackendError), never a bare ValueError.
    with pytest.raises(rb.ContractViolation):
        rb.Generation(
            request_id="r", output_ids=(1, 2), logprobs=(-0.1,), finish_reason=rb.FinishReason.LENGTH,
            weight_version=None, prompt_tokens=1,
        )  # fmt: skip


def test_weight_bucket_and_group_validation() -> None:
    b = rb.WeightBucket([rb.TensorSpec("w", "torch.bfloat16", (2, 3))])
    assert b.dtypes == ["bfloat16"] and b.shapes == [[2, 3]] and b.names == ["w"]
    with pytest.raises(rb.InvalidRequest) as info:
        rb.WeightBucket([rb.TensorSpec("w", "float32", (1,)), rb.TensorSpec("w", "float32", (1,))])
    assert info.value.field == "bucket.tensors"
    with pytest.raises(rb.InvalidRequest) as info:
        rb.TensorSpec("w", "float32", (2, -1))
    assert info.value.field == "tensor[w].shape[1]"
    with pytest.raises(rb.InvalidRequest) as info:
        rb.WeightGroup(master_address="127.0.0.1", master_port=70000, world_size=2)
    assert info.value.field == "group.master_port"
    with pytest.raises(rb.InvalidRequest) as info:
        rb.WeightGroup(master_address="127.0.0.1", master_port=7000, world_size=2, rank_offset=2)
    assert info.value.field == "group.rank_offset"


def test_capabilities_convert_and_query() -> None:
    caps = rb.Capabilities(pause_modes=["abort", rb.PauseMode.RETRACT], weight_transports=["disk"])
    assert caps.supports_pause(rb.PauseMode.ABORT) and not caps.supports_pause(rb.PauseMode.IN_PLACE)
    assert caps.supports_transport(rb.WeightTransport.DISK)
    with pytest.raises(rb.InvalidRequest) as info:
        rb.Capabilities(pause_modes=["sometimes"])
    assert info.value.field == "capabilities.pause_modes"
    with pytest.raises(rb.InvalidRequest) as info:
        rb.Capabilities(weight_transports=["carrier-pigeon"])
    assert info.value.field == "capabilities.weight_transports"


def test_misuse_is_typed() -> None:
    """Library-level misuse raises a RolloutBackendError naming the field, not ValueError/TypeError."""
    from rollout_backends.kit import RetryPolicy

    for kwargs, field in (({"attempts": 0}, "retry.attempts"), ({"generate_resends": -1}, "retry.generate_resends")):
        with pytest.raises(rb.InvalidRequest) as info:
            RetryPolicy(**kwargs)  # type: ignore[arg-type]
        assert info.value.field == field


def test_numpy_and_torch_token_ids_are_taken_exactly() -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    big = 2**63 - 1
    for ids in (np.array([1, 2, big]), np.array([1, 2, 3], dtype=np.uint32), torch.tensor([1, 2, big]),
                torch.tensor([1, 2, 3], dtype=torch.int32), [np.int64(1), torch.tensor(2), 3]):  # fmt: skip
        req = rb.GenerateRequest(input_ids=ids)
        assert req.input_ids == tuple(int(t) for t in ids) and all(type(t) is int for t in req.input_ids)
        sp = rb.SamplingParams(stop_token_ids=ids)
        assert sp.stop_token_ids == req.input_ids and all(type(t) is int for t in sp.stop_token_ids)
    refused = [
        (np.array([1.0, 2.0]), "input_ids"),
        (torch.tensor([1.0]), "input_ids"),
        (torch.tensor([1], dtype=torch.bfloat16), "input_ids"),
        (torch.tensor([True, False]), "input_ids"),
        (np.array([True]), "input_ids"),
        (np.array([[1, 2], [3, 4]]), "input_ids"),  # a batch
        (np.array([1, -1]), "input_ids[1]"),
        (np.array([1, 2**64 - 1], dtype=np.uint64), "input_ids[1]"),
        ([1, np.float32(2)], "input_ids[1]"),
        ([1, np.True_], "input_ids[1]"),
        ([1, torch.tensor([2])], "input_ids[1]"),
    ]
    for ids, field in refused:
        with pytest.raises(rb.InvalidRequest) as info:
            rb.GenerateRequest(input_ids=ids)
        assert info.value.field == field, ids
        with pytest.raises(rb.InvalidRequest) as info:
            rb.SamplingParams(stop_token_ids=ids)
        assert info.value.field == field.replace("input_ids", "sampling.stop_token_ids"), ids


def test_health_report_summary() -> None:
    w = [
        rb.WorkerHealth(worker="a", live=True, ready=True, making_progress=None, weight_version="v1", stale=False),
        rb.WorkerHealth(worker="b", live=True, ready=False, making_progress=None, weight_version="v0", stale=True),
    ]
    r = rb.HealthReport(workers=tuple(w), expected_version="v1")
    assert r.live and not r.ready and r.any_ready
    assert r.stale_workers == ("b",) and r.unhealthy_workers == ("b",)
    assert r.worker("b").weight_version == "v0"


def test_zero_budget_rescoring_needs_prompt_logprobs() -> None:
    rb_ = pytest.importorskip("rollout_backends")
    zero = rb_.SamplingParams(max_new_tokens=0)
    with pytest.raises(rb_.InvalidRequest) as e:
        rb_.GenerateRequest(input_ids=[1, 2], sampling=zero)
    assert e.value.field == "sampling.max_new_tokens"
    ok = rb_.GenerateRequest(input_ids=[1, 2], sampling=zero, prompt_logprobs_start=1)
    assert ok.prompt_logprobs_start == 1
    for bad, kw in [(2, {}), (-1, {}), (True, {}), (0, {"return_logprobs": False})]:
        with pytest.raises(rb_.InvalidRequest) as e:
            rb_.GenerateRequest(input_ids=[1, 2], sampling=zero, prompt_logprobs_start=bad, **kw)
        assert e.value.field == "prompt_logprobs_start"
    with pytest.raises(rb_.InvalidRequest) as e:
        rb_.SamplingParams(max_new_tokens=-1)
    assert e.value.field == "sampling.max_new_tokens"
