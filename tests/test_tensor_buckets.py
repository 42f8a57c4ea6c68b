"""Flat buckets (``TensorBuckets``, SGLang's ``load_format="flattened_bucket"``): packing, reuse,
the payload both ways, and where the fleet and the transaction send them."""

from __future__ import annotations

import base64
import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import rollout_backends as rb
from rollout_backends._tensors import FLATTENED_BUCKET, _dump, decode_tensor_payload, serialize_flat_bucket
from rollout_backends.adapters.reference import ReferenceBackend, cached_tiny_model


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(7, 5, generator=g)),  # 140 bytes: the next slot starts at 256
        ("a.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("scalar", torch.tensor(3.5, dtype=torch.float64)),
        ("empty", torch.zeros(0, 4)),
        ("ids", torch.arange(6, dtype=torch.int32).reshape(2, 3)),
        ("big", torch.randn(300, generator=g)),  # 1200 bytes: over max_bytes below, a bucket of its own
        ("t", torch.randn(4, 3, generator=g).t()),  # not contiguous
    ]


def test_pack_round_trips_through_the_payload_in_several_aligned_buckets() -> None:
    named = _named()
    packer = rb.TensorBuckets(max_bytes=1024)
    buckets = packer.pack(named)
    assert [b.names for b in buckets] == [("a.weight", "a.bias", "scalar", "empty", "ids"), ("big",), ("t",)]
    assert all(s.start % 256 == 0 for b in buckets for s in b.slots)
    assert sum(b.nbytes for b in buckets) == sum(t.numel() * t.element_size() for _, t in named)
    got = [pair for b in buckets for pair in decode_tensor_payload(serialize_flat_bucket(b), FLATTENED_BUCKET)]
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, t) in zip(named, got, strict=True):
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)
    # the views a fleet hands an in-process engine are the same tensors
    assert all(torch.equal(v, w) for (_, v), (_, w) in zip(buckets[0].views(), named[:5], strict=False))


def test_buffers_are_reused_while_the_layout_holds_and_remade_when_it_changes() -> None:
    named = _named()
    packer = rb.TensorBuckets(max_bytes=1024)
    first = packer.pack(named)
    ptrs = [b.buffer.data_ptr() for b in first]
    changed = [(n, t + 1 if t.is_floating_point() else t) for n, t in named]
    second = packer.pack(changed)
    assert [b.buffer.data_ptr() for b in second] == ptrs  # same buffers, new contents
    assert torch.equal(dict(second[0].views())["a.weight"], changed[0][1])
    assert packer.allocated_bytes == sum(int(b.buffer.numel()) for b in second)
    third = packer.pack([*named, ("extra", torch.ones(2))])  # a new layout: new buffers
    assert third[-1].names[-1] == "extra" and dict(third[-1].views())["extra"].tolist() == [1.0, 1.0]
    packer.release()
    assert packer.allocated_bytes == 0


def test_pack_casts_floating_tensors_to_the_asked_dtype() -> None:
    w = torch.randn(4, 4)
    ids = torch.arange(3)
    (bucket,) = rb.TensorBuckets(dtype=torch.bfloat16).pack([("w", w), ("ids", ids)])
    got = dict(bucket.views())
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], w.to(torch.bfloat16))
    assert got["ids"].dtype == torch.int64 and torch.equal(got["ids"], ids)
    assert bucket.nbytes == 16 * 2 + 3 * 8


def test_bad_input_is_invalid_request_naming_the_field() -> None:
    packer = rb.TensorBuckets()
    with pytest.raises(rb.InvalidRequest) as e:
        packer.pack([("a", torch.zeros(1)), ["b", torch.zeros(1)]])  # type: ignore[list-item]
    assert e.value.field == "named_tensors[1]"
    with pytest.raises(rb.InvalidRequest) as e:
        packer.pack([("a", 1.0)])
    assert e.value.field == "named_tensors[0]"
    with pytest.raises(rb.InvalidRequest, match="twice"):
        packer.pack([("a", torch.zeros(1)), ("a", torch.zeros(2))])
    with pytest.raises(rb.InvalidRequest) as e:
        packer.pack([])
    assert e.value.field == "named_tensors"
    with pytest.raises(rb.InvalidRequest) as e:
        rb.TensorBuckets(max_bytes=0)
    assert e.value.field == "max_bytes"


# -- the payload against SGLang's receiver, restated ------------------------------------------------

#: SGLang 0.5.16 ``sglang/srt/utils/common.py`` ``SafeUnpickler.ALLOWED_MODULE_PREFIXES`` (the part a
#: tensor payload can touch): a class loads only if ``module + "."`` starts with one of these.
SGLANG_ALLOWED_PREFIXES = (
    "builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.", "weakref.",
    "torch.", "multiprocessing.resource_sharer.", "multiprocessing.reduction.",
    "sglang.srt.weight_sync.tensor_bucket.",
)  # fmt: skip


class _SGLangRule(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not any((module + ".").startswith(p) for p in SGLANG_ALLOWED_PREFIXES):
            raise pickle.UnpicklingError(f"SGLang would refuse {module}.{name}")
        return super().find_class(module, name)


def test_the_payload_loads_under_sglangs_rule_and_rebuilds_as_its_weight_updater_does() -> None:
    named = _named()[:5]
    (bucket,) = rb.TensorBuckets().pack(named)
    obj = _SGLangRule(io.BytesIO(base64.b64decode(serialize_flat_bucket(bucket)))).load()
    # model_runner_components/weight_updater.py _update_weights_from_flattened_bucket, then
    # FlattenedTensorBucket.reconstruct_tensors: attribute reads and one slice per record.
    flat = obj["flattened_tensor"]
    rebuilt = [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in obj["metadata"]]
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    for (n, want), (m, t) in zip(named, rebuilt, strict=True):
        assert n == m and torch.equal(t, want)


def test_decoding_refuses_what_is_not_a_tensor_payload() -> None:
    (bucket,) = rb.TensorBuckets().pack([("a", torch.zeros(2))])
    payload = serialize_flat_bucket(bucket)
    with pytest.raises(rb.InvalidRequest) as e:
        decode_tensor_payload(payload, None)  # a flat bucket is not a list of pairs
    assert e.value.field == "serialized_named_tensors"
    with pytest.raises(rb.InvalidRequest) as e:
        decode_tensor_payload(payload, "my.custom.loader")
    assert e.value.field == "load_format"
    evil = _dump({"flattened_tensor": torch.zeros(2), "metadata": [print]})
    with pytest.raises(rb.InvalidRequest, match="refusing"):
        decode_tensor_payload(evil, FLATTENED_BUCKET)
    obj = {"flattened_tensor": torch.zeros(8, dtype=torch.uint8), "metadata": [_record("a", (4,), 0, 16)]}
    with pytest.raises(rb.InvalidRequest) as e:  # the record reaches past the buffer
        decode_tensor_payload(_dump(obj), FLATTENED_BUCKET)
    assert e.value.field == "serialized_named_tensors.metadata[0]"
    ok = {"flattened_tensor": torch.zeros(16, dtype=torch.uint8), "metadata": [_record("a", (4,), 0, 16)]}
    assert [n for n, _ in decode_tensor_payload(_dump(ok), FLATTENED_BUCKET)] == ["a"]


def _record(name: str, shape: tuple[int, ...], start: int, end: int) -> Any:
    import types

    return types.SimpleNamespace(
        name=name, shape=torch.Size(shape), dtype=torch.float32, start_idx=start, end_idx=end, numel=end - start
    )


# -- the fleet and the transaction --------------------------------------------------------------------


@pytest.fixture(scope="module")
def models() -> tuple[Path, Path]:
    return cached_tiny_model(seed=0), cached_tiny_model(seed=1)


def _weights(path: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return list(load_file(str(path / "model.safetensors")).items())


async def test_a_flat_bucket_push_serves_what_a_disk_load_serves(models: tuple[Path, Path]) -> None:
    a, b = models
    req = rb.GenerateRequest(input_ids=(3, 4, 5), sampling=rb.SamplingParams(max_new_tokens=6, temperature=0.0))
    async with ReferenceBackend.create(b) as want_b, ReferenceBackend.create(a, workers=2) as backend:
        assert backend.capabilities.flattened_buckets
        want = await want_b.generate(req)
        packer = rb.TensorBuckets(max_bytes=200_000)  # several buckets
        async with backend.weight_update("flat-b") as tx:
            await tx.update_from_tensors(_weights(b), buckets=packer)
        assert len(packer.pack(_weights(b))) > 1
        for w in backend.workers:
            got = await backend.generate(rb.GenerateRequest(input_ids=(3, 4, 5), sampling=req.sampling, worker=w))
            assert (got.output_ids, got.logprobs, got.weight_version) == (want.output_ids, want.logprobs, "flat-b")
        with pytest.raises(rb.InvalidRequest) as e:
            await backend.update_weights_from_tensors(packer.pack(_weights(a))[0], load_format="direct")
        assert e.value.field == "load_format"
        with pytest.raises(rb.InvalidRequest) as e:
            await backend.update_weights_from_tensors(_weights(a), load_format=FLATTENED_BUCKET)
        assert e.value.field == "load_format"


class _Recorder:
    """The part of a backend the transaction's tensor loader uses, recording what it is sent."""

    def __init__(self, flat: bool) -> None:
        self.capabilities = rb.Capabilities(weight_transports=[rb.WeightTransport.TENSOR], flattened_buckets=flat)
        self.sent: list[tuple[Any, str | None]] = []

    async def update_weights_from_tensors(
        self, named: Any, *, flush_cache: bool, load_format: str | None = None
    ) -> None:
        assert flush_cache is False
        self.sent.append((named, load_format))


@pytest.mark.parametrize("flat", [True, False])
async def test_the_transaction_sends_flat_buckets_only_where_declared(flat: bool) -> None:
    named = _named()
    rec = _Recorder(flat)
    tx = rb.WeightUpdateTransaction(rec, "v1", rb.PauseMode.RETRACT, {})  # type: ignore[arg-type]
    await tx.update_from_tensors(iter(named), buckets=rb.TensorBuckets(max_bytes=1024))
    assert len(rec.sent) == 3 and all(fmt is None for _, fmt in rec.sent)
    if flat:
        assert all(isinstance(b, rb.FlatBucket) for b, _ in rec.sent)
    else:  # the per-tensor path, over one storage per bucket
        first = rec.sent[0][0]
        assert isinstance(first, list) and [n for n, _ in first] == [n for n, _ in named[:5]]
        assert len({t.untyped_storage().data_ptr() for _, t in first}) == 1
    with pytest.raises(rb.InvalidRequest) as e:
        await tx.update_from_tensors(named, buckets=rb.TensorBuckets(), load_format="direct")
    assert e.value.field == "load_format"


async def test_a_backend_that_does_not_declare_flat_buckets_refuses_one() -> None:
    from rollout_backends.testing import fake_fleet

    async with fake_fleet() as fake:
        assert not fake.capabilities.flattened_buckets
        (bucket,) = rb.TensorBuckets().pack([("seed", torch.zeros(1))])
        with pytest.raises(rb.Unsupported) as e:
            await fake.update_weights_from_tensors(bucket)
        assert e.value.capability == "flattened_buckets"
