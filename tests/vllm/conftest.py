"""Fixtures of the vLLM adapter's CPU tests: fake vLLM 0.26 servers over the tiny model."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

import pytest

import rollout_backends as rb
from rollout_backends.adapters.reference import EngineError, ReferenceBackend, cached_tiny_model
from rollout_backends.conformance import BackendFactory, Harness
from tests.vllm.fake_vllm import FakeVllm, fake_vllm


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return cached_tiny_model(0)


@pytest.fixture(scope="session")
def tiny_model_b() -> Path:
    return cached_tiny_model(1)


@contextlib.asynccontextmanager
async def fake_fleet(model: Path, n: int, **kw: Any) -> AsyncIterator[tuple[list[FakeVllm], str]]:
    """``n`` fake servers: the fakes and a ``vllm://`` URL naming them all (no router)."""
    async with contextlib.AsyncExitStack() as stack:
        started = [await stack.enter_async_context(fake_vllm(model, **kw)) for _ in range(n)]
        hosts = [url.split("://", 1)[1] for _, url in started]
        yield [f for f, _ in started], f"vllm://{hosts[0]}?workers={','.join(hosts)}&initial_version=default"


def fake_harness(fakes: list[FakeVllm], served: Path, alt: Path, **changes: Any) -> Harness:
    """Every hook the fakes can serve: other weights, the oracle (a fresh reference engine: the
    fake's own arithmetic), held requests and failure injection seen on the fakes' engines."""

    def fresh_factory_on(path: str) -> BackendFactory:
        async def make() -> rb.RolloutBackend:
            return ReferenceBackend.create(path, workers=1)

        return make

    async def held_requests(backend: rb.RolloutBackend) -> Collection[str]:
        prefix = "generate-tokens-"
        return {rid.removeprefix(prefix) for f in fakes for rid in f.engine.request_ids}

    @contextlib.asynccontextmanager
    async def inject_failure(backend: rb.RolloutBackend, worker: str) -> AsyncIterator[None]:
        fake = next(f for f in fakes if f.url_id == worker)

        async def fail(*args: Any, **kwargs: Any) -> None:
            raise EngineError(f"{worker}: injected failure (vLLM fake)")

        fake.engine.update_weights_from_disk = fail  # type: ignore[method-assign]
        try:
            yield
        finally:
            del fake.engine.update_weights_from_disk

    harness = Harness(
        alt_weights_path=str(alt),
        base_weights_path=str(served),
        fresh_factory_on=fresh_factory_on,
        held_requests=held_requests,
        inject_failure=inject_failure,
        hf_model_path=str(served),
    )
    return harness.replace(**changes)
