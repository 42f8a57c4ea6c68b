"""Q1: raw aiohttp posting our wire's exact ``/v1/completions`` body vs our adapter, same fleet.

    .venv/bin/python bench/probes/q1_client.py --kind mocker      # 2 dynamo.mocker workers
    .venv/bin/python bench/probes/q1_client.py --kind nocompute   # 2 of our Python workers, no-compute engine
    .venv/bin/python bench/probes/q1_client.py --kind nocompute --python .venv-dynamo16/bin/python  # ai-dynamo 1.6.1

Cells (interleaved, rotated each round): ``raw`` (aiohttp, ``completion_body`` as JSON) and
``adapter`` (``backend.generate``) at each concurrency; with mockers also ``adapter, no task``
(diagnostic: the fleet's per-request cancel task switched off by hand, as for abort-by-id
workers); on a 1.6.x frontend with our workers the adapter takes native ``/generate``, so
``adapter, /v1/completions`` (``native_generate=False``) is added. CPU: this process (client),
the frontend, both workers.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.probes._probe import (
    OURS,
    AdapterClient,
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
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--concurrency", default="64,256")
    a = p.parse_args()
    ver = dynamo_version(a.python)
    conc = [int(c) for c in a.concurrency.split(",")]
    async with Fleet(
        kind=a.kind, workers=a.workers, frontends=(OURS,), python=a.python, output_tokens=a.tokens
    ) as fleet:
        url = fleet.frontend_urls["ours"]
        groups = fleet.groups("ours")
        body = wire_body(fleet, a.tokens)
        backend = await fleet.connect("ours")
        extra_backends = []
        cells = []
        for c in conc:
            cells.append(
                Cell(f"raw aiohttp, C={c}", RawClient(url, body, check=a.tokens), a.requests, c, a.tokens, groups)
            )
            cells.append(Cell(f"adapter, C={c}", AdapterClient(backend, a.tokens), a.requests, c, a.tokens, groups))
        if not backend._abort_by_id:  # the mocker: a cancel task per request
            nt = await fleet.connect("ours")
            nt._abort_by_id = True  # diagnostic only: abort(request_id) would not work
            extra_backends.append(nt)
            for c in conc:
                cells.append(
                    Cell(f"adapter, no task, C={c}", AdapterClient(nt, a.tokens), a.requests, c, a.tokens, groups)
                )
        if getattr(backend.wire, "native_generate", False):
            v1 = await fleet.connect("ours", native_generate=False)
            extra_backends.append(v1)
            for c in conc:
                cells.append(
                    Cell(
                        f"adapter, /v1/completions, C={c}", AdapterClient(v1, a.tokens), a.requests, c, a.tokens, groups
                    )
                )
        info = {
            "machine": machine(),
            "dynamo": ver,
            "kind": a.kind,
            "workers": a.workers,
            "native_generate": getattr(backend.wire, "native_generate", False),
            "frontend_argv": fleet.argv("frontend-ours"),
            "worker_argv": fleet.argv("worker-0"),
        }
        print(info)
        results = await run_cells(cells, a.rounds)
        for cell in cells:
            await cell.client.aclose() if isinstance(cell.client, RawClient) else None
        for b in [backend, *extra_backends]:
            await b.aclose()
    table = summarise(results)
    print(table)
    path = save(a.out, f"q1-{a.kind}-{ver}{a.tag}", {"info": info, "results": results, "table": table})
    print("saved", path)


if __name__ == "__main__":
    asyncio.run(main())
