"""The distribution maps adapters/ and conformance_tests/ into rollout_backends.*, editable and wheel alike;
the benchmarks (bench/) stay in the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.util, json, sys
import rollout_backends, rollout_backends.adapters.sglang, rollout_backends.adapters.reference
import rollout_backends.adapters.dynamo, rollout_backends.conformance
print(json.dumps({
    "adapters": importlib.util.find_spec("adapters") is not None,
    "conformance_tests": importlib.util.find_spec("conformance_tests") is not None,
    "sglang_file": rollout_backends.adapters.sglang.__file__,
    "typed": __import__("pathlib").Path(rollout_backends.__file__).with_name("py.typed").exists(),
}))
"""


def _probe(env_path: str | None, cwd: Path) -> dict[str, object]:
    import json
    import os

    env = dict(os.environ)
    if env_path is not None:
        env["PYTHONPATH"] = env_path
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_editable_install_imports_mapped_packages(tmp_path: Path) -> None:
    # Run from elsewhere so the repo root is not on sys.path by accident.
    info = _probe(None, tmp_path)
    assert info["adapters"] is False and info["conformance_tests"] is False
    assert str(info["sglang_file"]).startswith(str(ROOT / "adapters"))
    assert info["typed"] is True


@pytest.mark.slow
def test_wheel_contains_only_rollout_backends_and_imports(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    # setuptools builds in the checkout's build/: a stale build/lib from before a module was moved
    # or deleted would still be copied into the wheel.
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("rollout_backends-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert all(t == "rollout_backends" or t.endswith(".dist-info") for t in top), top
    assert "rollout_backends/adapters/sglang/_wire.py" in names
    assert "rollout_backends/conformance/plugin.py" in names
    assert "rollout_backends/py.typed" in names
    assert any(n.startswith("rollout_backends/adapters/reference/data/") for n in names)
    # The product is the library: no benchmark, probe or GPU-tier orchestration is installed.
    bench = [n for n in names if any(part in n for part in ("_bench", "rb_bench", "gpu_tier", "smg_probe", "probes/"))]
    assert not bench, bench
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    # Dependencies (attrs, aiohttp, ...) come from this environment; the package only from the wheel.
    deps = [p for p in sys.path if p.endswith("site-packages")]
    info = _probe(":".join([str(target), *deps]), tmp_path)
    assert str(info["sglang_file"]).startswith(str(target))
    assert info["adapters"] is False and info["conformance_tests"] is False
