"""Q5: CPU per chunk of ai-dynamo 1.4.2's real ``DecodeWorkerHandler`` (dynamo.sglang), stock vs
under our shim's patches (``adapters/dynamo/_sglang_shim.py``), SGLang stubbed.

    .venv/bin/python bench/probes/q5_shim.py            # every configuration, interleaved, 7 rounds

Uses the stub import hook and the handler construction of ``tests/dynamo/real_handler.py``.
The engine streams what SGLang 0.5.16's ``async_generate(stream=True)`` yields under incremental
streaming output (per-chunk ``output_ids`` and ``output_token_logprobs``, cumulative
``completion_tokens``, ``meta_info.id``) with no waiting, so the time measured is the handler's
Python per chunk: ``generate`` -> ``_process_token_stream`` -> ``_extract_logprobs`` (and, patched,
our ``tap`` / ``_as_delta`` / detokenizer / ``engine_data``). Not included: Dynamo's Rust side of
each yielded chunk (serialising it and sending it to the frontend), which ``q34_worker.py``
measures in a whole worker.

Configurations: handler ``stock`` | ``shim`` (text on) | ``shim, no text``
(``ROLLOUT_DYN_WORKER_TEXT=0``) | ``shim, per-token detok (before)`` (``per_token_detok.py``: text per
chunk, not per token); tokens per chunk 1 | 50. Each runs in a fresh subprocess per round
(the logprob patch is module-wide, so stock and patched cannot share a process); each subprocess
runs ``--requests`` requests of ``--tokens`` output tokens and reports CPU µs per chunk and per
token (``time.process_time``).
"""

# ruff: noqa: RUF001
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class FastEngine:
    """``async_generate(stream=True)``: ``tokens`` ids in chunks of ``per_chunk``, no waiting."""

    def __init__(self, tm: Any, tokens: int, per_chunk: int, vocab: int) -> None:
        self.tokenizer_manager = tm
        rng = random.Random(0)
        self.ids = [rng.randrange(3, vocab) for _ in range(tokens)]
        self.per_chunk = per_chunk
        self.n = 0

    async def async_generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], stream: bool, rid: str | None = None, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        self.n += 1
        sid = rid or f"sg-{self.n}"
        ids, k, wv = self.ids, self.per_chunk, self.tokenizer_manager.server_args.weight_version

        async def stream_() -> AsyncIterator[dict[str, Any]]:
            done = 0
            while done < len(ids):
                chunk = ids[done : done + k]
                done += len(chunk)
                last = done >= len(ids)
                meta = {
                    "id": sid,
                    "finish_reason": {"type": "length"} if last else None,
                    "prompt_tokens": len(input_ids),
                    "completion_tokens": done,
                    "cached_tokens": 0,
                    "weight_version": wv,
                    "output_token_logprobs": [(-0.01, t, None) for t in chunk],
                }
                yield {"output_ids": chunk, "meta_info": meta, "index": 0}

        return stream_()


async def one(handler: str, per_chunk: int, tokens: int, requests: int, model: str) -> dict[str, Any]:
    from tests.dynamo import real_handler as rh

    sys.meta_path.insert(0, rh._StubSGLang())
    from dynamo.sglang.request_handlers.llm.decode_handler import DecodeWorkerHandler

    if handler != "stock":
        from rollout_backends.adapters.dynamo import _sglang_shim as shim

        shim.patch_logprobs()
        shim.patch_token_stream(DecodeWorkerHandler)
        if handler == "shim-pertokendetok":
            from bench.probes import per_token_detok

            per_token_detok.patch()
    h = rh._handler(DecodeWorkerHandler, model, {})
    h.engine = FastEngine(rh.TokenizerManager(model), tokens, per_chunk, 512)
    prompt = [(17 + 31 * i) % 512 for i in range(128)]
    req = rh._request(prompt, "r", stop_conditions={"max_tokens": tokens, "ignore_eos": True})

    async def run(i: int) -> int:
        req["annotations"] = [f"rid:r{i}"]
        n = 0
        async for out in h.generate(req, rh.Context(f"c{i}")):
            n += 1
            # (stock 1.4.2 drops every logprob after the first chunk: the bug the shim fixes)
            assert handler == "stock" or len(out.get("log_probs") or ()) == len(out["token_ids"])
        return n

    await run(-1)  # warm-up (imports, tokenizer load)
    chunks = 0
    c0 = time.process_time()
    for i in range(requests):
        chunks += await run(i)
    cpu = time.process_time() - c0
    return {
        "handler": handler,
        "per_chunk": per_chunk,
        "tokens": tokens,
        "requests": requests,
        "chunks": chunks,
        "us_per_chunk": cpu * 1e6 / chunks,
        "us_per_token": cpu * 1e6 / (tokens * requests),
        "us_per_request": cpu * 1e6 / requests,
    }


CONFIGS = [("stock", "1"), ("shim", "1"), ("shim, no text", "0"), ("shim, per-token detok (before)", "1")]
_ARG = {"stock": "stock", "shim, per-token detok (before)": "shim-pertokendetok"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--one", nargs=2, metavar=("HANDLER", "PER_CHUNK"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=500)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--chunks", default="1,50")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "probes" / "out")
    a = p.parse_args()
    from rollout_backends.adapters.reference import cached_tiny_model

    model = str(cached_tiny_model())
    if a.one:
        print(json.dumps(asyncio.run(one(a.one[0], int(a.one[1]), a.tokens, a.requests, model))))
        return
    cells = [(h, text, int(c)) for c in a.chunks.split(",") for h, text in CONFIGS]
    results: list[dict[str, Any]] = []
    for r in range(a.rounds):
        order = cells[r % len(cells) :] + cells[: r % len(cells)]
        for h, text, c in order:
            env = {**os.environ, "ROLLOUT_DYN_WORKER_TEXT": text, "PYTHONPATH": str(ROOT)}
            out = subprocess.run(
                [
                    a.python,
                    __file__,
                    "--one",
                    _ARG.get(h, "shim"),
                    str(c),
                    "--tokens",
                    str(a.tokens),
                    "--requests",
                    str(a.requests),
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            res = json.loads(out.stdout.strip().splitlines()[-1])
            res["label"], res["round"] = h, r
            results.append(res)
            pc, pt = res["us_per_chunk"], res["us_per_token"]
            print(f"r{r} {h:<30} {c:>3} tok/chunk  {pc:8.1f} µs/chunk  {pt:6.2f} µs/token")
    lines = [
        "| handler | tokens/chunk | n | µs/chunk median (min–max) | µs/token median (min–max) |",
        "|---|---|---|---|---|",
    ]
    for h, _, c in cells:
        rs = [x for x in results if x["label"] == h and x["per_chunk"] == c]
        pc = [x["us_per_chunk"] for x in rs]
        pt = [x["us_per_token"] for x in rs]
        lines.append(
            f"| {h} | {c} | {len(rs)} | {statistics.median(pc):.1f} ({min(pc):.1f}–{max(pc):.1f}) | "
            f"{statistics.median(pt):.2f} ({min(pt):.2f}–{max(pt):.2f}) |"
        )
    table = "\n".join(lines)
    print(table)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "q5-shim.json").write_text(json.dumps({"results": results, "table": table}, indent=1))


if __name__ == "__main__":
    main()
