"""What the GPU benchmarks share: run metadata, Markdown sections, the output folder, progress lines.

An output folder holds at most a handful of files, all named ``[A-Za-z0-9._-]+``, directly in it:
``benchmarks.md`` (one section per benchmark, replaced in place when the benchmark runs again),
``results.json`` (one key per benchmark), one PNG per benchmark and one log archive per benchmark.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .overhead import machine

__all__ = [
    "MARKDOWN_NAME",
    "JSON_NAME",
    "write_outputs",
    "Progress",
    "check_name",
    "command_line",
    "git_commit",
    "gpu_info",
    "md_table",
    "meta",
    "pack_logs",
    "safe_multicast_env",
    "summarise_error",
    "update_json",
    "update_markdown",
    "versions",
]

MARKDOWN_NAME = "benchmarks.md"
JSON_NAME = "results.json"
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")

#: NVLink multicast stays off on the shared GPU hosts (and in every process we start from here).
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def safe_multicast_env() -> None:
    """Set the no-multicast variables in this process's environment (inherited by children)."""
    os.environ.update(_NO_MULTICAST)


def summarise_error(exc: BaseException, limit: int = 400) -> str:
    """``Type: first line`` of an error, plus its last line where that differs (a log tail's cause)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    if len(lines) > 1:
        text += f" … {lines[-1]}"
    return text[:limit]


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"output file name {name!r} must match [A-Za-z0-9._-]+")
    return name


class Progress:
    """``[  12.3s] message`` lines on stderr, timed from construction."""

    def __init__(self, prefix: str = "") -> None:
        self.t0 = time.monotonic()
        self.prefix = prefix

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {self.prefix}{message}", file=sys.stderr, flush=True)


# -- metadata --------------------------------------------------------------------------------------


def versions(packages: Iterable[str]) -> dict[str, str]:
    """``python`` and each distribution's installed version (``-`` where absent)."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "-"
    try:
        import rollout_backends

        out["rollout-backends"] = rollout_backends.__version__
    except ImportError:  # pragma: no cover - we are inside it
        pass
    return out


def git_commit() -> str | None:
    """The checkout's commit (``+dirty`` when it has changes); ``None`` outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_info() -> str:
    """``nvidia-smi``'s name, memory and driver of each GPU; ``none`` without one."""
    try:
        res = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return "none"
    lines = [line.strip() for line in res.stdout.splitlines() if line.strip()]
    if res.returncode != 0 or not lines:
        return "none"
    names: dict[str, int] = {}
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        key = ", ".join(parts[1:3]) + (f", driver {parts[3]}" if len(parts) > 3 else "")
        names[key] = names.get(key, 0) + 1
    return "; ".join(f"{n}x {k}" for k, n in names.items())


def command_line(prog: str, argv: Sequence[str] | None) -> str:
    args = list(argv) if argv is not None else sys.argv[1:]
    return " ".join([prog, *(shlex.quote(a) for a in args)])


def meta(prog: str, argv: Sequence[str] | None, packages: Iterable[str], started: float) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "machine": machine(),
        "gpu": gpu_info(),
        "versions": versions(packages),
        "commit": git_commit(),
        "command": command_line(prog, argv),
    }


def meta_lines(m: dict[str, Any]) -> list[str]:
    """The run's metadata as Markdown bullet lines."""
    v = ", ".join(f"{k} {val}" for k, val in m["versions"].items())
    lines = [
        f"- **Run:** {m['date']}, {m.get('duration_s', '?')} s; commit {m.get('commit') or 'unknown'}",
        f"- **Machine:** {m['machine']}; GPU: {m['gpu']}",
        f"- **Versions:** {v}",
        "- **Command:**",
        "",
        "  ```",
        f"  {m['command']}",
        "  ```",
    ]
    return lines


# -- tables ----------------------------------------------------------------------------------------


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A Markdown table; ``align`` has one ``l``/``r`` per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    sep = ["---" if a == "l" else "---:" for a in align]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(sep) + "|"]
    out += ["| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in r) + " |" for r in rows]
    return "\n".join(out)


# -- the output folder -----------------------------------------------------------------------------


def _markers(key: str) -> tuple[str, str]:
    return f"<!-- begin {key} -->", f"<!-- end {key} -->"


def update_markdown(out_dir: str | os.PathLike[str], key: str, body: str) -> Path:
    """Write ``body`` as the ``key`` section of ``<out_dir>/benchmarks.md`` (replacing an older one)."""
    path = Path(out_dir) / MARKDOWN_NAME
    begin, end = _markers(check_name(key))
    section = f"{begin}\n{body.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + section
    path.write_text(text)
    return path


def update_json(out_dir: str | os.PathLike[str], key: str, data: Any) -> Path:
    """Set ``key`` in ``<out_dir>/results.json`` (other keys are kept)."""
    path = Path(out_dir) / JSON_NAME
    current: dict[str, Any] = {}
    if path.exists():
        with contextlib.suppress(ValueError):
            loaded = json.loads(path.read_text())
            if isinstance(loaded, dict):
                current = loaded
    current[key] = data
    path.write_text(json.dumps(current, indent=1, default=str))
    return path


def pack_logs(
    out_path: str | os.PathLike[str], folders: Iterable[str | os.PathLike[str]], tail_bytes: int = 200_000
) -> int:
    """A ``.tar.gz`` of the last ``tail_bytes`` of every ``*.log`` under ``folders``; returns the count."""
    count = 0
    with tarfile.open(out_path, "w:gz") as tar:
        for k, folder in enumerate(folders):
            root = Path(folder)
            if not root.is_dir():
                continue
            for log in sorted(root.rglob("*.log")):
                try:
                    size = log.stat().st_size
                    with open(log, "rb") as f:
                        f.seek(max(0, size - tail_bytes))
                        data = f.read()
                except OSError:
                    continue
                info = tarfile.TarInfo(f"{k}-{root.name}/{log.relative_to(root)}")
                info.size = len(data)
                info.mtime = int(time.time())
                tar.addfile(info, io.BytesIO(data))
                count += 1
    return count


def write_outputs(
    out_dir: str | os.PathLike[str],
    key: str,
    *,
    plot: Callable[[str], bool],
    markdown: Callable[[str | None], str],
    data: Any,
    log_dirs: Sequence[str | os.PathLike[str]],
) -> None:
    """One benchmark's outputs in ``out_dir``: ``<key>.png`` (if ``plot(path)`` made it; matplotlib
    is optional), its section of ``benchmarks.md`` (``markdown(png_name or None)``), its key of
    ``results.json`` and ``<key>-logs.tar.gz``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = check_name(f"{key}.png")
    png: str | None = name
    try:
        if not plot(str(out / name)):
            png = None
    except ImportError:
        png = None
    update_markdown(out, key, markdown(png))
    update_json(out, key, data)
    pack_logs(out / f"{key}-logs.tar.gz", list(log_dirs))
