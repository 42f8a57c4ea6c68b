"""Miles' shapes through the codec: its sampling params in, its tensor payloads in, finish reasons and text out."""

from __future__ import annotations

import base64
import io
import pickle
import sys
import types
from typing import Any

import pytest

import rollout_backends as rb
from rollout_backends.integrations.miles._shapes import decode_tensor_payload
from rollout_backends.sglang_native import TextOptions, decode_text, finish_reason_body, parse_sampling


def _payload(obj: Any) -> str:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def test_miles_sampling_params_map_exactly() -> None:
    miles = {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "max_new_tokens": 64,
        "stop": None,
        "stop_token_ids": [2],
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        "sampling_seed": 44,
    }
    sampling, opts = parse_sampling(miles)
    assert sampling == rb.SamplingParams(
        max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(2,), seed=44, no_stop_trim=True
    )
    assert opts == TextOptions(skip_special_tokens=False, spaces_between_special_tokens=False, no_stop_trim=True)
    default, _ = parse_sampling(None)
    assert default is not None and default.max_new_tokens == 128  # SGLang's default


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"stop": ["\n\n"]}, "sampling_params.stop"),
        ({"n": 4}, "sampling_params.n"),
        ({"regex": "a+"}, "sampling_params.regex"),
        ({"seed": 3}, "sampling_params.seed"),  # SGLang's name is sampling_seed
        ({"max_new_tokens": 0}, "sampling_params.max_new_tokens"),
        ({"top_p": 0.0}, "sampling_params.top_p"),
        ({"no_stop_trim": "yes"}, "sampling_params.no_stop_trim"),
    ],
)
def test_refusals_name_the_field(params: dict[str, Any], field: str) -> None:
    with pytest.raises(rb.InvalidRequest) as info:
        parse_sampling(params)
    assert info.value.field == field


def _gen(out: tuple[int, ...], reason: rb.FinishReason, matched: int | None = None) -> rb.Generation:
    return rb.Generation(
        request_id="r", output_ids=out, logprobs=None, finish_reason=reason, weight_version=None, prompt_tokens=1,
        matched_stop=matched,
    )  # fmt: skip


def test_finish_reason_objects() -> None:
    assert finish_reason_body(_gen((1, 2), rb.FinishReason.STOP, 2)) == {"type": "stop", "matched": 2}
    assert finish_reason_body(_gen((1, 2), rb.FinishReason.LENGTH)) == {"type": "length", "length": 2}
    assert finish_reason_body(_gen((), rb.FinishReason.ABORT))["type"] == "abort"


def test_text_trims_the_matched_stop_unless_no_stop_trim(tokenizer: Any) -> None:
    gen = _gen((40, 41, 42), rb.FinishReason.STOP, 42)
    keep = decode_text(tokenizer, gen, TextOptions(skip_special_tokens=False, no_stop_trim=True))
    trim = decode_text(tokenizer, gen, TextOptions(skip_special_tokens=False, no_stop_trim=False))
    assert keep == tokenizer.decode([40, 41, 42]) and trim == tokenizer.decode([40, 41])
    assert decode_text(None, gen, TextOptions()) == ""


class FlattenedTensorMetadata:
    def __init__(self, name: str, shape: Any, dtype: Any, start_idx: int, end_idx: int, numel: int) -> None:
        self.name, self.shape, self.dtype = name, shape, dtype
        self.start_idx, self.end_idx, self.numel = start_idx, end_idx, numel


def test_tensor_payloads(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(decode_tensor_payload(_payload([("a", a)]), None),
                                                           [("a", a)], strict=True))  # fmt: skip

    # Miles' colocated bucket, multi-dtype: SGLang flattens every tensor to bytes.
    name = "sglang.srt.weight_sync.tensor_bucket"
    for i in range(1, 5):
        mod = ".".join(name.split(".")[:i])
        monkeypatch.setitem(sys.modules, mod, types.ModuleType(mod))
    FlattenedTensorMetadata.__module__ = name
    monkeypatch.setattr(sys.modules[name], "FlattenedTensorMetadata", FlattenedTensorMetadata, raising=False)
    raw = [t.contiguous().view(-1).view(torch.uint8) for t in (a, b)]
    flat = torch.cat(raw)
    meta = [
        FlattenedTensorMetadata("a", a.shape, a.dtype, 0, raw[0].numel(), a.numel()),
        FlattenedTensorMetadata("b", b.shape, b.dtype, raw[0].numel(), flat.numel(), b.numel()),
    ]
    out = dict(decode_tensor_payload(_payload({"flattened_tensor": flat, "metadata": meta}), "flattened_bucket"))
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b) and out["b"].dtype == torch.bfloat16

    with pytest.raises(rb.InvalidRequest, match="load_format"):
        decode_tensor_payload(_payload([("a", a)]), "my.custom.loader")


class Evil:
    def __reduce__(self) -> Any:
        return (print, ("pwned",))


def test_payloads_cannot_run_code() -> None:
    payload = base64.b64encode(pickle.dumps([("x", Evil())])).decode()
    with pytest.raises(rb.InvalidRequest, match="refusing"):
        decode_tensor_payload(payload, None)
