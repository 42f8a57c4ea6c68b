"""Q2, per field: which ``nvext.extra_fields`` entries (and ``annotations``) cost frontend CPU.

    .venv/bin/python bench/probes/q2_fields.py --kind mocker
    .venv/bin/python bench/probes/q2_fields.py --kind nocompute --python .venv-dynamo16/bin/python

Our frontend (the launcher's command line and env) in front of ``--workers`` workers; raw aiohttp;
bodies: our wire's full body, then the same without one field at a time, then with only the two
fields the adapter cannot do without (``completion_token_ids``, ``engine_data``), then no nvext.
T=8 and T=128 (fixed/per-token split), interleaved rounds, paired ratios against the full body.
"""

# ruff: noqa: RUF001
from __future__ import annotations

import asyncio
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.probes._probe import (
    OURS,
    Cell,
    Fleet,
    RawClient,
    args_common,
    dynamo_version,
    fit_table,
    machine,
    paired,
    run_cells,
    save,
    summarise,
    wire_body,
)


def variants(body: dict) -> dict[str, dict]:
    out = {"full body": body}
    for f in body["nvext"]["extra_fields"]:
        b = copy.deepcopy(body)
        b["nvext"]["extra_fields"].remove(f)
        out[f"no {f}"] = b
    b = copy.deepcopy(body)
    b["nvext"]["extra_fields"] = ["completion_token_ids", "engine_data"]
    out["only completion_token_ids+engine_data"] = b
    b = copy.deepcopy(body)
    del b["nvext"]
    out["no nvext"] = b
    return out


async def main() -> None:
    p = args_common(__doc__ or "")
    p.add_argument("--kind", default="nocompute", choices=["mocker", "nocompute"])
    p.add_argument("--tokens", default="8,128")
    p.add_argument("--concurrency", type=int, default=64)
    a = p.parse_args()
    ver = dynamo_version(a.python)
    ts = [int(t) for t in a.tokens.split(",")]
    async with Fleet(kind=a.kind, workers=a.workers, frontends=(OURS,), python=a.python, output_tokens=max(ts)) as f:
        cells = []
        for t in ts:
            n = a.requests if t >= 64 else a.requests * 4
            for name, b in variants(wire_body(f, t)).items():
                cells.append(
                    Cell(
                        f"{name}, T={t}",
                        RawClient(f.frontend_urls["ours"], b, check=t),
                        n,
                        a.concurrency,
                        t,
                        f.groups("ours"),
                        extra={"config": name},
                    )
                )
        results = await run_cells(cells, a.rounds)
        for c in cells:
            await c.client.aclose()
    table, fit = summarise(results), fit_table(results)
    rows = [
        "| body / full body (same round) | T | frontend ratio median (min–max) | workers ratio |",
        "|---|---|---|---|",
    ]
    for t in ts:
        for name in variants(wire_body(f, t)):
            if name == "full body":
                continue
            m, lo, hi, _ = paired(results, f"{name}, T={t}", f"full body, T={t}", "frontend")
            w = paired(results, f"{name}, T={t}", f"full body, T={t}", "workers")
            rows.append(f"| {name} | {t} | {m:.2f} ({lo:.2f}–{hi:.2f}) | {w[0]:.2f} ({w[1]:.2f}–{w[2]:.2f}) |")
    ratios = "\n".join(rows)
    print(table, "\n\n", fit, "\n\n", ratios)
    save(
        a.out,
        f"q2fields-{a.kind}-{ver}{a.tag}",
        {
            "info": {"machine": machine(), "dynamo": ver, "kind": a.kind},
            "results": results,
            "table": table,
            "fit": fit,
            "ratios": ratios,
        },
    )


if __name__ == "__main__":
    asyncio.run(main())
