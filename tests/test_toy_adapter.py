"""What adapter authors are given, kept green: the toy adapter passes the conformance suite (and
fails it with a planted bug), installs with its entry point and the ``conformance`` extra in a fresh
environment, the Wire skeleton in docs/adapters.md is the type-checked file, and the capability
table there names every ``Capabilities`` field with its default."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import tomllib

import rollout_backends as rb
from rollout_backends.conformance import Outcome, run_checks

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "toy_adapter"
DOC = ROOT / "docs" / "adapters.md"

#: What the toy declares, and so what must pass on it (a regression that only skipped them fails).
DECLARED = {
    "abort_one", "abort_all", "pause_abort", "pause_in_place", "resume_idempotent", "health_progress_probe",
    "health_paused_not_ready", "staleness_visible", "seeded_sampling", "concurrent_equals_sequential",
    "top_logprobs", "disk_update_matches_fresh", "stale_prefix_after_update", "update_failure_keeps_version",
    "unknown_exact_version_is_retryable", "min_version_after_partial_update", "version_spans_quiet",
    "greedy_logprob_bound", "reject_out_of_vocab", "reject_prompt_too_long",
}  # fmt: skip


@pytest.fixture
def toy() -> Iterator[Any]:
    sys.path.insert(0, str(EXAMPLE))
    try:
        import toy_adapter

        rb.register_scheme("toy", toy_adapter.open_from_url)
        yield toy_adapter
    finally:
        sys.path.remove(str(EXAMPLE))


async def test_the_toy_adapter_passes_the_conformance_suite(toy: Any) -> None:
    report = await run_checks(lambda: rb.open_backend("toy://?workers=2"), toy.harness(), label="toy")
    bad = [r.line() for r in report.results if r.outcome in (Outcome.FAIL, Outcome.ERROR)]
    assert not bad, "\n".join(bad)
    assert {r.name for r in report.passed} >= DECLARED, report.summary()
    # What it does not declare is skipped, saying so: never passed.
    skipped = {r.name: r.message for r in report.skipped}
    assert "not declared" in skipped["stream_matches_generate"] and "not declared" in skipped["pause_retract"]


async def test_the_suite_fails_the_toy_with_a_planted_bug(toy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A load that takes the new label but keeps the old weights.
    def load(self: Any, path: str, version: str | None) -> None:
        if version is not None:
            self.version = version

    monkeypatch.setattr(toy.ToyEngine, "load", load)
    report = await run_checks(
        lambda: rb.open_backend("toy://?workers=1"), toy.harness(), select=["disk_update_matches_fresh"]
    )
    assert report["disk_update_matches_fresh"].outcome is Outcome.FAIL, report.summary()


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.S)


def test_the_wire_skeleton_in_the_doc_is_the_type_checked_file() -> None:
    # tools/typecheck.sh runs mypy --strict over examples/my_wire.py; the doc shows it whole.
    skeleton = (ROOT / "examples" / "my_wire.py").read_text()
    section = DOC.read_text().split("## 1. An HTTP engine", 1)[1].split("\n## ", 1)[0]
    assert _python_blocks(section)[0] == skeleton
    tree = ast.parse(skeleton)
    wire = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MyWire")
    members = {n.name for n in wire.body if isinstance(n, ast.FunctionDef)}
    protocol = {n for n in rb.kit.Wire.__dict__ if not n.startswith("_")} - {"register"}
    assert protocol <= members, f"the skeleton lacks {protocol - members}"


def _default(field: attrs.Attribute[Any]) -> Any:
    default = field.default
    return default.factory() if isinstance(default, attrs.Factory) else default  # type: ignore[arg-type]


def _shown(value: Any) -> str:
    if isinstance(value, frozenset) and not value:
        return "frozenset()"
    if isinstance(value, rb.RoutingKind | rb.VersionSource):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def test_the_capability_table_has_every_field_and_its_default() -> None:
    section = DOC.read_text().split("## Capabilities: what declaring each one promises", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section, flags=re.M))
    fields = {f.name: _shown(_default(f)) for f in attrs.fields(rb.Capabilities)}
    assert rows == fields


def test_the_conformance_extra_holds_what_the_pytest_command_imports() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = {re.split(r"[<>=!\[ ]", r, maxsplit=1)[0] for r in project["optional-dependencies"]["conformance"]}
    assert {"pytest", "hypothesis"} <= extra
    base = {re.split(r"[<>=!\[ ]", r, maxsplit=1)[0] for r in project["dependencies"]}
    # Every third-party module the suite imports at the top of a module (what `pytest --pyargs
    # rollout_backends.conformance` loads) comes with the library or the extra.
    names = {"pytest": "pytest", "hypothesis": "hypothesis", "attrs": "attrs", "aiohttp": "aiohttp"}
    for path in (ROOT / "conformance_tests").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            for module in modules:
                top = module.split(".")[0]
                if top in ("rollout_backends", "__future__") or top in sys.stdlib_module_names:
                    continue
                assert names.get(top, top) in base | extra, f"{path.name} imports {top}: not in the conformance extra"


@pytest.mark.slow
def test_a_fresh_install_with_the_extra_runs_the_suite_on_the_toy(tmp_path: Path) -> None:
    # What an adapter author does: install the library with the extra and the adapter (its entry
    # point registers toy://), then run the suite's pytest command. No pytest but the extra's.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    install = [
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "-c",
        str(ROOT / "constraints" / "cpu.txt"),
    ]
    subprocess.run([*install, "-e", f"{ROOT}[conformance]", "-e", str(EXAMPLE)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run(
        [python, "-m", "pytest", "--pyargs", "rollout_backends.conformance", "-p", "no:cacheprovider", "-q",
         "--rb-backend", "toy://?workers=2", "--rb-harness", "toy_adapter:harness", "--rb-concurrency", "50"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert re.search(r"\b[3-9]\d passed", run.stdout), run.stdout[-1500:]  # 42 with the sampling checks
