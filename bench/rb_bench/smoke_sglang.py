"""First GPU call: real SGLang through our launcher and adapter (also warms the kernel caches).

    PYTHONPATH=bench python3 -m rb_bench.smoke_sglang OUT_DIR

One SGLang 0.5.16 worker (no router) on the tiny model: greedy tokens for 8 prompts, the served
version, a disk-update transaction to other weights (outputs must change, version must move),
and back (outputs must equal the first run). Writes OUT_DIR/smoke-sglang.json.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import rollout_backends as rb
from rollout_backends.adapters.reference import make_tiny_model
from rollout_backends.adapters.sglang import SGLangFleetConfig, launch_sglang_fleet

PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(4 + 8 * i)] for i in range(8)]


async def run(out: Path) -> dict[str, object]:
    res: dict[str, object] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rb-smoke-") as tmp:
        base = make_tiny_model(Path(tmp) / "seed0", seed=0)
        alt = make_tiny_model(Path(tmp) / "seed1", seed=1)
        cfg = SGLangFleetConfig(model_path=str(base), workers=1, router="none", mem_fraction_static=0.15,
                                cuda_visible_devices=["0"], log_dir=str(Path(tmp) / "logs"))  # fmt: skip
        greedy = rb.SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
        try:
            async with launch_sglang_fleet(cfg) as fleet:
                res["startup_s"] = round(time.monotonic() - t0, 1)
                b = fleet.backend
                res["capabilities"] = {k: str(v) for k, v in __import__("attrs").asdict(b.capabilities).items()}

                async def batch() -> list[rb.Generation]:
                    await b.flush_cache()
                    return [await b.generate(rb.GenerateRequest(input_ids=p, sampling=greedy)) for p in PROMPTS]

                t = time.monotonic()
                g0 = await batch()
                res["batch_s"] = round(time.monotonic() - t, 2)
                res["version0"] = sorted({g.weight_version for g in g0 if g.weight_version})
                res["lengths_ok"] = all(len(g.output_ids) == 32 == len(g.logprobs or ()) for g in g0)
                async with b.weight_update("seed1") as tx:
                    await tx.update_from_disk(str(alt))
                g1 = await batch()
                res["version1"] = sorted({g.weight_version for g in g1 if g.weight_version})
                res["changed_after_update"] = sum(a.output_ids != c.output_ids for a, c in zip(g0, g1, strict=True))
                async with b.weight_update("seed0-again") as tx:
                    await tx.update_from_disk(str(base))
                g2 = await batch()
                res["identical_after_roundtrip"] = sum(
                    a.output_ids == c.output_ids for a, c in zip(g0, g2, strict=True)
                )
                res["max_dlogprob_roundtrip"] = max(
                    abs(x - y)
                    for a, c in zip(g0, g2, strict=True)
                    for x, y in zip(a.logprobs or (), c.logprobs or (), strict=True)
                )
                res["health"] = str(await b.health(probe=True))
                res["tokens_prompt0"] = list(g0[0].output_ids)
        except Exception as exc:  # report, then the logs
            res["error"] = f"{type(exc).__name__}: {exc}"
            for log in sorted((Path(tmp) / "logs").glob("*")):
                res[f"log:{log.name}"] = log.read_text(errors="replace")[-3000:]
    res["total_s"] = round(time.monotonic() - t0, 1)
    return res


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    res = asyncio.run(run(out))
    (out / "smoke-sglang.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("log:")}, default=str)[:4000])
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
