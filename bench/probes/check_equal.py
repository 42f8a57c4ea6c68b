"""The probe variants answer the same thing: one /v1/completions answer per variant, compared.

    .venv/bin/python bench/probes/check_equal.py                                     # 1.4.2: chunk 1 / 50, fast detok
    .venv/bin/python bench/probes/check_equal.py --python .venv-dynamo16/bin/python --push   # 1.6.1: + push egress

Our worker over the no-compute engine, our wire's full body (128 tokens, logprobs); compared:
``nvext.completion_token_ids``, ``choices[0].logprobs.token_logprobs``, ``choices[0].text``,
``finish_reason``, ``nvext.engine_data`` (timing and worker ids differ by nature).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.probes._probe import OURS, Fleet, args_common, wire_body


async def main() -> None:
    p = args_common(__doc__ or "")
    p.add_argument("--push", action="store_true")
    a = p.parse_args()
    import aiohttp

    variants = {
        "1 tok/chunk": (1, {}),
        "50 tok/chunk": (50, {}),
        "50 tok/chunk, per-token detok (before)": (50, {"PROBE_PER_TOKEN_DETOK": "1"}),
    }
    if a.push:
        variants["1 tok/chunk, push"] = (1, {"PROBE_PUSH_EGRESS": "1"})
        variants["50 tok/chunk, push"] = (50, {"PROBE_PUSH_EGRESS": "1"})
    answers = {}
    async with contextlib.AsyncExitStack() as st:
        s = await st.enter_async_context(aiohttp.ClientSession())
        for name, (chunk, env) in variants.items():
            f = await st.enter_async_context(
                Fleet(
                    kind="nocompute",
                    workers=1,
                    frontends=(OURS,),
                    python=a.python,
                    tokens_per_chunk=chunk,
                    worker_env=env,
                )
            )
            async with s.post(f"{f.frontend_urls['ours']}/v1/completions", json=wire_body(f, 128)) as r:
                d = await r.json()
            c = d["choices"][0]
            answers[name] = {
                "ids": d["nvext"]["completion_token_ids"],
                "lps": c["logprobs"]["token_logprobs"],
                "text": c["text"],
                "finish": c["finish_reason"],
                "engine_data": d["nvext"].get("engine_data", {}) | {"worker": None},
            }
    ref = answers["1 tok/chunk"]
    ok = True
    for name, ans in answers.items():
        diff = [k for k in ref if ans[k] != ref[k]]
        ok &= not diff
        print(
            f"{name:<28} {len(ans['ids'])} ids, {len(ans['lps'])} logprobs, text {len(ans['text'])} chars: "
            + ("same as 1 tok/chunk" if not diff else f"DIFFERS in {diff}")
        )
    print(json.dumps({k: v for k, v in ref.items() if k != "text"})[:300])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    asyncio.run(main())
