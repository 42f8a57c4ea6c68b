"""A complete ``Harness`` for the reference backend, derived from a ``reference://`` URL.

``reference://?workers=2&seed=0`` serves the cached tiny model of seed 0; its harness uses the
tiny model of seed + 1 as the *other* weights, a fresh ``ReferenceBackend`` as the oracle, a gloo
``WeightSender`` for distributed updates, a patched engine for failure injection and the served
model directory for the transformers parity check. Every hook is filled, so on the reference
backend no check skips for want of a hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from rollout_backends import RolloutBackend, WeightGroup

from ._harness import BackendFactory, Harness, WeightSender

__all__ = ["reference_harness"]


def _options(url: str) -> tuple[Path | None, dict[str, str]]:
    parsed = urlparse(url)
    if parsed.scheme != "reference":
        raise ValueError(f"not a reference:// URL: {url!r}")
    opts = {k: v[-1] for k, v in parse_qs(parsed.query, keep_blank_values=True).items()}
    path = unquote(parsed.path)
    return (Path(path) if path else None), opts


def reference_harness(url: str, *, alt_seed: int | None = None, **changes: Any) -> Harness:
    """The harness for ``url`` (a ``reference://`` URL); ``changes`` override any field."""
    from ..adapters.reference import ReferenceBackend, cached_tiny_model, free_port
    from ..adapters.reference import WeightSender as GlooSender

    path, opts = _options(url)
    size = opts.get("size", "tiny")
    seed = int(opts.get("seed", "0"))
    threads = int(opts.get("num_threads", "1"))
    served = path if path is not None else cached_tiny_model(seed, size)
    alt = cached_tiny_model(seed + 1 if alt_seed is None else alt_seed, size)
    if alt.resolve() == Path(served).resolve():
        alt = cached_tiny_model(seed + 2, size)

    def fresh_factory_on(weights: str) -> BackendFactory:
        async def make() -> RolloutBackend:
            return ReferenceBackend.create(weights, workers=1, num_threads=threads)

        return make

    def make_sender(world_size: int) -> tuple[WeightGroup, WeightSender]:
        port = free_port()
        group = WeightGroup(master_address="127.0.0.1", master_port=port, world_size=world_size, backend="gloo")
        return group, GlooSender("127.0.0.1", port, world_size, group.group_name, timeout_s=60.0)

    @contextlib.asynccontextmanager
    async def inject_failure(backend: RolloutBackend, worker: str) -> AsyncIterator[None]:
        from ..adapters.reference import EngineError

        engine: Any = backend.engine(worker)  # type: ignore[attr-defined]
        names = ("update_weights_from_disk", "update_weights_from_tensors", "update_weights_from_distributed")

        async def fail(*args: Any, **kwargs: Any) -> None:
            raise EngineError(f"{worker}: injected failure (conformance harness)")

        for name in names:
            setattr(engine, name, fail)
        try:
            yield
        finally:
            for name in names:
                with contextlib.suppress(AttributeError):
                    delattr(engine, name)

    async def held_requests(backend: RolloutBackend) -> set[str]:
        return {rid for engine in backend.engines for rid in engine.request_ids}  # type: ignore[attr-defined]

    harness = Harness(
        held_requests=held_requests,
        alt_weights_path=str(alt),
        fresh_factory_on=fresh_factory_on,
        make_sender=make_sender,
        inject_failure=inject_failure,
        hf_model_path=str(served),
    )
    return harness.replace(**changes)
