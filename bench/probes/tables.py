"""Print the report's tables from the probes' JSON outputs (``bench/probes/out/*.json``).

    .venv/bin/python bench/probes/tables.py [TAG]      # e.g. -r2

For each run: the summary table, the fixed/per-token split where there are two lengths, CPU by
thread kind, and paired per-round ratios (same round = same machine state) for the comparisons
the report makes.
"""

# ruff: noqa: RUF001
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.probes._probe import paired

OUT = Path(__file__).resolve().parent / "out"

PAIRS = {
    "q1": [
        ("adapter, C=64", "raw aiohttp, C=64"),
        ("adapter, C=256", "raw aiohttp, C=256"),
        ("adapter, no task, C=64", "adapter, C=64"),
        ("adapter, no task, C=256", "adapter, C=256"),
        ("adapter, C=64", "adapter, /v1/completions, C=64"),
        ("adapter, C=256", "adapter, /v1/completions, C=256"),
    ],
    "q2": [
        (f"{x}, T={t}", f"ours frontend, full body, T={t}")
        for t in (8, 128)
        for x in (
            "ours frontend, no extra_fields",
            "ours frontend, no annotations",
            "ours frontend, no nvext",
            "ours frontend, no logprobs",
            "ours frontend, plain (no nvext, no logprobs)",
            "stock frontend, full body",
            "stock+DYN_ENABLE_RL frontend, full body",
            "stock frontend, plain body",
        )
    ],
    "q34": [
        (f"{a}, T={t}", f"{b}, T={t}")
        for t in (8, 128)
        for a, b in (
            ("text off, 1 tok/chunk", "text on, 1 tok/chunk"),
            ("text off, 50 tok/chunk", "text on, 50 tok/chunk"),
            ("text on, 50 tok/chunk", "text on, 1 tok/chunk"),
            ("text on, 1 tok/chunk", "text on, 1 tok/chunk, pertokendetok"),
            ("text on, 50 tok/chunk", "text on, 50 tok/chunk, pertokendetok"),
            ("text on, 1 tok/chunk, push", "text on, 1 tok/chunk"),
            ("text on, 50 tok/chunk, push", "text on, 50 tok/chunk"),
        )
    ],
}


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else ""
    for path in sorted(OUT.glob(f"q*{tag}.json")):
        d = json.loads(path.read_text())
        if "info" not in d:
            continue
        info = d["info"]
        print(
            f"\n## {path.name}  (ai-dynamo {info.get('dynamo')}, load at start {info['machine']['loadavg'][0]:.2f})\n"
        )
        print(d["table"])
        for key in ("fit", "threads", "ratios"):
            if d.get(key):
                print("\n" + d[key])
        kind = path.name.split("-")[0]
        rows = []
        for a, b in PAIRS.get(kind, []):
            for g in ("client", "frontend", "workers"):
                m, lo, hi, n = paired(d["results"], a, b, g)
                if n:
                    rows.append(f"| {a} / {b} | {g} | {m:.2f} ({lo:.2f}–{hi:.2f}) | {n} |")
        if rows:
            print("\n| paired ratio (per round) | process | median (min–max) | rounds |\n|---|---|---|---|")
            print("\n".join(rows))


if __name__ == "__main__":
    main()
