"""Greedy tokens and disk weight updates through the library, on two running fleets (GPU machine).

    python3 tools/gpu/library_check.py --ref sglang://127.0.0.1:30000 \
        --test 'dynamo://127.0.0.1:8000?workers=127.0.0.1:8081' --model M0 --alt M1 --out res.json

Both fleets serve ``M0``. For the same token prompts (greedy, one request at a time, the radix cache
flushed before each), ``--test`` must give the ids ``--ref`` gives; then both load ``M1`` through
``update_weights_from_disk`` (each fleet flushed first; the outputs must change, and agree
again), then ``M0`` again (the first answers must come back). Prints one line per step; exit 0
iff every step held. Used by ``tools/gpu/newer-engines.sh`` (ai-dynamo 1.6.1 over SGLang 0.5.16 /
0.5.17, issue 30).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

import rollout_backends as rb
from rollout_backends import GenerateRequest, SamplingParams

LENGTHS = (4, 7, 12, 19, 25, 33, 48, 64)  # shared/gpu/compare.py's prompt lengths


async def _answers(backend: Any, prompts: list[list[int]], new_tokens: int) -> list[dict[str, Any]]:
    out = []
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for ids in prompts:
        await backend.flush_cache()
        g = await backend.generate(GenerateRequest(input_ids=ids, sampling=greedy))
        out.append({"ids": list(g.output_ids), "logprobs": list(g.logprobs or []), "version": g.weight_version})
    return out


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[int, float]:
    """Prompts with identical ids, and the largest |Δlogprob| among them."""
    same = [(x, y) for x, y in zip(a, b, strict=True) if x["ids"] == y["ids"]]
    deltas = [abs(p - q) for x, y in same for p, q in zip(x["logprobs"], y["logprobs"], strict=False)]
    return len(same), max(deltas, default=0.0)


async def run(args: argparse.Namespace) -> int:
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]
    results: dict[str, Any] = {"ref": args.ref, "test": args.test, "steps": []}
    ok = True
    ref = await rb.open_backend(args.ref)
    test = await rb.open_backend(args.test)
    try:
        await ref.wait_ready(120)
        await test.wait_ready(120)
        first = None
        for step, path in (("seed0", None), ("seed1", args.alt), ("seed0-again", args.model)):
            if path is not None:
                for b in (ref, test):
                    # Idle first: SGLang's load flushes and asserts the flush took
                    # (weight_updater.py, 0.5.16), and a request that has just answered may still
                    # count as running; the library's flush waits for idle (FlushCache.wait_s).
                    await b.flush_cache()
                    await b.update_weights_from_disk(path, version=step)
            a = await _answers(ref, prompts, args.new_tokens)
            b_ = await _answers(test, prompts, args.new_tokens)
            same, dlp = _same(a, b_)
            held = same == len(prompts)
            if step == "seed0":
                first = a
            elif step == "seed1":
                held = held and _same(first or [], a)[0] < len(prompts)  # the new weights answer differently
            else:
                held = held and _same(first or [], a)[0] == len(prompts)
            versions = sorted({str(x["version"]) for x in b_})
            print(f"{step}: {same}/{len(prompts)} identical, max |dlogprob| {dlp:.3g}, test versions {versions}: "
                  f"{'ok' if held else 'FAILED'}", flush=True)  # fmt: skip
            results["steps"].append({"step": step, "identical": same, "max_dlogprob": dlp, "ok": held,
                                     "ref": a, "test": b_, "test_versions": versions})  # fmt: skip
            ok = ok and held
    finally:
        await test.aclose()
        await ref.aclose()
    results["ok"] = ok
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", required=True, help="registry URL of the reference fleet (SGLang direct)")
    ap.add_argument("--test", required=True, help="registry URL of the fleet under test")
    ap.add_argument("--model", required=True, help="the served model directory (seed 0)")
    ap.add_argument("--alt", required=True, help="a model of the same shapes, other weights (seed 1)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", required=True)
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
