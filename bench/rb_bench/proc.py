"""CPU time of the processes a benchmark starts, from ``/proc`` (Linux), by fleet and role.

Each sample reads ``utime + stime`` of every live pid of every process group a fleet's supervisor
started (SGLang's scheduler and detokenizer children stay in their server's group). A pid is
given a *role* from its name: SGLang names its children ``sglang::scheduler`` /
``sglang::detokenizer`` (``setproctitle``), so a worker splits into ``main`` (HTTP server or the
Dynamo handler with SGLang's tokenizer manager), ``scheduler`` and ``detokenizer``; vLLM 0.26 names
its engine-core child ``VLLM::EngineCore`` (counted as ``scheduler``; its API server or the
``dynamo.vllm`` handler is ``main``, and it has no detokenizer process). The client is
this process (``time.process_time``). Resolution: one clock tick (10 ms on Linux).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

__all__ = ["CpuSampler", "cpu_seconds", "role_of"]

try:
    _TICK = float(os.sysconf("SC_CLK_TCK"))
except (AttributeError, ValueError, OSError):  # not Linux: every read below returns None
    _TICK = 100.0


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (its threads included), or ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15 of stat(5)
    except (IndexError, ValueError):
        return None


def _name(pid: int) -> str:
    for path in (f"/proc/{pid}/cmdline", f"/proc/{pid}/comm"):
        try:
            with open(path, "rb") as f:
                raw = f.read().replace(b"\0", b" ").strip()
        except OSError:
            continue
        if raw:
            return raw.decode(errors="replace")
    return ""


def role_of(pid: int) -> str:
    """``scheduler`` / ``detokenizer`` for SGLang's children, ``scheduler`` for vLLM's engine core
    (``VLLM::EngineCore``: its scheduler and, at TP 1, the model runner), else ``main``."""
    name = _name(pid)
    if "scheduler" in name or "EngineCore" in name:
        return "scheduler"
    if "detokenizer" in name:
        return "detokenizer"
    return "main"


#: ``{fleet: {process name: [pid, ...]}}``, read at each sample (pids come and go).
PidSource = Callable[[], Mapping[str, Mapping[str, list[int]]]]


class CpuSampler:
    """Cumulative CPU seconds by ``(fleet, process, role)``, plus ``("client", "client", "client")``."""

    def __init__(self, pids: PidSource) -> None:
        self._pids = pids
        self._roles: dict[int, str] = {}

    def sample(self) -> dict[tuple[str, str, str], float]:
        out: dict[tuple[str, str, str], float] = {("client", "client", "client"): time.process_time()}
        for fleet, groups in self._pids().items():
            for process, pids in groups.items():
                for pid in pids:
                    secs = cpu_seconds(pid)
                    if secs is None:
                        continue
                    role = self._roles.get(pid)
                    if role is None:
                        role = self._roles[pid] = role_of(pid)
                    key = (fleet, process, role)
                    out[key] = out.get(key, 0.0) + secs
        return out

    @staticmethod
    def delta(
        before: Mapping[tuple[str, str, str], float], after: Mapping[tuple[str, str, str], float]
    ) -> dict[tuple[str, str, str], float]:
        """CPU seconds spent between two samples (a process that appeared counts from zero)."""
        return {k: max(0.0, v - before.get(k, 0.0)) for k, v in after.items()}
