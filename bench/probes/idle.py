"""Idle CPU of a frontend with and without the knobs we set (DYN_ENABLE_RL: RL worker discovery).

    .venv/bin/python bench/probes/idle.py --seconds 60

Two frontends (ours, stock) in front of the same 2 mockers; nothing is sent; CPU over the window.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.probes._probe import OURS, STOCK, Fleet, args_common, cpu_many, dynamo_version, save


async def main() -> None:
    p = args_common(__doc__ or "")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--kind", default="mocker", choices=["mocker", "nocompute"])
    a = p.parse_args()
    ver = dynamo_version(a.python)
    async with Fleet(kind=a.kind, workers=a.workers, frontends=(OURS, STOCK), python=a.python) as f:
        await asyncio.sleep(5)
        groups = {k: [v] for k, v in f.pids.items()}
        c0 = cpu_many(groups)
        await asyncio.sleep(a.seconds)
        c1 = cpu_many(groups)
    res = {k: (c1[k] - c0[k]) / a.seconds * 1000 for k in c0}
    print(
        f"idle CPU, ms per second, over {a.seconds:.0f} s (ai-dynamo {ver}):", {k: round(v, 2) for k, v in res.items()}
    )
    save(a.out, f"idle-{a.kind}-{ver}{a.tag}", res)


if __name__ == "__main__":
    asyncio.run(main())
