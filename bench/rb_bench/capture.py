"""Raw engine answers as they travel, one JSON file per exchange: the request body, the answer's
status, headers and raw body text.

SGLang's ``/generate`` plain and streamed (logprobs, top-k, prompt logprobs, a stop string, a
batch, an abort mid-stream), and the Dynamo frontend's ``/v1/completions`` (plain and SSE) in front
of ``dynamo.sglang`` through our shim. The codec's fixtures come from it
(``tests/data/h200_answers_2026-12-03.json``: SGLang 0.5.16, ai-dynamo 1.4.2, one H200, 2026-12-03,
then named ``bench/probes/stream_capture.py``); run it again on a new engine version and compare::

    PYTHONPATH=bench python -m rb_bench.capture OUT [--model DIR] [--only sglang|dynamo] [--budget-s 240]

Without ``--model`` it makes the GPU tier's tiny model (``make_tiny_model(OUT/model, 0)``, 512 ids)
and maps the prompt into its vocabulary. On the GPU machine: ``tools/gpu/session.sh capture``.
``--worker-kind reference`` sends the same exchanges to reference workers on CPU (what
``tests/test_bench_capture.py`` runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

#: A Qwen2.5-tokenizer sentence as ids (any ids do: each is taken modulo the model's vocabulary).
PROMPT = (9707, 11, 1879, 374, 264, 1273, 13, 576, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13)
#: The GPU tier's SGLang flags (docs/gpu-tier.md); the engine shares the GPU with nothing here.
FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph")
MEM_FRACTION = 0.12
ABORT_RID = "probe-abort"


async def exchange(
    session: aiohttp.ClientSession,
    out: Path,
    name: str,
    url: str,
    body: dict[str, Any],
    abort: Callable[[], Awaitable[Any]] | None = None,
) -> dict[str, Any]:
    """POST ``body`` and write what came back to ``out/<name>.json`` (an error is recorded, not
    raised). ``abort`` is awaited after the answer's third read and its result recorded."""
    t0 = time.monotonic()
    record: dict[str, Any] = {"url": url, "request": body}
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            record["status"] = resp.status
            record["headers"] = dict(resp.headers)
            chunks: list[str] = []
            async for raw in resp.content.iter_any():
                chunks.append(raw.decode("utf-8", "replace"))
                if abort is not None and len(chunks) == 3:
                    record["abort"] = await abort()
            record["body"] = "".join(chunks)
            record["reads"] = len(chunks)
    except Exception as exc:  # a capture: record whatever happened
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["seconds"] = round(time.monotonic() - t0, 3)
    (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    print(f"{name}: status {record.get('status')} {len(record.get('body', ''))} chars {record.get('error', '')}")
    return record


def sglang_bodies(prompt: Sequence[int]) -> dict[str, dict[str, Any]]:
    """The SGLang ``/generate`` bodies by exchange name (the stop string and the abort come later)."""
    base: dict[str, Any] = {"input_ids": list(prompt), "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}
    logprob = {**base, "return_logprob": True}
    return {
        "sglang-plain": logprob,
        "sglang-stream": {**logprob, "stream": True},
        "sglang-stream-nologprob": {**base, "stream": True},
        "sglang-stream-topk": {**logprob, "top_logprobs_num": 3, "stream": True},
        "sglang-stream-prompt": {**logprob, "logprob_start_len": 0, "stream": True},
        "sglang-stream-batch": {
            **logprob,
            "input_ids": [list(prompt), list(prompt[:9])],
            "stream": True,
            "rid": ["b-0", "b-1"],
        },
    }


def stop_body(plain: dict[str, Any], text: str) -> dict[str, Any] | None:
    """``plain`` streamed with a stop string taken from the middle of its own answer's text."""
    if len(text) <= 6:
        return None
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    return {**plain, "sampling_params": {**plain["sampling_params"], "stop": [stop]}, "stream": True}


async def sglang_exchanges(session: aiohttp.ClientSession, url: str, out: Path, prompt: Sequence[int]) -> None:
    """Every SGLang exchange against the worker at ``url``."""
    bodies = sglang_bodies(prompt)
    for name, body in bodies.items():
        await exchange(session, out, name, f"{url}/generate", body)
    plain = bodies["sglang-plain"]
    async with session.post(f"{url}/generate", json=plain) as resp:
        answer = await resp.json()
    stop = stop_body(plain, str(answer.get("text") or ""))
    if stop is not None:
        await exchange(session, out, "sglang-stream-stop", f"{url}/generate", stop)

    async def abort_rid() -> Any:
        async with session.post(f"{url}/abort_request", json={"rid": ABORT_RID}) as r:
            return {"status": r.status, "body": await r.text()}

    long = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    body = {"input_ids": list(prompt), "sampling_params": long, "return_logprob": True, "stream": True}
    await exchange(session, out, "sglang-stream-abort", f"{url}/generate", {**body, "rid": ABORT_RID}, abort=abort_rid)


async def sglang_part(model: str, out: Path, deadline: float, worker_kind: str, prompt: Sequence[int]) -> None:
    """One SGLang worker, no router, started as the GPU tier starts it."""
    from rollout_backends.adapters.sglang import SGLangFleetConfig, start_sglang_fleet

    gpu = worker_kind == "sglang"
    config = SGLangFleetConfig(
        model_path=model,
        workers=1,
        worker_kind=worker_kind,
        cuda_visible_devices=("0",) if gpu else None,
        mem_fraction_static=MEM_FRACTION if gpu else None,
        page_size=16,
        router="none",
        log_dir=str(out / "sglang-logs"),
        startup_timeout_s=max(30.0, deadline - time.monotonic() - 60),
    )
    fleet = await start_sglang_fleet(config)
    try:
        async with aiohttp.ClientSession() as session:
            await sglang_exchanges(session, fleet.worker_urls[0], out, prompt)
    finally:
        await fleet.aclose()


async def dynamo_part(model: str, out: Path, deadline: float, worker_kind: str, prompt: Sequence[int]) -> None:
    """A round-robin frontend and one worker: each body our wire builds, plain and streamed."""
    from rollout_backends import GenerateRequest, SamplingParams
    from rollout_backends.adapters.dynamo import DynamoFleetConfig, completion_body, launch_dynamo_fleet

    config = DynamoFleetConfig(
        model_path=model,
        served_model_name="tiny",
        workers=1,
        worker_kind=worker_kind,
        router_mode="round-robin",
        page_size=16,
        gpus=("0",) if worker_kind == "sglang" else (),
        sglang_args=(*FLAGS, "--mem-fraction-static", str(MEM_FRACTION)),
        ready_timeout=max(30.0, deadline - time.monotonic() - 40),
    )
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    topk = SamplingParams(max_new_tokens=12, temperature=0.0, top_logprobs=3)
    requests = {
        "dynamo-plain": GenerateRequest(input_ids=prompt, sampling=greedy, request_id="d-plain"),
        "dynamo-topk": GenerateRequest(input_ids=prompt, sampling=topk, request_id="d-topk"),
        "dynamo-prompt": GenerateRequest(
            input_ids=prompt, sampling=greedy, request_id="d-prompt", prompt_logprobs_start=0
        ),
    }
    async with launch_dynamo_fleet(config, log_dir=out / "dynamo-logs") as fleet:
        url = f"{fleet.frontend_url}/v1/completions"
        async with aiohttp.ClientSession() as session:
            for name, req in requests.items():
                body = completion_body(req, "tiny", logprobs=True)
                await exchange(session, out, name, url, body)
                await exchange(session, out, f"{name}-stream", url, {**body, "stream": True})


def model_and_prompt(model: str | None, out: Path) -> tuple[str, tuple[int, ...]]:
    """The model folder (made when none is given) and ``PROMPT`` within its vocabulary."""
    if model is None:
        from rollout_backends.adapters.reference import make_tiny_model

        model = str(make_tiny_model(out / "model", 0))
    vocab = json.loads((Path(model) / "config.json").read_text()).get("vocab_size")
    return model, tuple(t % vocab for t in PROMPT) if isinstance(vocab, int) else PROMPT


async def run(args: argparse.Namespace) -> int:
    """Each part in turn within the budget; a part that fails is reported and the next one runs."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    model, prompt = model_and_prompt(args.model, out)
    failed = 0
    for name, part in (("sglang", sglang_part), ("dynamo", dynamo_part)):
        if args.only not in (None, name):
            continue
        t = time.monotonic()
        try:
            work = part(model, out, deadline, args.worker_kind, prompt)
            await asyncio.wait_for(work, timeout=max(20.0, deadline - time.monotonic()))
        except Exception as exc:
            failed += 1
            print(f"{name} part failed: {type(exc).__name__}: {exc}")
        print(f"{name} part: {time.monotonic() - t:.0f} s")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rb_bench.capture", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder for one JSON file per exchange (and the logs)")
    p.add_argument("--model", default=None, help="model folder with a tokenizer (default: make the tiny model)")
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--only", choices=["sglang", "dynamo"], default=None)
    p.add_argument("--worker-kind", choices=["sglang", "reference"], default="sglang", help="reference: on CPU")
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
