"""Fixtures of the SGLang fleet tests: two seeded tiny models, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_backends.adapters.reference import make_tiny_model


@pytest.fixture(scope="session")
def model_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sgl-model-a"), seed=0)


@pytest.fixture(scope="session")
def model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes, different weights (seed 1): the "new checkpoint" of the update tests."""
    return make_tiny_model(tmp_path_factory.mktemp("sgl-model-b"), seed=1)
