"""The reference adapter: a deterministic in-process CPU engine with SGLang's control semantics.

``ReferenceEngine`` is one engine; ``ReferenceBackend`` is the ``RolloutBackend`` over N of them;
``make_tiny_model`` makes the seeded Qwen2 model they (and the GPU servers) load, and
``cached_tiny_model`` makes one once per seed under the cache directory; ``WeightSender``
is the trainer side of the gloo weight-update group; ``NoComputeEngine`` answers fixed tokens at
once with no model (``serve-reference --no-compute N``, for benchmarks). Importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "EngineError",
    "EngineHealth",
    "NoComputeEngine",
    "ReferenceBackend",
    "ReferenceEngine",
    "ReferenceServerCommand",
    "WeightSender",
    "cached_tiny_model",
    "free_port",
    "make_tiny_model",
    "open_from_url",
]

if TYPE_CHECKING:
    from ._backend import ReferenceBackend, cached_tiny_model, open_from_url
    from ._dist import WeightSender, free_port
    from ._engine import EngineError, EngineHealth, ReferenceEngine
    from ._launch import ReferenceServerCommand
    from ._model import make_tiny_model
    from ._no_compute import NoComputeEngine

_WHERE = {
    "ReferenceBackend": "_backend",
    "open_from_url": "_backend",
    "cached_tiny_model": "_backend",
    "WeightSender": "_dist",
    "free_port": "_dist",
    "EngineError": "_engine",
    "EngineHealth": "_engine",
    "ReferenceEngine": "_engine",
    "ReferenceServerCommand": "_launch",
    "make_tiny_model": "_model",
    "NoComputeEngine": "_no_compute",
}


def __getattr__(name: str) -> Any:
    # Lazy: the registry imports this package to find ``open_from_url`` without paying for torch.
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
