"""pytest plugin (entry point ``pytest11``): run the conformance suite on backends given by URL.

    pytest --pyargs rollout_backends.conformance --rb-backend sglang://127.0.0.1:30000 \\
        --rb-alt-weights /ckpt/other --rb-base-weights /ckpt/served

Every check runs on every ``--rb-backend`` (``test_contract[<url>-<check>]``); ``test_parity[<a>~<b>]``
compares each pair of backends (and each with transformers, ``test_parity[<url>~transformers]``,
where the harness names an HF model). pytest's own outcomes keep the causes apart:

* **passed**: the backend kept the contract;
* **skipped**: a capability it does not declare, a harness hook not given, too few workers (the
  reason says which);
* **failed**: the backend broke the contract (in the test's call);
* **error** (at set-up): the setup, the harness or the check broke (the factory could not open
  the backend, a hook raised, the vocabulary size unknown and a prompt refused, a budget too small
  for the backend's speed): not a verdict on the backend.

The run ends with what was *not* checked and why. Harness hooks come from ``--rb-harness
module:object`` (a ``Harness``, or ``object(url) -> Harness``), else are derived for
``reference://`` URLs, else are empty; the ``--rb-*`` options below override single fields.
"""

from __future__ import annotations

import asyncio
import fnmatch
import importlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from rollout_backends import Generation, RolloutBackendError

from ._core import Check, CheckResult, Gap, Outcome, raised_by_backend, run_check, select_checks
from ._harness import Harness
from ._parity import default_parity_prompts, hf_parity, pair_parity, parity_outputs

__all__ = [
    "NO_PARITY",
    "ParityCase",
    "backend_urls",
    "harness_for",
    "judge",
    "keep",
    "not_checked",
    "parity_cases",
    "parity_selected",
    "run_contract",
    "run_parity",
    "selected_checks",
    "settle",
]

_CONFIG: Any = None
#: Every result of this session, in run order (the closing summary reads them).
_RESULTS: list[CheckResult] = []
_LINES: list[str] = []
#: Parity: the prompts (chosen on the first backend) and each URL's greedy outputs.
_PARITY: dict[str, Any] = {}

#: The name ``--rb-check`` selects the parity tests by (also through the group ``parity``).
PARITY = "parity"

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
        help="run only these checks: a name, an fnmatch pattern or a group (repeatable); 'parity' selects the "
        "parity tests",
    )
    group.addoption(
        "--rb-harness",
        default=None,
        metavar="MODULE:OBJECT",
        help="a rollout_backends.conformance.Harness, or a function(url) -> Harness, giving the environment hooks",
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
    _LINES.clear()
    _PARITY.clear()


def backend_urls(config: Any = None) -> list[str]:
    """The ``--rb-backend`` URLs of this session (empty outside pytest)."""
    config = config or _CONFIG
    if config is None:
        return []
    return list(config.getoption("rb_backend") or [])


def _patterns(config: Any) -> list[str]:
    return list(config.getoption("rb_check") or []) if config is not None else []


def _selects_parity(pattern: str) -> bool:
    return fnmatch.fnmatchcase(PARITY, pattern)


def selected_checks(config: Any = None) -> list[Check]:
    """The checks ``--rb-check`` selects (all without it); a pattern that selects nothing, not even
    the parity tests, raises ``ValueError`` (a typo would otherwise run nothing)."""
    config = config or _CONFIG
    patterns = _patterns(config)
    if not patterns:
        return select_checks(None)
    chosen: list[Check] = []
    for p in patterns:
        try:
            found = select_checks([p])
        except ValueError:
            if not _selects_parity(p):
                raise
            found = []
        chosen.extend(c for c in found if c not in chosen)
    return chosen


def parity_selected(config: Any = None) -> bool:
    config = config or _CONFIG
    patterns = _patterns(config)
    return not patterns or any(_selects_parity(p) for p in patterns)


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"--rb-harness wants MODULE:OBJECT, got {target!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def harness_for(url: str, config: Any = None) -> Harness:
    """The ``Harness`` for one backend URL: ``--rb-harness``, else derived (``reference://``), plus overrides."""
    config = config or _CONFIG
    target = config.getoption("rb_harness") if config is not None else None
    harness: Harness
    if target:
        given = _load(target)
        harness = given if isinstance(given, Harness) else given(url)
        if not isinstance(harness, Harness):
            raise TypeError(f"--rb-harness {target}: {url!r} gave {type(harness).__name__}, not a Harness")
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


@attrs.frozen
class ParityCase:
    """One parity test: backend ``a`` against backend ``b``, or against transformers (``b`` None)."""

    a: str
    b: str | None

    @property
    def id(self) -> str:
        return f"{self.a}~{self.b if self.b is not None else 'transformers'}"


def parity_cases(config: Any = None) -> list[ParityCase]:
    """Every pair of ``--rb-backend`` URLs, then each URL against transformers where its harness
    names an HF model (``--rb-hf-model``, or derived for ``reference://``)."""
    urls = backend_urls(config)
    cases = [ParityCase(a, b) for a, b in itertools.combinations(urls, 2)]
    for u in urls:
        try:
            hf = harness_for(u, config).hf_model_path
        except Exception:
            # A harness that cannot be built: every check of this URL reports it as an error;
            # collection goes on (an exception here would stop the whole run before any check).
            continue
        if hf is not None:
            cases.append(ParityCase(u, None))
    return cases


def pytest_generate_tests(metafunc: Any) -> None:
    names = metafunc.fixturenames
    if "rb_backend_url" in names:
        urls = backend_urls(metafunc.config)
        metafunc.parametrize("rb_backend_url", urls, ids=urls)
    if "rb_check" in names:
        checks = selected_checks(metafunc.config)
        metafunc.parametrize("rb_check", checks, ids=[c.name for c in checks])
    if "rb_parity_case" in names:
        cases: list[ParityCase | None] = list(parity_cases(metafunc.config))
        if not cases:
            metafunc.parametrize("rb_parity_case", [None], ids=["nothing-to-compare"])
        else:
            metafunc.parametrize("rb_parity_case", cases, ids=[c.id for c in cases if c is not None])


def record(line: str) -> None:
    """Add a line to the conformance section of the terminal summary."""
    _LINES.append(line)


def _factory(url: str) -> Any:
    import rollout_backends as rb

    async def make() -> rb.RolloutBackend:
        return await rb.open_backend(url)

    return make


def keep(result: CheckResult, *, backend: str | None = None) -> CheckResult:
    """Keep ``result`` for the closing summary (``backend``: the URL it is filed under)."""
    if backend is not None:
        result = attrs.evolve(result, backend=backend)
    _RESULTS.append(result)
    record(f"[{result.backend}] {result.line()}")
    return result


def run_contract(url: str, check: Check) -> CheckResult:
    """Run one check on ``url`` (its harness from ``harness_for``) and keep the result for the summary."""
    try:
        harness = harness_for(url)
    except Exception as exc:
        return keep(CheckResult(name=check.name, outcome=Outcome.ERROR, message=f"harness: {exc!r}", backend=url))
    return keep(asyncio.run(run_check(check, _factory(url), harness, label=url)))


# -- parity -----------------------------------------------------------------------------------

#: The skip reason where there is nothing to compare.
NO_PARITY = "parity needs two --rb-backend URLs, or a harness with hf_model_path (--rb-hf-model)"


@attrs.frozen
class _NoOutputs:
    """Why a backend gave no parity outputs: ``outcome`` FAIL (the backend's fault) or ERROR."""

    outcome: Outcome
    message: str


_Outputs = tuple[Generation, ...] | _NoOutputs


def _parity_prompts(urls: Sequence[str]) -> list[tuple[int, ...]]:
    """One prompt set for every backend: chosen within the first backend's vocabulary."""
    prompts: list[tuple[int, ...]] | None = _PARITY.get("prompts")
    if prompts is None:
        first = urls[0]
        harness = harness_for(first)

        async def vocab() -> int | None:
            backend = await asyncio.wait_for(_factory(first)(), harness.open_timeout_s)
            try:
                return backend.capabilities.vocab_size or harness.vocab_size
            finally:
                await backend.aclose()

        prompts = default_parity_prompts(asyncio.run(vocab()), low=harness.min_prompt_token)
        _PARITY["prompts"] = prompts
    return prompts


def _outputs(url: str, prompts: Sequence[tuple[int, ...]]) -> _Outputs:
    """``url``'s greedy generations of ``prompts`` (cold caches), computed once per session."""
    key = f"outputs:{url}"
    if key not in _PARITY:
        harness = harness_for(url)

        async def run() -> _Outputs:
            try:
                backend = await asyncio.wait_for(_factory(url)(), harness.open_timeout_s)
            except Exception as exc:
                return _NoOutputs(Outcome.ERROR, f"the backend factory failed: {type(exc).__name__}: {exc}")
            try:
                return await parity_outputs(backend, prompts, max_new_tokens=16)
            except Exception as exc:
                if isinstance(exc, RolloutBackendError) or raised_by_backend(exc, backend):
                    return _NoOutputs(Outcome.FAIL, f"{url}: backend raised {type(exc).__name__}: {exc}")
                return _NoOutputs(Outcome.ERROR, f"{url}: {type(exc).__name__}: {exc}")
            finally:
                await backend.aclose()

        _PARITY[key] = asyncio.run(run())
    got: _Outputs = _PARITY[key]
    return got


def run_parity(case: ParityCase | None) -> CheckResult:
    """One parity case (each backend's greedy outputs computed once per session), kept for the
    summary; ``None``: nothing to compare (a skip)."""
    urls = backend_urls()
    if case is None:
        skip = CheckResult(name=PARITY, outcome=Outcome.SKIP, message=NO_PARITY, gaps=((Gap.HARNESS, NO_PARITY),))
        return keep(skip, backend=urls[0] if urls else None)
    name = f"parity[{case.id}]"

    def error(message: str) -> CheckResult:
        return keep(CheckResult(name=name, outcome=Outcome.ERROR, message=message, backend=case.a))

    try:
        prompts = _parity_prompts(urls)
        a = _outputs(case.a, prompts)
        b = _outputs(case.b, prompts) if case.b is not None else ()
        harness = harness_for(case.a)
    except Exception as exc:
        return error(f"{type(exc).__name__}: {exc}")
    for got in (a, b):
        if isinstance(got, _NoOutputs):
            return keep(CheckResult(name=name, outcome=got.outcome, message=got.message, backend=case.a))
    assert not isinstance(a, _NoOutputs) and not isinstance(b, _NoOutputs)
    if case.b is not None:
        return keep(pair_parity(case.a, case.b, a, b, harness.logprob_tolerance).result(), backend=case.a)
    path = harness.hf_model_path
    assert path is not None
    try:
        hf = asyncio.run(hf_parity(case.a, path, prompts, a, harness.hf_logprob_tolerance))
    except Exception as exc:
        return error(f"transformers: {type(exc).__name__}: {exc}")
    return keep(hf.result(), backend=case.a)


# -- outcomes in pytest ---------------------------------------------------------------------


def settle(result: CheckResult) -> CheckResult:
    """In a fixture (pytest's set-up): a skip is a skip, an error an *error*, the rest is judged by the test."""
    import pytest

    if result.outcome is Outcome.SKIP:
        pytest.skip(result.message)
    if result.outcome is Outcome.ERROR:
        pytest.fail(
            f"not a verdict on the backend (setup, harness or check): {result.message}\n{result.traceback or ''}",
            pytrace=False,
        )
    return result


def judge(result: CheckResult) -> None:
    """In the test's call: a failure of the backend is a pytest failure."""
    import pytest

    if result.outcome is Outcome.FAIL:
        pytest.fail(f"{result.message}\n{result.traceback or ''}", pytrace=False)


# -- the closing summary ------------------------------------------------------------------------


def not_checked(results: Sequence[CheckResult]) -> list[str]:
    """What was not checked and why, per backend: skips grouped by what was missing, then errors."""
    error = "error (setup, harness or check; not a verdict on the backend)"
    order = [g.value for g in Gap] + [error]
    lines: list[str] = []
    by_backend: dict[str, list[CheckResult]] = {}
    for r in results:
        by_backend.setdefault(r.backend or "?", []).append(r)
    for backend, rs in by_backend.items():
        missed = [r for r in rs if r.outcome in (Outcome.SKIP, Outcome.ERROR)]
        if not missed:
            lines.append(f"[{backend}] every one of the {len(rs)} selected checks ran")
            continue
        lines.append(f"[{backend}] {len(missed)} of {len(rs)} selected checks not checked:")
        groups: dict[str, dict[str, list[str]]] = {}
        for r in missed:
            if r.outcome is Outcome.ERROR:
                first = r.message.splitlines()[0] if r.message else "(no message)"
                groups.setdefault(error, {}).setdefault(first, []).append(r.name)
                continue
            for gap, reason in r.gaps or ((Gap.CHECK, r.message),):
                groups.setdefault(gap.value, {}).setdefault(reason, []).append(r.name)
        for kind in sorted(groups, key=order.index):
            lines.append(f"  {kind}:")
            for reason, names in groups[kind].items():
                lines.append(f"    {reason}: {', '.join(names)}")
    return lines


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _LINES:
        terminalreporter.section("rollout-backends conformance")
        for line in _LINES:
            terminalreporter.write_line(line)
    if _RESULTS:
        terminalreporter.section("rollout-backends conformance: not checked")
        for line in not_checked(_RESULTS):
            terminalreporter.write_line(line)
