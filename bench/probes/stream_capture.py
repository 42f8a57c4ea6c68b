"""Capture real wire bytes on the GPU machine: SGLang 0.5.16 ``/generate`` streamed and not, and the
Dynamo 1.4.2 frontend's ``/v1/completions`` SSE in front of ``dynamo.sglang`` (our shim), for the
streaming, top-k and prompt-logprob work (issue 17). Writes one JSON file per exchange into OUT:
the request body and the answer's status, headers and raw body text.

    PYTHONPATH=$SITE:bench python3 -m probes.stream_capture MODEL OUT [--budget-s 240]

Needs the GPU stack (sglang, dynamo) and a model folder with a tokenizer (make_model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

PROMPT = [9707, 11, 1879, 374, 264, 1273, 13, 576, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph")


async def exchange(
    session: aiohttp.ClientSession, out: Path, name: str, url: str, body: dict[str, Any], abort: Any = None
) -> None:
    t0 = time.monotonic()
    record: dict[str, Any] = {"url": url, "request": body}
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            record["status"] = resp.status
            record["headers"] = dict(resp.headers)
            chunks: list[str] = []
            n = 0
            async for raw in resp.content.iter_any():
                chunks.append(raw.decode("utf-8", "replace"))
                n += 1
                if abort is not None and n == 3:
                    record["abort"] = await abort()
            record["body"] = "".join(chunks)
            record["reads"] = n
    except Exception as exc:  # a probe: record whatever happened
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["seconds"] = round(time.monotonic() - t0, 3)
    (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    print(f"{name}: status {record.get('status')} {len(record.get('body', ''))} chars {record.get('error', '')}")


async def sglang_part(model: str, out: Path, deadline: float) -> None:
    from rollout_backends.adapters.sglang import SGLangFleetConfig, start_sglang_fleet

    config = SGLangFleetConfig(
        model_path=model,
        workers=1,
        worker_kind="sglang",
        cuda_visible_devices=("0",),
        mem_fraction_static=0.12,
        attention_backend="triton",
        sampling_backend="pytorch",
        disable_cuda_graph=True,
        page_size=16,
        router="none",
        log_dir=str(out / "sglang-logs"),
        startup_timeout_s=max(30.0, deadline - time.monotonic() - 60),
    )
    fleet = await start_sglang_fleet(config)
    try:
        url = fleet.worker_urls[0]
        async with aiohttp.ClientSession() as s:
            base = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}
            await exchange(s, out, "sglang-plain", f"{url}/generate", {**base, "return_logprob": True})
            await exchange(s, out, "sglang-stream", f"{url}/generate", {**base, "return_logprob": True, "stream": True})
            await exchange(s, out, "sglang-stream-nologprob", f"{url}/generate", {**base, "stream": True})
            await exchange(
                s,
                out,
                "sglang-stream-topk",
                f"{url}/generate",
                {**base, "return_logprob": True, "top_logprobs_num": 3, "stream": True},
            )
            await exchange(
                s,
                out,
                "sglang-stream-prompt",
                f"{url}/generate",
                {**base, "return_logprob": True, "logprob_start_len": 0, "stream": True},
            )
            await exchange(
                s,
                out,
                "sglang-stream-batch",
                f"{url}/generate",
                {
                    "input_ids": [PROMPT, PROMPT[:9]],
                    **{k: v for k, v in base.items() if k != "input_ids"},
                    "return_logprob": True,
                    "stream": True,
                    "rid": ["b-0", "b-1"],
                },
            )
            plain = await (await s.post(f"{url}/generate", json={**base, "return_logprob": True})).json()
            text = plain.get("text") or ""
            stop = text[len(text) // 2 : len(text) // 2 + 3] if len(text) > 6 else None
            if stop:
                await exchange(
                    s,
                    out,
                    "sglang-stream-stop",
                    f"{url}/generate",
                    {
                        **base,
                        "sampling_params": {**base["sampling_params"], "stop": [stop]},
                        "return_logprob": True,
                        "stream": True,
                    },
                )

            async def abort_rid() -> Any:
                r = await s.post(f"{url}/abort_request", json={"rid": "probe-abort"})
                return {"status": r.status, "body": await r.text()}

            await exchange(
                s,
                out,
                "sglang-stream-abort",
                f"{url}/generate",
                {
                    "input_ids": PROMPT,
                    "sampling_params": {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True},
                    "return_logprob": True,
                    "stream": True,
                    "rid": "probe-abort",
                },
                abort=abort_rid,
            )
    finally:
        await fleet.aclose()


async def dynamo_part(model: str, out: Path, deadline: float) -> None:
    from rollout_backends import GenerateRequest, SamplingParams
    from rollout_backends.adapters.dynamo import DynamoFleetConfig, completion_body, launch_dynamo_fleet

    config = DynamoFleetConfig(
        model_path=model,
        served_model_name="tiny",
        workers=1,
        worker_kind="sglang",
        router_mode="round-robin",
        page_size=16,
        gpus=("0",),
        sglang_args=(*FLAGS, "--mem-fraction-static", "0.12"),
        ready_timeout=max(30.0, deadline - time.monotonic() - 40),
    )
    async with launch_dynamo_fleet(config, log_dir=out / "dynamo-logs") as fleet:
        url = f"{fleet.frontend_url}/v1/completions"
        greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
        async with aiohttp.ClientSession() as s:
            for name, req, logprobs in [
                ("dynamo-plain", GenerateRequest(input_ids=PROMPT, sampling=greedy, request_id="d-plain"), True),
                (
                    "dynamo-topk",
                    GenerateRequest(
                        input_ids=PROMPT,
                        sampling=SamplingParams(max_new_tokens=12, temperature=0.0, top_logprobs=3),
                        request_id="d-topk",
                    ),
                    True,
                ),
                (
                    "dynamo-prompt",
                    GenerateRequest(input_ids=PROMPT, sampling=greedy, request_id="d-prompt", prompt_logprobs_start=0),
                    True,
                ),
            ]:
                body = completion_body(req, "tiny", logprobs=logprobs)
                await exchange(s, out, name, url, body)
                await exchange(s, out, f"{name}-stream", url, {**body, "stream": True})


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--only", choices=["sglang", "dynamo"], default=None)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.budget_s
    global PROMPT
    vocab = json.loads((Path(a.model) / "config.json").read_text()).get("vocab_size")
    if isinstance(vocab, int):  # the tier's tiny model has 512 ids
        PROMPT = [t % vocab for t in PROMPT]
    for name, part in (("sglang", sglang_part), ("dynamo", dynamo_part)):
        if a.only not in (None, name):
            continue
        t = time.monotonic()
        try:
            await asyncio.wait_for(part(a.model, out, deadline), timeout=max(20.0, deadline - time.monotonic()))
        except Exception as exc:
            print(f"{name} part failed: {type(exc).__name__}: {exc}")
        print(f"{name} part: {time.monotonic() - t:.0f} s")


if __name__ == "__main__":
    asyncio.run(main())
