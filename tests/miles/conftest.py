"""Fixtures for the Miles integration tests: a tokenizer, scripted and reference backends by URL."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import rollout_backends as rb
from rollout_backends.integrations.miles import close_backends
from tests.miles.scripted import ScriptedBackend

_BACKENDS: dict[str, Any] = {}
_COUNTER = itertools.count()


def _open(url: str, **_: Any) -> Any:
    return _BACKENDS[url]


rb.register_scheme("testbackend", _open)


def serve_backend(backend: Any) -> str:
    """A unique ``testbackend://`` URL that ``open_backend`` resolves to ``backend``."""
    url = f"testbackend://b{next(_COUNTER)}"
    _BACKENDS[url] = backend
    return url


@pytest.fixture(scope="session")
def model_dir() -> Any:
    from rollout_backends.adapters.reference._backend import cached_tiny_model

    return cached_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[ScriptedBackend, str]]:
    backend = ScriptedBackend()
    url = serve_backend(backend)
    yield backend, url
    await close_backends()


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from rollout_backends.integrations.miles import _generate

    monkeypatch.setattr(_generate, "RETRY_INTERVAL_S", 0.0)
    yield
