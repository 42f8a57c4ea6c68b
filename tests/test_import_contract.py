"""The import contract (issue 15; REDESIGN-PLAN.md section 3.10), checked on the source text alone.

Nothing is imported: every ``.py`` file in scope is parsed and its ``import`` statements (module
level and function level alike) are resolved to absolute module names, with the folder-to-package
mapping of pyproject.toml (``adapters/`` is ``rollout_backends.adapters``, ``conformance_tests/`` is
``rollout_backends.conformance``) and the checkout's benchmarks (``bench/rb_bench/`` is ``rb_bench``,
never installed; any other ``.py`` under ``bench/`` is a script). The rules:

``public``
    Outside the core (``rollout_backends/*.py``), the core is reached only through its public doors
    ``rollout_backends``, ``rollout_backends.kit`` and ``rollout_backends.launch``, and another
    package only through a module path with no ``_`` segment. A name imported from a door must be
    in that door's ``__all__``.
``relative``
    A module imports its own package relatively (``from ._wire import SGLangWire``). An absolute
    import of one's own package names a path that file-based tools cannot follow (the adapters'
    folders are not their package paths). The exception is a pytest module (``test_*.py``):
    pytest imports it by file path, under a name it derives from the folders
    (``conformance_tests.test_conformance`` in a checkout), where a relative import would load a
    second copy of the package, with a plugin that never saw ``--rb-backend``.
``sibling``
    An adapter imports another adapter only relatively, only from that adapter's face (its
    ``__init__``), and only along ``ALLOWED_EDGES``. The conformance suite imports only the
    reference adapter (the harness it is validated against).
``cycle``
    No cycle between the packages (each adapter, each integration, ``ray``, the conformance suite).
``core``
    The core imports no adapter, integration, ``ray``, conformance or benchmark module: the
    registry and the CLI name them by string. Nothing in the installed package imports the
    benchmarks (``rb_bench``), which a wheel does not hold.

Not checked yet (later steps of the plan turn them on): first-party function-level imports
(rule 5), the one-``RolloutBackend``-implementation rule (rule 7, step B7). Rule 6, the pinned
``__all__`` of each door, is ``tests/test_public_api.py``.

``import_contract_baseline.txt`` lists today's known violations, each group with the step of the
plan that removes it. A new violation fails, and so does an entry that no longer occurs: the
baseline only shrinks. ``python tests/test_import_contract.py`` prints the current violations.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The import package each folder is installed as (pyproject.toml [tool.setuptools] package-dir).
PACKAGE_DIRS = {
    "rollout_backends": "rollout_backends",
    "rollout_backends.adapters": "adapters",
    "rollout_backends.conformance": "conformance_tests",
}
#: The benchmarks' package, run from the checkout (``PYTHONPATH=bench``), and its folder.
BENCH_DIRS = {"rb_bench": "bench/rb_bench"}
#: Example packages (a third party's adapter, installed from its own folder) and their folders.
EXAMPLE_DIRS = {"toy_adapter": "examples/toy_adapter/toy_adapter"}
#: Folders whose files obey the rules; tests are exempt.
SCOPE = ("rollout_backends", "adapters", "conformance_tests", "examples", "bench")

CORE = "rollout_backends"
BENCH = "rb_bench"
#: The core's public doors (``testing`` joins them in a later step).
CORE_DOORS = frozenset(
    {"rollout_backends", "rollout_backends.kit", "rollout_backends.launch", "rollout_backends.sglang_native"}
)
#: Adapter -> adapter imports that may exist (through the face, relatively).
ALLOWED_EDGES = frozenset({("reference", "sglang"), ("dynamo", "vllm")})
#: The only adapter the conformance suite may import.
CONFORMANCE_ADAPTERS = frozenset({"reference"})

_ADAPTERS = "rollout_backends.adapters"
_CONFORMANCE = "rollout_backends.conformance"
RULES = frozenset({"public", "relative", "sibling", "cycle", "core"})


@attrs.frozen(slots=True, order=True)
class Violation:
    file: str  #: relative to the checked root, with "/"
    module: str  #: the absolute module imported (``module.name`` where a name is at fault)
    rule: str


def module_of(rel: Path) -> str | None:
    """The import name of a file (``adapters/sglang/_wire.py`` -> ``rollout_backends.adapters.sglang._wire``);
    ``None`` outside a package (examples and probes are scripts)."""
    parts = rel.with_suffix("").parts
    for package, folder in {**PACKAGE_DIRS, **BENCH_DIRS, **EXAMPLE_DIRS}.items():
        if parts[: len(Path(folder).parts)] == Path(folder).parts:
            rest = parts[len(Path(folder).parts) :]
            names = [*package.split("."), *rest]
            if names[-1] == "__init__":
                names.pop()
            return ".".join(names)
    return None


def package_of(module: str) -> str:
    """The unit the rules reason about: one adapter, one integration, ``ray``, the conformance
    suite, the benchmarks, or the core (every top-level ``rollout_backends`` module)."""
    parts = module.split(".")
    if parts[0] != CORE or len(parts) == 1:
        return parts[0]
    if parts[1] in ("adapters", "integrations"):
        return ".".join(parts[:3])
    if parts[1] in ("ray", "conformance"):
        return ".".join(parts[:2])
    return CORE


def _adapter_name(package: str) -> str | None:
    parts = package.split(".")
    return parts[2] if len(parts) == 3 and package.startswith(_ADAPTERS + ".") else None


def _literal_all(tree: ast.Module) -> frozenset[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            return frozenset(value)
    return None


@attrs.frozen(slots=True)
class _Import:
    module: str  #: absolute target module
    names: tuple[str, ...]  #: names taken from it (``()`` for ``import x.y`` or a submodule)
    relative: bool


@attrs.frozen(slots=True)
class Tree:
    """The parsed files in scope under ``root``."""

    root: Path
    files: dict[str, tuple[str, ast.Module]]  #: relative path -> (module name, "" for a script; tree)
    modules: dict[str, str]  #: module name -> relative path

    @classmethod
    def read(cls, root: Path) -> Tree:
        files: dict[str, tuple[str, ast.Module]] = {}
        modules: dict[str, str] = {}
        for top in SCOPE:
            for path in sorted((root / top).rglob("*.py")):
                rel = path.relative_to(root)
                if any((root / Path(*rel.parts[:i])).is_symlink() for i in range(1, len(rel.parts) + 1)):
                    continue  # a staging link (adapters/ linked under rollout_backends/), not source
                module = module_of(rel)
                tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(rel))
                files[rel.as_posix()] = (module or "", tree)
                if module is not None:
                    modules[module] = rel.as_posix()
        return cls(root, files, modules)

    def imports(self, rel: str) -> Iterator[_Import]:
        module, tree = self.files[rel]
        is_package = rel.endswith("__init__.py")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield _Import(alias.name, (), relative=False)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    if not module:
                        raise AssertionError(f"{rel}: a relative import outside any package")
                    base = module.split(".")
                    keep = len(base) - node.level + (1 if is_package else 0)
                    target = ".".join([*base[:keep], *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                names: list[str] = []
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in self.modules or (target == "" and alias.name in self.modules):
                        yield _Import(sub, (), relative=bool(node.level))  # ``from pkg import _module``
                    else:
                        names.append(alias.name)
                if names:
                    yield _Import(target, tuple(names), relative=bool(node.level))

    def exported(self, module: str) -> frozenset[str] | None:
        rel = self.modules.get(module)
        return None if rel is None else _literal_all(self.files[rel][1])


def _private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split(".")[1:])


def _bad_names(tree: Tree, imp: _Import) -> Iterator[str]:
    exported = tree.exported(imp.module)
    for name in imp.names:
        if exported is None:
            bad = name == "*" or (name.startswith("_") and not name.startswith("__"))
        else:
            bad = name not in exported
        if bad:
            yield name


def check(root: Path) -> set[Violation]:
    """Every violation of the contract in the tree under ``root``."""
    tree = Tree.read(root)
    found: set[Violation] = set()
    edges: dict[tuple[str, str], set[tuple[str, str]]] = {}  # (from, to) package -> {(file, module)}
    for rel, (module, _) in tree.files.items():
        own = package_of(module) if module else None
        for imp in tree.imports(rel):
            if imp.module.split(".")[0] not in (CORE, BENCH):
                continue  # stdlib or third party
            target = package_of(imp.module)

            def report(rule: str, what: str = imp.module, rel: str = rel) -> None:
                found.add(Violation(rel, what, rule))

            if own == CORE:
                if target != CORE:
                    report("core")
                continue
            if target == BENCH and not rel.startswith(BENCH_DIRS[BENCH].split("/")[0] + "/"):
                report("core")  # the installed package (or an example) needs what a wheel does not hold
                continue
            if own is not None and target == own:
                if not imp.relative and not Path(rel).name.startswith("test_"):
                    report("relative")
                continue
            if own is not None and target != CORE:
                edges.setdefault((own, target), set()).add((rel, imp.module))
            src_adapter, dst_adapter = (_adapter_name(own) if own else None), _adapter_name(target)
            if src_adapter is not None and dst_adapter is not None:
                if (
                    not imp.relative
                    or imp.module != target
                    or (src_adapter, dst_adapter) not in ALLOWED_EDGES
                    or any(_bad_names(tree, imp))
                ):
                    report("sibling")
                continue
            if own == _CONFORMANCE and dst_adapter is not None and dst_adapter not in CONFORMANCE_ADAPTERS:
                report("sibling")
                continue
            private = imp.module not in CORE_DOORS if target == CORE else _private(imp.module)
            if private:
                report("public")
                continue
            for name in _bad_names(tree, imp):
                report("public", f"{imp.module}.{name}")
    for (src, dst), sites in edges.items():
        if _reaches(edges, dst, src):
            for rel, module in sites:
                found.add(Violation(rel, module, "cycle"))
    return found


def _reaches(edges: Iterable[tuple[str, str]], start: str, goal: str) -> bool:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    seen, todo = {start}, [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        for nxt in graph.get(node, set()) - seen:
            seen.add(nxt)
            todo.append(nxt)
    return False


#: Today's known violations, one per line: file, imported module, rule.
BASELINE_FILE = Path(__file__).with_name("import_contract_baseline.txt")


def read_baseline(path: Path = BASELINE_FILE) -> frozenset[Violation]:
    out: set[Violation] = set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        assert len(fields) == 3, f"{path.name}:{n}: expected 'file module rule', got {line!r}"
        assert fields[2] in RULES, f"{path.name}:{n}: unknown rule {fields[2]!r}"
        entry = Violation(*fields)
        assert entry not in out, f"{path.name}:{n}: listed twice"
        out.add(entry)
    return frozenset(out)


def test_pyproject_maps_the_folders_as_the_checker_does() -> None:
    tomllib = pytest.importorskip("tomllib")  # 3.11+; the mapping is the same on 3.10
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["package-dir"] == PACKAGE_DIRS


def test_the_checker_reads_the_whole_tree() -> None:
    tree = Tree.read(ROOT)
    # Enough to notice a scope that silently matches nothing (a renamed folder, a wrong root).
    assert "rollout_backends.adapters.sglang._wire" in tree.modules
    assert "rollout_backends.conformance._core" in tree.modules
    assert "rollout_backends.integrations.miles._facade" in tree.modules
    assert "examples/multinode/ray_fleet.py" in tree.files
    assert "rb_bench.fanout" in tree.modules and "rb_bench.gpu_tier" in tree.modules
    assert sum(1 for rel in tree.files for _ in tree.imports(rel)) > 500


def test_no_new_violations() -> None:
    new = sorted(check(ROOT) - read_baseline())
    assert not new, "imports that break the contract (see this file's docstring):\n" + "\n".join(map(str, new))


def test_baseline_has_no_fixed_entries() -> None:
    fixed = sorted(read_baseline() - check(ROOT))
    assert not fixed, f"fixed: delete these from {BASELINE_FILE.name}:\n" + "\n".join(map(str, fixed))


# -- the checker can fail: one small tree per rule, with exactly that violation ---------------------

_FACES = {
    "rollout_backends/__init__.py": '__all__ = ["Generation"]\nfrom ._types import Generation\n',
    "rollout_backends/_types.py": "class Generation: ...\n",
    "rollout_backends/kit.py": '__all__ = ["Worker"]\nfrom ._types import Generation as Worker\n',
    "rollout_backends/launch.py": "__all__ = []\n",
    "adapters/__init__.py": "",
    "adapters/sglang/__init__.py": '__all__ = ["Cmd"]\nfrom ._launch import Cmd\n',
    "adapters/sglang/_launch.py": "class Cmd: ...\n",
    "adapters/sglang/_wire.py": "from rollout_backends import Generation\n",
    "adapters/reference/__init__.py": '__all__ = ["Engine"]\nfrom ._engine import Engine\n',
    "adapters/reference/_engine.py": "from ..sglang import Cmd\nclass Engine: ...\n",
    "adapters/dynamo/__init__.py": '__all__ = ["Wire"]\nfrom ._wire import Wire\n',
    "adapters/dynamo/_wire.py": "from rollout_backends.kit import Worker\nclass Wire: ...\n",
    "conformance_tests/__init__.py": '__all__ = ["Check"]\nfrom ._core import Check\n',
    "conformance_tests/_core.py": "from ..adapters.reference import Engine\nclass Check: ...\n",
    "conformance_tests/test_suite.py": "from rollout_backends.conformance import Check\n",
    "rollout_backends/ray/__init__.py": "import rollout_backends.launch\n",
    "examples/demo.py": "import rollout_backends\nfrom rollout_backends.adapters.sglang import Cmd\n",
}

#: (file, its extra line, the one violation it must produce)
_BREACHES = {
    "private core module": (
        "adapters/dynamo/_wire.py",
        "from rollout_backends._types import Generation",
        {Violation("adapters/dynamo/_wire.py", "rollout_backends._types", "public")},
    ),
    "name not in the door's __all__": (
        "rollout_backends/ray/_fleet.py",
        "from rollout_backends.kit import Generation",
        {Violation("rollout_backends/ray/_fleet.py", "rollout_backends.kit.Generation", "public")},
    ),
    "private module of another package": (
        "examples/demo.py",
        "from rollout_backends.adapters.sglang._launch import Cmd",
        {Violation("examples/demo.py", "rollout_backends.adapters.sglang._launch", "public")},
    ),
    "private module of another package, as a name": (
        "examples/demo.py",
        "from rollout_backends.adapters.sglang import _wire",
        {Violation("examples/demo.py", "rollout_backends.adapters.sglang._wire", "public")},
    ),
    "own package by absolute path": (
        "adapters/sglang/_wire.py",
        "from rollout_backends.adapters.sglang._launch import Cmd",
        {Violation("adapters/sglang/_wire.py", "rollout_backends.adapters.sglang._launch", "relative")},
    ),
    "own package by absolute path, in a function": (
        "conformance_tests/_core.py",
        "def f() -> None:\n    from rollout_backends.conformance import Check",
        {Violation("conformance_tests/_core.py", "rollout_backends.conformance", "relative")},
    ),
    "another adapter's private module": (
        "adapters/dynamo/_wire.py",
        "from ..sglang._launch import Cmd",
        {Violation("adapters/dynamo/_wire.py", "rollout_backends.adapters.sglang._launch", "sibling")},
    ),
    "another adapter by absolute path": (
        "adapters/reference/_engine.py",
        "from rollout_backends.adapters.sglang import Cmd as C2",
        {Violation("adapters/reference/_engine.py", "rollout_backends.adapters.sglang", "sibling")},
    ),
    "an edge between adapters that is not allowed": (
        "adapters/dynamo/_wire.py",
        "from ..reference import Engine",
        {Violation("adapters/dynamo/_wire.py", "rollout_backends.adapters.reference", "sibling")},
    ),
    "conformance importing an adapter other than the reference": (
        "conformance_tests/_core.py",
        "from ..adapters.dynamo import Wire",
        {Violation("conformance_tests/_core.py", "rollout_backends.adapters.dynamo", "sibling")},
    ),
    "a cycle between packages": (
        "adapters/reference/__init__.py",
        "from rollout_backends.conformance import Check",
        {
            Violation("adapters/reference/__init__.py", "rollout_backends.conformance", "cycle"),
            Violation("conformance_tests/_core.py", "rollout_backends.adapters.reference", "cycle"),
        },
    ),
    "the core importing an adapter": (
        "rollout_backends/_types.py",
        "def f() -> None:\n    from rollout_backends.adapters.reference import Engine",
        {Violation("rollout_backends/_types.py", "rollout_backends.adapters.reference", "core")},
    ),
    "the core importing the benchmarks": (
        "rollout_backends/_types.py",
        "def f() -> None:\n    from rb_bench import fanout",
        {Violation("rollout_backends/_types.py", "rb_bench", "core")},
    ),
    "the installed conformance suite importing the benchmarks": (
        "conformance_tests/_core.py",
        "from rb_bench.stats import judge",
        {Violation("conformance_tests/_core.py", "rb_bench.stats", "core")},
    ),
    "an example importing the benchmarks": (
        "examples/demo.py",
        "import rb_bench",
        {Violation("examples/demo.py", "rb_bench", "core")},
    ),
    "a benchmark reaching a private core module": (
        "bench/rb_bench/fanout.py",
        "from rollout_backends._types import Generation",
        {Violation("bench/rb_bench/fanout.py", "rollout_backends._types", "public")},
    ),
    "a benchmark importing its own package by absolute path": (
        "bench/rb_bench/fanout.py",
        "from rb_bench.stats import judge",
        {Violation("bench/rb_bench/fanout.py", "rb_bench.stats", "relative")},
    ),
    "a probe reaching an adapter's private module": (
        "bench/probes/detok.py",
        "from rollout_backends.adapters.sglang._launch import Cmd",
        {Violation("bench/probes/detok.py", "rollout_backends.adapters.sglang._launch", "public")},
    ),
}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_tree_that_keeps_the_contract_passes(tmp_path: Path) -> None:
    _write(tmp_path, _FACES)
    assert check(tmp_path) == set()


@pytest.mark.parametrize("breach", sorted(_BREACHES))
def test_each_rule_catches_its_breach(tmp_path: Path, breach: str) -> None:
    rel, line, expected = _BREACHES[breach]
    files = dict(_FACES)
    files[rel] = files.get(rel, "") + line + "\n"
    _write(tmp_path, files)
    assert check(tmp_path) == expected


def test_the_benchmarks_may_use_the_library_through_its_doors(tmp_path: Path) -> None:
    files = dict(_FACES)
    files["bench/rb_bench/__init__.py"] = "def with_bench_path() -> None: ...\n"
    files["bench/rb_bench/stats.py"] = "def judge() -> None: ...\n"
    files["bench/rb_bench/fanout.py"] = (
        "from rollout_backends import Generation\nfrom rollout_backends.adapters.sglang import Cmd\n"
        "from . import with_bench_path\nfrom .stats import judge\n"
    )
    files["bench/probes/probe.py"] = "import rollout_backends\nfrom rb_bench.stats import judge\n"
    _write(tmp_path, files)
    assert check(tmp_path) == set()


if __name__ == "__main__":  # prints the current violations (to write the baseline after a fix)
    for v in sorted(check(ROOT)):
        print(f"{v.file}  {v.module}  {v.rule}")
    sys.exit(0)
