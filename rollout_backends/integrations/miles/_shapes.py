"""SGLang's ``update_weights_from_tensor`` payloads as Miles sends them, decoded to named tensors.

Shared by the facade server and the engine actor class. SGLang's ``/generate`` format lives in the
codec (``rollout_backends.sglang_native``), which the facade and the generate function use.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

from rollout_backends import InvalidRequest

__all__ = ["decode_tensor_payload"]

# -- update_weights_from_tensor payloads ---------------------------------------------------------


class _FlattenedTensorMetadata:
    """Stands in for ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` when unpickling
    (a dataclass: name, shape, dtype, start_idx, end_idx, numel)."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


_SGLANG_CLASSES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): _FlattenedTensorMetadata,
}
_ALLOWED_BUILTINS = {"list", "tuple", "dict", "int", "float", "str", "bytes", "bool", "slice", "getattr"}
_ALLOWED_PREFIXES = ("torch.", "torch", "multiprocessing.", "collections")


class _PayloadUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        stand_in = _SGLANG_CLASSES.get((module, name))
        if stand_in is not None:
            return stand_in
        if (module == "builtins" and name in _ALLOWED_BUILTINS) or module.startswith(_ALLOWED_PREFIXES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a tensor payload")


def _unflatten(bucket: Mapping[str, Any]) -> list[tuple[str, Any]]:
    flat = bucket.get("flattened_tensor")
    metadata = bucket.get("metadata")
    if flat is None or not isinstance(metadata, list):
        raise InvalidRequest("serialized_named_tensors", "flattened_bucket payload lacks flattened_tensor/metadata")
    out: list[tuple[str, Any]] = []
    for m in metadata:
        piece = flat[m.start_idx : m.end_idx]
        if piece.dtype != m.dtype:  # multi-dtype buckets are flattened as bytes
            piece = piece.view(m.dtype)
        out.append((str(m.name), piece.reshape(m.shape)))
    return out


def decode_tensor_payload(payload: str, load_format: str | None) -> list[tuple[str, Any]]:
    """One TP rank's ``serialized_named_tensors`` entry (SGLang's ``MultiprocessingSerializer``
    string) → ``[(name, tensor), ...]``. ``load_format`` ``None``/``"direct"`` is a list of pairs;
    ``"flattened_bucket"`` is Miles' colocated bucket (unflattened here, so the backend gets plain
    named tensors). Any other load format is an ``InvalidRequest``."""
    import base64

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions for unpickling)

    if load_format not in (None, "direct", "flattened_bucket"):
        known = "null, 'direct' or 'flattened_bucket'"
        raise InvalidRequest("load_format", f"{load_format!r} is not supported (use {known})")
    if not isinstance(payload, str):
        raise InvalidRequest("serialized_named_tensors", f"entries must be strings, got {type(payload).__name__}")
    try:
        obj = _PayloadUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    except Exception as exc:
        raise InvalidRequest("serialized_named_tensors", f"not a valid tensor payload: {exc}") from exc
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict):
            raise InvalidRequest("serialized_named_tensors", "flattened_bucket payload is not a dict")
        return _unflatten(obj)
    if not isinstance(obj, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in obj):
        raise InvalidRequest("serialized_named_tensors", "payload is not a list of (name, tensor)")
    return [(str(n), t) for n, t in obj]
