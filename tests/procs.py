"""Process-table helpers shared by the tests that start real processes."""

from __future__ import annotations

import os

#: torch's shared-memory daemon (``/proc`` truncates names to 15 characters): the first CPU tensor
#: shared with the ``file_system`` strategy (a tensor weight update on CPU) starts one for this
#: process, which ends with it. Not a process the code under test left behind.
_PER_PROCESS_DAEMONS = frozenset({"torch_shm_manag"})


def descendants() -> set[int]:
    """Every live (not zombie) descendant of this process, read from /proc (torch's per-process
    shared-memory daemon aside)."""
    me = os.getpid()
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if stat[stat.find("(") + 1 : stat.rfind(")")] in _PER_PROCESS_DAEMONS:
            continue
        if fields and fields[0] not in ("Z", "X"):
            parent[int(entry)] = int(fields[1])
    out: set[int] = set()
    frontier = {me}
    while frontier:
        nxt = {p for p, pp in parent.items() if pp in frontier and p not in out}
        out |= nxt
        frontier = nxt
    return out
