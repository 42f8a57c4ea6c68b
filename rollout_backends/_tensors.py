"""In-memory tensor hand-over in SGLang's format (``MultiprocessingSerializer``).

A payload is ``base64(ForkingPickler.dumps([(name, tensor), ...]))``: CUDA tensors travel as
CUDA-IPC handles, CPU tensors as shared memory, so the bytes are small and the tensors must stay
alive in the sender until the receiver has loaded them (the call returns). Decoding accepts only
what ForkingPickler emits for tensors (like SGLang's ``SafeUnpickler``).
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Sequence
from typing import Any, ClassVar

from rollout_backends._errors import InvalidRequest

__all__ = ["deserialize_named_tensors", "serialize_named_tensors"]


class _TorchOnlyUnpickler(pickle.Unpickler):
    """Like SGLang's ``SafeUnpickler``: only what ForkingPickler emits for tensors may be loaded."""

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
        }
    )

    def find_class(self, module: str, name: str) -> Any:
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


def serialize_named_tensors(named_tensors: Sequence[tuple[str, Any]]) -> str:
    """``MultiprocessingSerializer.serialize(named_tensors, output_str=True)``: base64 of a ForkingPickler dump.

    CPU tensors travel as shared memory; across unrelated processes that needs the ``file_system``
    sharing strategy (``torch.multiprocessing.set_sharing_strategy("file_system")``), which this
    function sets. Keep the tensors alive until the HTTP call returns.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    if tmp.get_sharing_strategy() != "file_system":  # type: ignore[no-untyped-call]
        tmp.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    items = list(named_tensors)
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidRequest(f"named_tensors[{i}]", "must be a (name, tensor) pair")
        if not hasattr(item[1], "dtype") or not hasattr(item[1], "shape"):
            raise InvalidRequest(f"named_tensors[{i}]", f"{item[0]!r} is not a tensor")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(items)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(data: str) -> list[tuple[str, Any]]:
    """The inverse of :func:`serialize_named_tensors`; only torch objects are unpickled."""
    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions

    try:
        raw = base64.b64decode(data, validate=True)
        obj = _TorchOnlyUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:
        raise InvalidRequest("serialized_named_tensors", f"not a valid tensor payload: {exc}") from exc
    if not isinstance(obj, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in obj
    ):
        raise InvalidRequest("serialized_named_tensors", "must decode to a list of (name, tensor) pairs")
    return obj
