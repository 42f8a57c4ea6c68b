"""Why SGLang 0.5.16 named another id than the prompt's in ``meta_info.input_token_logprobs[8]``
(H200 tier of 2026-12-03 09:00, ``docs/data/conformance-results-2026-12-03-0900.md``; issue 17).

The tier's parity prompts on the tier's tiny model (``make_tiny_model(path, 0)``), each sent to one
SGLang worker started as the tier starts it, with a flush before each and ``logprob_start_len=0``:
without and with ``top_logprobs_num=3``, from the middle of the prompt, and all prompts at once.
Writes each raw answer into OUT/<case>.json and prints where the reported ids differ from the
prompt's.

    PYTHONPATH=$SITE:bench python3 -m probes.prompt_logprobs OUT [--budget-s 150]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from rollout_backends import GenerateRequest, SamplingParams
from rollout_backends.sglang_native import request_body


def _diff(prompt: tuple[int, ...], start: int, answer: Any) -> str:
    meta = answer.get("meta_info", {}) if isinstance(answer, dict) else {}
    entries = meta.get("input_token_logprobs")
    if not isinstance(entries, list):
        return f"no input_token_logprobs ({type(entries).__name__}); keys {sorted(meta)}"
    scored = prompt[start:]
    ids = [e[1] if isinstance(e, list) and len(e) > 1 else None for e in entries]
    bad = [(i, tid, got) for i, (tid, got) in enumerate(zip(scored, ids, strict=False)) if tid != got]
    head = f"{len(entries)} entries for {len(scored)} scored tokens"
    if not bad:
        return head + ", ids equal"
    return head + f", {len(bad)} differ: " + ", ".join(f"[{i}] want {t} got {g}" for i, t, g in bad[:8])


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--worker-kind", choices=["sglang", "reference"], default="sglang")  # reference: a CPU smoke run
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.budget_s

    from rollout_backends.adapters.reference import make_tiny_model
    from rollout_backends.adapters.sglang import SGLangFleetConfig, start_sglang_fleet
    from rollout_backends.conformance import default_parity_prompts

    model = make_tiny_model(out / "model", 0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = default_parity_prompts(vocab)
    print(f"vocab {vocab}; prompt lengths {[len(x) for x in prompts]}")
    gpu = a.worker_kind == "sglang"
    fleet = await start_sglang_fleet(
        SGLangFleetConfig(
            model_path=str(model),
            workers=1,
            worker_kind=a.worker_kind,
            cuda_visible_devices=("0",) if gpu else None,
            mem_fraction_static=0.12 if gpu else None,
            attention_backend="triton",
            sampling_backend="pytorch",
            disable_cuda_graph=True,
            page_size=16,
            extra_server_args=("--max-total-tokens", "65536") if gpu else (),
            router="none",
            log_dir=str(out / "sglang-logs"),
            startup_timeout_s=max(30.0, deadline - time.monotonic() - 40),
        )
    )
    try:
        url = fleet.worker_urls[0]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
        topk = SamplingParams(temperature=0.0, max_new_tokens=16, top_logprobs=3)
        async with aiohttp.ClientSession() as s:

            async def one(name: str, prompt: tuple[int, ...], sampling: SamplingParams, start: int) -> Any:
                req = GenerateRequest(
                    input_ids=prompt, sampling=sampling, request_id=f"p-{name}", prompt_logprobs_start=start
                )
                body = request_body(req)
                async with s.post(f"{url}/generate", json=body) as r:
                    text = await r.text()
                    status = r.status
                try:
                    answer: Any = json.loads(text)
                except ValueError:
                    answer = text
                (out / f"{name}.json").write_text(json.dumps({"request": body, "status": status, "answer": answer}))
                print(f"{name} (len {len(prompt)}, start {start}): status {status}: {_diff(prompt, start, answer)}")
                return answer

            for i, prompt in enumerate(prompts):
                for tag, sampling, start in (
                    ("plain", greedy, 0),
                    ("topk", topk, 0),
                    ("mid", greedy, len(prompt) // 2),
                ):
                    if time.monotonic() > deadline - 10:
                        print("budget spent")
                        return
                    await s.post(f"{url}/flush_cache")
                    await one(f"{i}-{tag}", prompt, sampling, start)
            await s.post(f"{url}/flush_cache")
            await asyncio.gather(*(one(f"{i}-together", x, topk, 0) for i, x in enumerate(prompts)))
            # And again without a flush: the prompts' prefixes now come from the radix cache.
            await asyncio.gather(*(one(f"{i}-cached", x, topk, 0) for i, x in enumerate(prompts)))
    finally:
        await fleet.aclose()


if __name__ == "__main__":
    asyncio.run(main())
