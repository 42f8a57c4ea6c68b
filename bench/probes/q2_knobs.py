"""Q2: which of the frontend knobs we set (and stock Dynamo does not) cost frontend CPU.

    .venv/bin/python bench/probes/q2_knobs.py --kind nocompute
    .venv/bin/python bench/probes/q2_knobs.py --kind mocker

One set of workers, three frontends in front of them at once (same namespace, so the same
workers), all raw aiohttp (no library in the client):

* ``ours``: what the launcher starts: ``--migration-limit 0`` and env ``DYN_ENABLE_RL=true``,
  ``DYN_RL_PORT``, ``DYN_SGLANG_ENABLE_GENERATE=1`` (the last is read by 1.6.x only);
* ``stock``: the same command line without ``--migration-limit 0`` and without that env;
* ``stock+RL``: stock plus ``DYN_ENABLE_RL=true`` / ``DYN_RL_PORT`` (isolates DYN_ENABLE_RL).

Bodies (on ``ours`` and, for the plain one, on ``stock``): our wire's full body; without
``nvext.extra_fields``; without ``nvext.annotations``; without ``nvext``; without ``logprobs``;
"plain" (no nvext, no logprobs: what a stock OpenAI client sends). Every configuration runs at
two output lengths (``--tokens 8,128``), so CPU splits into a fixed part per request and a part
per token (``fit_table``).
"""

from __future__ import annotations

import asyncio
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.probes._probe import (
    OURS,
    STOCK,
    Cell,
    Fleet,
    FrontendVariant,
    RawClient,
    args_common,
    dynamo_version,
    fit_table,
    machine,
    run_cells,
    save,
    summarise,
    wire_body,
)

STOCK_RL = FrontendVariant(
    name="stockrl", ours_env=False, stock_migration=True, env={"DYN_ENABLE_RL": "true", "DYN_RL_PORT": "@port"}
)


def variants(body: dict, with_logprobs: bool) -> dict[str, dict]:
    out = {"full body": body}
    b = copy.deepcopy(body)
    del b["nvext"]["extra_fields"]
    out["no extra_fields"] = b
    b = copy.deepcopy(body)
    del b["nvext"]["annotations"]
    out["no annotations"] = b
    b = copy.deepcopy(body)
    del b["nvext"]
    out["no nvext"] = b
    if with_logprobs:
        b = copy.deepcopy(body)
        del b["logprobs"]
        out["no logprobs"] = b
        b = copy.deepcopy(out["no nvext"])
        del b["logprobs"]
        out["plain (no nvext, no logprobs)"] = b
    return out


async def main() -> None:
    p = args_common(__doc__ or "")
    p.add_argument("--kind", default="nocompute", choices=["mocker", "nocompute"])
    p.add_argument("--tokens", default="8,128")
    p.add_argument("--concurrency", type=int, default=64)
    a = p.parse_args()
    ver = dynamo_version(a.python)
    ts = [int(t) for t in a.tokens.split(",")]
    async with Fleet(
        kind=a.kind, workers=a.workers, frontends=(OURS, STOCK, STOCK_RL), python=a.python, output_tokens=max(ts)
    ) as fleet:
        cells = []
        for t in ts:
            n = a.requests if t >= 64 else a.requests * 4  # short answers: more requests per batch (10 ms ticks)
            body = wire_body(fleet, t)
            for name, b in variants(body, a.kind != "mocker").items():
                cells.append(
                    Cell(
                        f"ours frontend, {name}, T={t}",
                        RawClient(fleet.frontend_urls["ours"], b, check=t),
                        n,
                        a.concurrency,
                        t,
                        fleet.groups("ours"),
                        extra={"config": f"ours frontend, {name}"},
                    )
                )
            for fe, lab in (("stock", "stock frontend"), ("stockrl", "stock+DYN_ENABLE_RL frontend")):
                cells.append(
                    Cell(
                        f"{lab}, full body, T={t}",
                        RawClient(fleet.frontend_urls[fe], body, check=t),
                        n,
                        a.concurrency,
                        t,
                        fleet.groups(fe),
                        extra={"config": f"{lab}, full body"},
                    )
                )
            plain = variants(body, a.kind != "mocker")
            pb = plain.get("plain (no nvext, no logprobs)", plain["no nvext"])
            cells.append(
                Cell(
                    f"stock frontend, plain body, T={t}",
                    RawClient(fleet.frontend_urls["stock"], pb, check=t),
                    n,
                    a.concurrency,
                    t,
                    fleet.groups("stock"),
                    extra={"config": "stock frontend, plain body"},
                )
            )
        info = {
            "machine": machine(),
            "dynamo": ver,
            "kind": a.kind,
            "workers": a.workers,
            "argv": {k: fleet.argv(f"frontend-{k}") for k in fleet.frontend_urls},
        }
        print(info)
        results = await run_cells(cells, a.rounds)
        for c in cells:
            await c.client.aclose()
    table = summarise(results)
    fit = fit_table(results)
    print(table, "\n\n", fit)
    path = save(a.out, f"q2-{a.kind}-{ver}{a.tag}", {"info": info, "results": results, "table": table, "fit": fit})
    print("saved", path)


if __name__ == "__main__":
    asyncio.run(main())
