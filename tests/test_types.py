"""Value types validate at construction and name the offending field."""

from __future__ import annotations

import attrs
import pytest

import rollout_backends as rb


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "sampling.max_new_tokens"),
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
    with pytest.raises(ValueError):
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
    with pytest.raises(ValueError):
        rb.Capabilities(pause_modes=["sometimes"])


def test_health_report_summary() -> None:
    w = [
        rb.WorkerHealth(worker="a", live=True, ready=True, making_progress=None, weight_version="v1", stale=False),
        rb.WorkerHealth(worker="b", live=True, ready=False, making_progress=None, weight_version="v0", stale=True),
    ]
    r = rb.HealthReport(workers=tuple(w), expected_version="v1")
    assert r.live and not r.ready and r.any_ready
    assert r.stale_workers == ("b",) and r.unhealthy_workers == ("b",)
    assert r.worker("b").weight_version == "v0"
