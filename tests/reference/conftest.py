"""Shared fixtures: two seeded tiny models (made once per session) and engine factories."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from rollout_backends.adapters.reference import ReferenceEngine, make_tiny_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model-a"), seed=0)


@pytest.fixture(scope="session")
def model_dir_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Different weights (seed 1), same shapes: the "new checkpoint" of the update tests."""
    return make_tiny_model(tmp_path_factory.mktemp("model-b"), seed=1)


@pytest.fixture(scope="session")
def short_context_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """Model A with a 32-token context, to test context limits cheaply."""
    out = tmp_path_factory.mktemp("model-short")
    for f in model_dir.iterdir():
        shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = 32
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., ReferenceEngine]]:
    made: list[ReferenceEngine] = []

    def factory(path: Path, **kw: Any) -> ReferenceEngine:
        engine = ReferenceEngine(path, **kw)
        made.append(engine)
        return engine

    yield factory
    for engine in made:
        await engine.aclose()


@pytest.fixture
async def engine(make_engine: Callable[..., ReferenceEngine], model_dir: Path) -> ReferenceEngine:
    return make_engine(model_dir)
