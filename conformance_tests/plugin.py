"""pytest plugin (entry point ``pytest11``): run the conformance suite on backends given by URL.

    pytest --pyargs rollout_backends.conformance --rb-backend sglang://127.0.0.1:30000 \\
        --rb-alt-weights /ckpt/other --rb-base-weights /ckpt/served

Every check runs on every ``--rb-backend`` (``test_contract[<url>-<check>]``); a check the backend
does not declare, or that lacks a harness hook, is a pytest *skip* with the reason. ``test_parity``
compares all backends (and transformers, with ``--rb-hf-model``). Harness hooks come from
``--rb-harness module:function`` (``function(url) -> Harness``), else are derived for
``reference://`` URLs, else are empty; the ``--rb-*`` options below override single fields.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["backend_urls", "harness_for", "selected_checks"]

_CONFIG: Any = None
_RESULTS: list[str] = []

_OVERRIDES: dict[str, tuple[str, Callable[[str], Any]]] = {
    # option dest -> (Harness field, parser)
    "rb_alt_weights": ("alt_weights_path", str),
    "rb_base_weights": ("base_weights_path", str),
    "rb_hf_model": ("hf_model_path", str),
    "rb_concurrency": ("concurrency", int),
    "rb_logprob_tol": ("logprob_tolerance", float),
    "rb_hf_tol": ("hf_logprob_tolerance", float),
    "rb_vocab_size": ("vocab_size", int),
    "rb_max_context": ("max_context", int),
    "rb_check_timeout": ("check_timeout_s", float),
}


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("rollout-backends")
    group.addoption(
        "--rb-backend",
        action="append",
        default=[],
        metavar="URL",
        help="backend URL to run the rollout-backends conformance suite against (repeatable)",
    )
    group.addoption(
        "--rb-check",
        action="append",
        default=[],
        metavar="PATTERN",
        help="run only these checks: a name, an fnmatch pattern or a group (repeatable)",
    )
    group.addoption(
        "--rb-harness",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a function(url) -> rollout_backends.conformance.Harness giving the environment hooks",
    )
    group.addoption("--rb-alt-weights", default=None, metavar="DIR", help="checkpoint with other weights")
    group.addoption("--rb-base-weights", default=None, metavar="DIR", help="the served weights, to restore")
    group.addoption("--rb-hf-model", default=None, metavar="DIR", help="HF model dir for transformers parity")
    group.addoption("--rb-concurrency", default=None, metavar="N", help="requests in the concurrency check")
    group.addoption("--rb-logprob-tol", default=None, metavar="F", help="|Δlogprob| tolerance, same weights")
    group.addoption("--rb-hf-tol", default=None, metavar="F", help="|Δlogprob| tolerance vs transformers")
    group.addoption("--rb-vocab-size", default=None, metavar="N", help="vocab size if the backend does not say")
    group.addoption("--rb-max-context", default=None, metavar="N", help="context length if the backend does not say")
    group.addoption("--rb-check-timeout", default=None, metavar="S", help="per-check time limit in seconds")


def pytest_configure(config: Any) -> None:
    global _CONFIG
    _CONFIG = config
    _RESULTS.clear()


def backend_urls(config: Any = None) -> list[str]:
    """The ``--rb-backend`` URLs of this session (empty outside pytest)."""
    config = config or _CONFIG
    if config is None:
        return []
    return list(config.getoption("rb_backend") or [])


def selected_checks(config: Any = None) -> list[Any]:
    from . import select_checks

    config = config or _CONFIG
    patterns = list(config.getoption("rb_check") or []) if config is not None else []
    return select_checks(patterns or None)


def _load(target: str) -> Callable[[str], Any]:
    module, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"--rb-harness wants MODULE:FUNCTION, got {target!r}")
    fn: Any = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    return fn  # type: ignore[no-any-return]


def harness_for(url: str, config: Any = None) -> Any:
    """The ``Harness`` for one backend URL: ``--rb-harness``, else derived (``reference://``), plus overrides."""
    from . import Harness

    config = config or _CONFIG
    target = config.getoption("rb_harness") if config is not None else None
    if target:
        harness = _load(target)(url)
    elif url.split("://", 1)[0].lower() == "reference":
        from ._reference import reference_harness

        harness = reference_harness(url)
    else:
        harness = Harness()
    changes: dict[str, Any] = {}
    if config is not None:
        for dest, (field, parse) in _OVERRIDES.items():
            value = config.getoption(dest)
            if value is not None:
                changes[field] = parse(value)
    return harness.replace(**changes) if changes else harness


def pytest_generate_tests(metafunc: Any) -> None:
    names = metafunc.fixturenames
    if "rb_backend_url" in names:
        urls = backend_urls(metafunc.config)
        metafunc.parametrize("rb_backend_url", urls, ids=urls)
    if "rb_check" in names:
        checks = selected_checks(metafunc.config)
        metafunc.parametrize("rb_check", checks, ids=[c.name for c in checks])


def record(line: str) -> None:
    """Add a line to the conformance section of the terminal summary."""
    _RESULTS.append(line)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _RESULTS:
        terminalreporter.section("rollout-backends conformance")
        for line in _RESULTS:
            terminalreporter.write_line(line)
