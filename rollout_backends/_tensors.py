"""In-memory tensor hand-over in SGLang's format (``MultiprocessingSerializer``).

A payload is ``base64(ForkingPickler.dumps([(name, tensor), ...]))``: CUDA tensors travel as
CUDA-IPC handles, CPU tensors as shared-memory handles, so the bytes are small and the tensors
must stay alive in the sender until the receiver has loaded them (the call returns).
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Sequence
from typing import Any

from rollout_backends._errors import InvalidRequest

__all__ = ["deserialize_named_tensors", "serialize_named_tensors"]

# What a payload may reference when unpickled: torch's rebuild functions and plain containers.
_ALLOWED_PREFIXES = ("torch.", "torch", "multiprocessing.", "collections")
_ALLOWED_BUILTINS = {"list", "tuple", "dict", "int", "float", "str", "bytes", "bool", "slice", "getattr"}


def serialize_named_tensors(named_tensors: Sequence[tuple[str, Any]]) -> str:
    """Serialise ``[(name, tensor), ...]`` for ``update_weights_from_tensor``."""
    from torch.multiprocessing.reductions import ForkingPickler  # type: ignore[attr-defined]

    items = list(named_tensors)
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidRequest(f"named_tensors[{i}]", "must be a (name, tensor) pair")
        if not hasattr(item[1], "dtype") or not hasattr(item[1], "shape"):
            raise InvalidRequest(f"named_tensors[{i}]", f"{item[0]!r} is not a tensor")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(items)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _ALLOWED_BUILTINS:
            return super().find_class(module, name)
        if module.startswith(_ALLOWED_PREFIXES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a tensor payload")


def deserialize_named_tensors(payload: str) -> list[tuple[str, Any]]:
    """Inverse of ``serialize_named_tensors``; refuses payloads that reference other code."""
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions)

    try:
        raw = base64.b64decode(payload, validate=True)
        items = _RestrictedUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:
        raise InvalidRequest("serialized_named_tensors", f"not a valid tensor payload: {exc}") from exc
    if not isinstance(items, list):
        raise InvalidRequest("serialized_named_tensors", "payload is not a list of (name, tensor)")
    return items
