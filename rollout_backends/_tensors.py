"""In-memory tensor hand-over in SGLang's format (``MultiprocessingSerializer``), per tensor or in
flat buckets.

A payload is ``base64(ForkingPickler.dumps(obj))``: CUDA tensors travel as CUDA-IPC handles, CPU
tensors as shared memory, so the bytes are small and the tensors must stay alive in the sender
until the receiver has loaded them (the call returns). ``obj`` is ``[(name, tensor), ...]``, or,
for SGLang's ``load_format="flattened_bucket"``, ``{"flattened_tensor": <1-D uint8>, "metadata":
[...]}``: one tensor (one IPC handle, one event, one reference count) for a whole bucket instead
of one per tensor. Decoding accepts only what ForkingPickler emits for tensors (like SGLang's
``SafeUnpickler``) and the bucket's metadata records.

``TensorBuckets`` packs a model's tensors into flat buffers that it allocates once and reuses on
every push while the tensors' layout stays the same (no allocation and no host copy per step; one
multi-tensor copy kernel per bucket on the tensors' device).
"""

from __future__ import annotations

import base64
import io
import pickle
import types
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import attrs

from rollout_backends._errors import InvalidRequest

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "FLATTENED_BUCKET",
    "FlatBucket",
    "TensorBuckets",
    "decode_tensor_payload",
    "deserialize_named_tensors",
    "serialize_flat_bucket",
    "serialize_named_tensors",
]

#: SGLang's ``load_format`` for a flat bucket (``sglang/srt/weight_sync/tensor_bucket.py``; read in
#: the 0.5.16 wheel: ``ModelRunner``'s weight updater rebuilds each tensor as
#: ``flattened_tensor[start_idx:end_idx].view(dtype).reshape(shape)`` and calls ``load_weights``).
FLATTENED_BUCKET = "flattened_bucket"
#: The load formats whose payload is a list of ``(name, tensor)`` pairs.
_PAIR_FORMATS = (None, "direct")
#: Miles' colocated bucket size (``--update-weight-buffer-size``, 512 MiB).
DEFAULT_BUCKET_BYTES = 512 * 2**20
#: Each tensor starts at a multiple of this many bytes in its bucket, so that a view of any dtype
#: is aligned and copy kernels get full-width loads; the receiver slices by the metadata's offsets,
#: so the gaps are never read.
_ALIGN = 256


class _FlattenedTensorMetadata:
    """Stands in for ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` when a payload
    built with SGLang's own class (Miles') is decoded here (a dataclass: name, shape, dtype,
    start_idx, end_idx, numel)."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


class _TorchOnlyUnpickler(pickle.Unpickler):
    """Like SGLang's ``SafeUnpickler``: only what ForkingPickler emits for tensors may be loaded,
    plus a flat bucket's metadata records."""

    _ALLOWED: ClassVar[frozenset[tuple[str, str]]] = frozenset(
        {
            ("torch", "Tensor"),
            ("torch", "Size"),
            ("torch", "device"),
            ("torch.storage", "UntypedStorage"),
            ("torch.storage", "TypedStorage"),
            ("torch.nn.parameter", "Parameter"),
            ("torch._tensor", "_rebuild_from_type_v2"),
            ("collections", "OrderedDict"),
            ("multiprocessing.resource_sharer", "DupFd"),
            ("types", "SimpleNamespace"),  # our buckets' metadata records
        }
    )
    _STAND_INS: ClassVar[dict[tuple[str, str], type]] = {
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): _FlattenedTensorMetadata,
    }

    def find_class(self, module: str, name: str) -> Any:
        stand_in = self._STAND_INS.get((module, name))
        if stand_in is not None:
            return stand_in
        if (
            (module, name) in self._ALLOWED
            or (module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"))
            or (module == "torch._utils" and name.startswith("_rebuild_"))
            or (module == "torch" and self._is_dtype(name))
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")

    @staticmethod
    def _is_dtype(name: str) -> bool:
        import torch

        return isinstance(getattr(torch, name, None), torch.dtype)


def _dump(obj: object) -> str:
    """``MultiprocessingSerializer.serialize(obj, output_str=True)``: base64 of a ForkingPickler dump.

    CPU tensors travel as shared memory; across unrelated processes that needs the ``file_system``
    sharing strategy (``torch.multiprocessing.set_sharing_strategy("file_system")``), set here.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    if tmp.get_sharing_strategy() != "file_system":  # type: ignore[no-untyped-call]
        tmp.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _pairs(named_tensors: Iterable[tuple[str, Any]], field: str = "named_tensors") -> list[tuple[str, Any]]:
    items = list(named_tensors)
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidRequest(f"{field}[{i}]", "must be a (name, tensor) pair")
        if not hasattr(item[1], "dtype") or not hasattr(item[1], "shape"):
            raise InvalidRequest(f"{field}[{i}]", f"{item[0]!r} is not a tensor")
    return items


def serialize_named_tensors(named_tensors: Sequence[tuple[str, Any]]) -> str:
    """SGLang's per-tensor payload (``load_format`` ``None``): each tensor its own handle.

    Keep the tensors alive until the HTTP call returns.
    """
    return _dump(_pairs(named_tensors))


# -- flat buckets ----------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class _Slot:
    """Where one tensor's bytes sit in its bucket: ``buffer[start:end]``."""

    name: str
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype
    start: int
    end: int


@attrs.frozen(slots=True, eq=False)
class FlatBucket:
    """Tensors packed into one flat byte buffer, for SGLang's ``load_format="flattened_bucket"``.

    ``buffer`` is a 1-D ``uint8`` tensor holding every slot's bytes. Made by ``TensorBuckets.pack``;
    ``backend.update_weights_from_tensors(bucket)`` sends it as one tensor (one CUDA-IPC handle).
    """

    buffer: Any
    slots: tuple[_Slot, ...]
    #: SGLang's metadata records, made once (what the payload carries besides the buffer).
    metadata: tuple[Any, ...] = attrs.field(repr=False)

    @classmethod
    def over(cls, buffer: Any, slots: Sequence[_Slot]) -> FlatBucket:
        import torch

        meta = tuple(
            types.SimpleNamespace(
                name=s.name,
                shape=torch.Size(s.shape),
                dtype=s.dtype,
                start_idx=s.start,
                end_idx=s.end,
                numel=s.end - s.start,  # bytes, as SGLang's FlattenedTensorBucket counts them
            )
            for s in slots
        )
        return cls(buffer, tuple(slots), meta)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slots)

    @property
    def nbytes(self) -> int:
        """The tensors' bytes (the buffer's alignment gaps not counted)."""
        return sum(s.end - s.start for s in self.slots)

    def views(self) -> list[tuple[str, Any]]:
        """``(name, tensor)`` views into the buffer: what the receiver rebuilds."""
        return [(s.name, self.buffer[s.start : s.end].view(s.dtype).view(s.shape)) for s in self.slots]


def serialize_flat_bucket(bucket: FlatBucket) -> str:
    """SGLang's ``flattened_bucket`` payload: one tensor and the records to slice it.

    The records are ``types.SimpleNamespace`` (SGLang's receiver reads them by attribute and its
    ``SafeUnpickler`` admits ``types.``), so the sender needs no SGLang installed. A payload is made
    for each push: each dump records a fresh CUDA event and reference count for the handle.
    """
    return _dump({"flattened_tensor": bucket.buffer, "metadata": list(bucket.metadata)})


class TensorBuckets:
    """Flat buffers for pushing tensors bucket by bucket (``load_format="flattened_bucket"``).

    ``pack(named_tensors)`` copies the tensors into buffers of at most ``max_bytes`` each (a larger
    tensor gets a bucket of its own; a device change starts a new bucket), on the tensors' own
    device, and returns the buckets. The buffers are allocated on the first call and reused while
    the layout (names, shapes, dtypes, devices) stays the same; a new layout gets new buffers.
    ``dtype`` casts floating-point tensors while copying (a float32 trainer pushing bfloat16).

    The buckets of one ``pack`` are overwritten by the next: push them first. An engine that has
    answered a push no longer reads the buffer (torch's CUDA-IPC receiver synchronises its stream
    before it releases a shared storage; ``torch/csrc/StorageSharing.cpp``).
    """

    def __init__(self, max_bytes: int = DEFAULT_BUCKET_BYTES, *, dtype: Any = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise InvalidRequest("max_bytes", f"must be an int >= 1, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.dtype = dtype
        self._layout: tuple[tuple[str, tuple[int, ...], Any, Any], ...] | None = None
        self._buckets: list[FlatBucket] = []
        self._dst: list[list[Any]] = []  # per bucket: the slot views the tensors are copied into

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by the buffers (0 before the first ``pack`` and after ``release``)."""
        return sum(int(b.buffer.numel()) for b in self._buckets)

    def release(self) -> None:
        """Drop the buffers (the next ``pack`` allocates again)."""
        self._layout, self._buckets, self._dst = None, [], []

    def pack(self, named_tensors: Iterable[tuple[str, Any]]) -> list[FlatBucket]:
        """Copy ``named_tensors`` into the buffers; the buckets, in the tensors' order."""
        import torch

        items = _pairs(named_tensors)
        if not items:
            raise InvalidRequest("named_tensors", "must not be empty")
        layout = tuple((n, tuple(t.shape), self._dtype_of(t), t.device) for n, t in items)
        if layout != self._layout:
            self._plan(layout)
        with torch.no_grad():
            start = 0
            for dst in self._dst:
                src = [t.detach() for _, t in items[start : start + len(dst)]]
                torch._foreach_copy_(dst, src)  # one multi-tensor kernel (per chunk), casting if asked
                start += len(dst)
        return list(self._buckets)

    def _dtype_of(self, t: Any) -> Any:
        return self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype

    def _plan(self, layout: Sequence[tuple[str, tuple[int, ...], Any, Any]]) -> None:
        import torch

        names = [n for n, *_ in layout]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise InvalidRequest("named_tensors", f"tensor {dup!r} given twice")
        groups: list[tuple[Any, list[_Slot]]] = []
        end = 0
        for name, shape, dtype, device in layout:
            size = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            start = -(-end // _ALIGN) * _ALIGN
            if not groups or groups[-1][0] != device or (start + size > self.max_bytes and groups[-1][1]):
                groups.append((device, []))
                start = 0
            groups[-1][1].append(_Slot(name, shape, dtype, start, start + size))
            end = start + size
        self.release()
        for device, slots in groups:
            bucket = FlatBucket.over(torch.empty(slots[-1].end, dtype=torch.uint8, device=device), slots)
            self._buckets.append(bucket)
            self._dst.append([t for _, t in bucket.views()])
        self._layout = tuple(layout)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- decoding (the engines' side: our reference engine, the Miles facade) ---------------------------


def decode_tensor_payload(data: str, load_format: str | None = None) -> list[tuple[str, Any]]:
    """One TP rank's ``serialized_named_tensors`` entry -> ``[(name, tensor), ...]``.

    ``load_format`` ``None`` or ``"direct"``: a list of pairs; ``"flattened_bucket"``: a flat bucket
    (ours, or SGLang's own records as Miles sends them), returned as views into its buffer. Any
    other load format, or a payload that is not one of these, is an ``InvalidRequest``.
    """
    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions

    if load_format not in (*_PAIR_FORMATS, FLATTENED_BUCKET):
        known = "null, 'direct' or 'flattened_bucket'"
        raise InvalidRequest("load_format", f"{load_format!r} is not supported (use {known})")
    if not isinstance(data, str):
        raise InvalidRequest("serialized_named_tensors", f"entries must be strings, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
        obj = _TorchOnlyUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:
        raise InvalidRequest("serialized_named_tensors", f"not a valid tensor payload: {exc}") from exc
    if load_format == FLATTENED_BUCKET:
        return _unflatten(obj)
    if not isinstance(obj, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in obj
    ):
        raise InvalidRequest("serialized_named_tensors", "must decode to a list of (name, tensor) pairs")
    return obj


def deserialize_named_tensors(data: str) -> list[tuple[str, Any]]:
    """The inverse of :func:`serialize_named_tensors`; only torch objects are unpickled."""
    return decode_tensor_payload(data, None)


def _unflatten(obj: object) -> list[tuple[str, Any]]:
    import torch

    field = "serialized_named_tensors"
    flat = obj.get("flattened_tensor") if isinstance(obj, dict) else None
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not isinstance(metadata, list):
        raise InvalidRequest(field, "a flattened_bucket payload is {'flattened_tensor': 1-D tensor, 'metadata': [...]}")
    # Sliced in the buffer's own elements, as SGLang's FlattenedTensorBucket does: bytes for a
    # uint8 buffer (ours, SGLang >= multi-dtype buckets), elements for one dtype per bucket.
    out: list[tuple[str, Any]] = []
    for i, m in enumerate(metadata):
        try:
            name, shape, dtype, start, end = m.name, tuple(m.shape), m.dtype, int(m.start_idx), int(m.end_idx)
            if not isinstance(name, str) or not isinstance(dtype, torch.dtype) or not 0 <= start <= end <= flat.numel():
                raise ValueError(f"bad record {vars(m)!r}")
            out.append((name, flat[start:end].view(dtype).view(shape)))
        except Exception as exc:
            raise InvalidRequest(f"{field}.metadata[{i}]", f"does not describe a tensor of the bucket: {exc}") from exc
    return out
