"""Q3 + Q4: worker-side text on/off and tokens per chunk (1 vs N), our Python worker, same frontend build.

    .venv/bin/python bench/probes/q34_worker.py                      # text {on,off} x chunk {1,50}
    .venv/bin/python bench/probes/q34_worker.py --python .venv-dynamo16/bin/python   # on ai-dynamo 1.6.1

One fleet per (text, tokens-per-chunk) combination, all up at once (only one busy at a time), each
= our frontend (the launcher's command line and env) + ``--workers`` of our Python workers over the
no-compute engine (``nocompute_worker.py``: the library's worker; ``PROBE_TOKENS_PER_CHUNK``
groups its per-token chunks into chunks of N tokens; ``ROLLOUT_DYN_WORKER_TEXT=0`` turns its text
off, so the frontend detokenizes). Raw aiohttp posts our wire's full body to
``/v1/completions``. Each configuration runs at T=8 and T=128 output tokens, so frontend and
worker CPU split into per request and per token (``fit_table``); CPU by thread kind too.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    run_cells,
    save,
    summarise,
    threads_table,
    wire_body,
)


async def main() -> None:
    p = args_common(__doc__ or "")
    p.add_argument(
        "--variants",
        default="on/1,off/1,on/50,off/50",
        help="text/tokens-per-chunk[/push][/pertokendetok], comma-separated",
    )
    p.add_argument("--tokens", default="8,128")
    p.add_argument("--concurrency", type=int, default=64)
    a = p.parse_args()
    ver = dynamo_version(a.python)
    ts = [int(t) for t in a.tokens.split(",")]
    async with contextlib.AsyncExitStack() as stack:
        fleets = {}
        for v in a.variants.split(","):
            text, chunk, *flags = v.split("/")
            env = {
                "PROBE_PUSH_EGRESS": "1" if "push" in flags else "0",
                "PROBE_PER_TOKEN_DETOK": "1" if "pertokendetok" in flags else "0",
            }
            f = Fleet(
                kind="nocompute",
                workers=a.workers,
                frontends=(OURS,),
                python=a.python,
                worker_env=env,
                output_tokens=max(ts),
                tokens_per_chunk=int(chunk),
                worker_text=text == "on",
            )
            name = f"text {text}, {chunk} tok/chunk" + "".join(f", {x}" for x in flags)
            fleets[name] = await stack.enter_async_context(f)
        cells = []
        for name, f in fleets.items():
            for t in ts:
                n = a.requests if t >= 64 else a.requests * 4
                cells.append(
                    Cell(
                        f"{name}, T={t}",
                        RawClient(f.frontend_urls["ours"], wire_body(f, t), check=t),
                        n,
                        a.concurrency,
                        t,
                        f.groups("ours"),
                        extra={"config": name},
                    )
                )
        info = {
            "machine": machine(),
            "dynamo": ver,
            "workers": a.workers,
            "argv": {str(k): f.argv("worker-0") for k, f in fleets.items()},
        }
        print(info)
        results = await run_cells(cells, a.rounds)
        for c in cells:
            await c.client.aclose()
    table, fit, th = summarise(results), fit_table(results), threads_table(results)
    print(table, "\n\n", fit, "\n\n", th)
    path = save(
        a.out, f"q34-{ver}{a.tag}", {"info": info, "results": results, "table": table, "fit": fit, "threads": th}
    )
    print("saved", path)


if __name__ == "__main__":
    asyncio.run(main())
