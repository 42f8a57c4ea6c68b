"""pytest plugin (entry point ``pytest11``): ``--rb-backend URL`` selects backends for the suite."""

from __future__ import annotations

from typing import Any


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("rollout-backends")
    group.addoption(
        "--rb-backend",
        action="append",
        default=[],
        metavar="URL",
        help="backend URL to run the rollout-backends conformance suite against (repeatable)",
    )
