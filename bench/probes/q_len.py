"""Frontend CPU per token vs output length (is any per-request work superlinear in tokens?).

    .venv/bin/python bench/probes/q_len.py --kind mocker --tokens 16,128,512,1024

Raw aiohttp, our wire's full body, one frontend (ours) and ``--workers`` workers; the same total
number of output tokens per batch at each length (``--budget-tokens``), interleaved rounds.
"""

from __future__ import annotations

import asyncio
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
    machine,
    run_cells,
    save,
    summarise,
    wire_body,
)


async def main() -> None:
    p = args_common(__doc__ or "")
    p.add_argument("--kind", default="mocker", choices=["mocker", "nocompute"])
    p.add_argument("--tokens", default="16,128,512,1024")
    p.add_argument("--budget-tokens", type=int, default=65536)
    p.add_argument("--concurrency", type=int, default=64)
    a = p.parse_args()
    ver = dynamo_version(a.python)
    ts = [int(t) for t in a.tokens.split(",")]
    async with Fleet(kind=a.kind, workers=a.workers, frontends=(OURS,), python=a.python, output_tokens=max(ts)) as f:
        cells = [
            Cell(
                f"T={t}",
                RawClient(f.frontend_urls["ours"], wire_body(f, t), check=t),
                max(a.concurrency, a.budget_tokens // t),
                a.concurrency,
                t,
                f.groups("ours"),
            )
            for t in ts
        ]
        results = await run_cells(cells, a.rounds)
        for c in cells:
            await c.client.aclose()
    table = summarise(results)
    print(table)
    save(
        a.out,
        f"qlen-{a.kind}-{ver}{a.tag}",
        {"info": {"machine": machine(), "dynamo": ver}, "results": results, "table": table},
    )


if __name__ == "__main__":
    asyncio.run(main())
