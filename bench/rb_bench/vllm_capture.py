"""Raw answers of vLLM 0.26 and of dynamo.vllm (ai-dynamo 1.4.2) to every call the adapters send, on
one GPU, for the CPU tests (``tests/vllm/test_captured_answers.py`` reads them from ``tests/data/``).

::

    PYTHONPATH=bench python -m rb_bench.vllm_capture --out DIR [--budget-s 220] [--only vllm|dynamo]

Makes the tiny Qwen2 model (seed 0, and seed 1 as the other weights), starts at once a vLLM server
(``VllmServerCommand``: ``VLLM_SERVER_DEV_MODE=1``, ``--enforce-eager``, ``TRITON_ATTN``,
``--enable-sleep-mode``) and a
Dynamo fleet (frontend, round robin, one ``dynamo.vllm`` worker), then plays a fixed scenario on
each and writes every request with its answer (status, raw body, milliseconds; streamed bodies
whole) to ``DIR/vllm-0.26.0-answers.json`` and ``DIR/dynamo-vllm-1.4.2-answers.json``, plus
``DIR/capture-logs.txt`` (the processes' log tails). What each scenario step shows is in its
``note``. Nothing here asserts: the tests judge the answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

__all__ = ["Recorder", "main"]

VLLM_FILE = "vllm-0.26.0-answers.json"
DYNAMO_FILE = "dynamo-vllm-1.4.2-answers.json"
LONG = 1500  # tokens of a request meant to be caught in flight
#: A fixed KV pool: vLLM's memory profiling would count the other engine starting on the GPU.
KV_ARGS = ("--kv-cache-memory-bytes", str(1 << 30))


class Recorder:
    """Sends requests and keeps each with its answer, in order.

    ``path`` is under ``base``, or a whole URL (a Dynamo worker's system port). Each call opens its
    own connection: vLLM 0.26 closes a connection after an answer of HTTP 500 (uvicorn, once the
    exception reached it), and a kept-alive one reused at once was reset under the next request,
    which never reached the server (the H100 capture of 2026-12-05: ``sleep`` after
    ``rpc_unknown``, ``reload_missing`` after ``start_weight_update_unconfigured``)."""

    def __init__(self, session: aiohttp.ClientSession, base: str, about: str) -> None:
        self.session, self.base = session, base
        self.doc: dict[str, Any] = {"_about": about, "exchanges": []}

    def url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else self.base + path

    async def call(
        self, name: str, method: str, path: str, body: Any = None, *, note: str = "", headers: Any = None
    ) -> tuple[int, Any]:
        t0 = time.perf_counter()
        headers = {**(headers or {}), "Connection": "close"}
        try:
            async with self.session.request(method, self.url(path), json=body, headers=headers) as resp:
                raw = await resp.read()
                status = resp.status
        except Exception as exc:  # recorded: the next step still runs
            raw, status = f"{type(exc).__name__}: {exc}".encode(), -1
        text = raw.decode("utf-8", errors="replace")
        self.doc["exchanges"].append(
            {
                "name": name,
                "method": method,
                "path": path,
                "request": body,
                "status": status,
                "body": text,
                "ms": round((time.perf_counter() - t0) * 1000, 1),
                "note": note,
            }
        )
        try:
            return status, json.loads(text) if text and not text.startswith("data:") else text
        except ValueError:
            return status, text

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.doc, indent=1) + "\n")


def _sp(**kw: Any) -> dict[str, Any]:
    sp = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "detokenize": False}
    sp.update(kw)
    return sp


def _gen(rid: str, ids: list[int], stream: bool = False, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"request_id": rid, "token_ids": ids, "sampling_params": _sp(**kw)}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


PROMPT = [491, 11, 343, 374, 264, 249, 13, 64, 390, 52, 435, 416, 404, 279, 318, 442, 13]
GEN = "/inference/v1/generate"


async def _in_flight(
    rec: Recorder, name: str, body: dict[str, Any], action: Callable[[], Awaitable[Any]], settle: float = 0.4
) -> None:
    """Start a long generation, run ``action`` while it is in flight, then wait for its answer."""
    task = asyncio.ensure_future(rec.call(name, "POST", GEN, body, note="in flight while the next step ran"))
    await asyncio.sleep(settle)
    await action()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(task, 60.0)


async def vllm_scenario(rec: Recorder, alt: Path, base: Path) -> None:
    """Every route the vLLM adapter sends, and its answers in the states it meets them in."""
    await _reads_and_generations(rec)
    await _aborts(rec)
    for mode, query in (
        ("abort", "mode=abort&clear_cache=false"),
        ("retract", "mode=keep&clear_cache=true"),
        ("in_place", "mode=keep&clear_cache=false"),
    ):
        await _pause_round(rec, mode, query)
    await _loads_and_sleep(rec, alt, base)
    await _failed_load(rec, base)
    await _wake_all_after_partial(rec)


async def _wake_all_after_partial(rec: Recorder) -> None:
    """A plain ``/wake_up`` after ``tags=weights``, which the adapter never sends: vLLM 0.26 failed
    it and answered nothing after it (H100 capture of 2026-12-06 05:18, kept in
    ``tests/data/vllm-0.26.0-plain-wake-up.json``). Last; after the failed load above vLLM 0.26's
    engine is dead, so these show that (capture of 06:21) unless a later vLLM survives the load."""
    await rec.call("sleep_again", "POST", "/sleep?level=1&mode=keep")
    await rec.call("wake_up_weights_again", "POST", "/wake_up?tags=weights")
    await rec.call("wake_up", "POST", "/wake_up", note="after tags=weights: HTTP 500, then no answers")


async def _reads_and_generations(rec: Recorder) -> None:
    """The read-only routes, then generations: greedy, top-k, prompt logprobs, stops, a stream, bad input."""
    c = rec.call
    for path in ("/health", "/is_paused", "/is_sleeping", "/v1/models", "/get_world_size"):
        await c(path.strip("/"), "GET", path)
    _, info = await c("server_info", "GET", "/server_info?config_format=json", note="system_env dropped below")
    if isinstance(info, dict):
        info.pop("system_env", None)
        rec.doc["exchanges"][-1]["body"] = json.dumps(info)
    await c("greedy", "POST", GEN, _gen("greedy", PROMPT, logprobs=0))
    await c(
        "top3_asked_4_sampled",
        "POST",
        GEN,
        _gen("top", PROMPT, logprobs=4, temperature=1.0, seed=7),
        note="the adapter asks k+1; sampled token listed first",
    )
    await c("prompt_logprobs", "POST", GEN, _gen("plp", PROMPT, max_tokens=1, logprobs=0, prompt_logprobs=0))
    _, ans = await c("stop_probe", "POST", GEN, _gen("stop-probe", PROMPT, max_tokens=6, logprobs=0))
    ids = ans["choices"][0]["token_ids"] if isinstance(ans, dict) else [5]
    await c(
        "stop_token",
        "POST",
        GEN,
        _gen("stop", PROMPT, max_tokens=6, logprobs=0, ignore_eos=False, stop_token_ids=[ids[min(2, len(ids) - 1)]]),
        note="stops at the third token of stop_probe: is it kept in token_ids?",
    )
    await c("stream", "POST", GEN, _gen("stream", PROMPT, stream=True, max_tokens=6, logprobs=2))
    for name, body in (
        ("bad_temperature", _gen("bad1", PROMPT, temperature=5.0)),
        ("bad_token_id", _gen("bad2", [*PROMPT, 999999])),
        ("bad_empty", _gen("bad3", [])),
        ("bad_max_tokens", _gen("bad4", PROMPT, max_tokens=0)),
        ("bad_logprobs", _gen("bad5", PROMPT, logprobs=50)),
        ("bad_negative_token", _gen("bad6", [1, -2])),
    ):
        await c(name, "POST", GEN, body)


async def _aborts(rec: Recorder) -> None:
    """Aborts of one request, of all, and of a stream, each while it runs."""
    c = rec.call
    long = _gen("long-1", PROMPT, max_tokens=LONG, logprobs=0)
    await _in_flight(
        rec,
        "aborted_one",
        long,
        lambda: c("abort_one", "POST", "/abort_requests", {"request_ids": ["generate-tokens-long-1"]}),
    )
    await _in_flight(
        rec,
        "aborted_all",
        _gen("long-2", PROMPT, max_tokens=LONG, logprobs=0),
        lambda: c("abort_all", "POST", "/abort_requests", {}),
    )
    await _in_flight(
        rec,
        "stream_aborted",
        _gen("long-3", PROMPT, stream=True, max_tokens=LONG, logprobs=0),
        lambda: c("abort_stream", "POST", "/abort_requests", {"request_ids": ["generate-tokens-long-3"]}),
    )


async def _loads_and_sleep(rec: Recorder, alt: Path, base: Path) -> None:
    """Loads from disk (the alt weights and back), an unknown RPC, sleep and wake-up, an unconfigured
    transfer."""
    c = rec.call
    await c("reload_alt", "POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(alt)}})
    await c("greedy_alt", "POST", GEN, _gen("greedy-alt", PROMPT, logprobs=0), note="differs from greedy")
    await c(
        "reload_base", "POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(base)}}
    )
    await c("greedy_base_again", "POST", GEN, _gen("greedy-2", PROMPT, logprobs=0), note="equals greedy")
    await c("rpc_unknown", "POST", "/collective_rpc", {"method": "no_such_method"})
    await c("sleep", "POST", "/sleep?level=1&mode=keep")
    await c("is_sleeping_asleep", "GET", "/is_sleeping")
    await c("wake_up_weights", "POST", "/wake_up?tags=weights")
    await c("is_sleeping_half", "GET", "/is_sleeping")
    # The adapter's resume_memory: one call per tag (adapters/vllm/_wire.py _wake).
    await c("wake_up_kv_cache", "POST", "/wake_up?tags=kv_cache")
    await c("is_sleeping_awake", "GET", "/is_sleeping")
    await c("greedy_after_wake", "POST", GEN, _gen("greedy-3", PROMPT, logprobs=0), note="equals greedy")
    await c("start_weight_update_unconfigured", "POST", "/start_weight_update", note="no --weight-transfer-config")


async def _failed_load(rec: Recorder, base: Path) -> None:
    """A load from a missing checkpoint, then one from the good path: does it serve again?"""
    # Last, as it may leave the engine unable to serve: a load from a missing checkpoint fails inside
    # vLLM's layerwise reload (get_all_weights is a generator: the path is read after the layers were
    # set up), then does a reload from the good path bring it back?
    c = rec.call
    missing = str(base.parent / "no-such-checkpoint")
    rpc = "/collective_rpc"
    await c("reload_missing", "POST", rpc, {"method": "reload_weights", "kwargs": {"weights_path": missing}})
    await c("greedy_after_failed_reload", "POST", GEN, _gen("greedy-4", PROMPT, logprobs=0), note="serves?")
    await c(
        "reload_base_after_failure", "POST", rpc, {"method": "reload_weights", "kwargs": {"weights_path": str(base)}}
    )
    await c("greedy_after_recovery", "POST", GEN, _gen("greedy-5", PROMPT, logprobs=0), note="equals greedy?")


async def _pause_round(rec: Recorder, mode: str, query: str) -> None:
    c = rec.call

    async def during() -> None:
        await c(f"metrics_before_{mode}", "GET", "/metrics", note="num_preemptions before the pause")
        await c(f"pause_{mode}", "POST", f"/pause?{query}")
        await c(f"is_paused_{mode}", "GET", "/is_paused")
        await c(f"flush_while_paused_{mode}", "POST", "/reset_prefix_cache")
        newcomer = asyncio.ensure_future(
            c(
                f"newcomer_{mode}",
                "POST",
                GEN,
                _gen(f"new-{mode}", PROMPT, logprobs=0),
                note="sent while paused: waits until resume",
            )
        )
        await asyncio.sleep(0.5)
        await c(f"metrics_paused_{mode}", "GET", "/metrics", note="num_preemptions while paused")
        await c(f"resume_{mode}", "POST", "/resume")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(newcomer, 60.0)

    body = _gen(f"paused-{mode}", PROMPT, max_tokens=LONG, logprobs=0)  # still running at the pause
    await _in_flight(rec, f"in_flight_{mode}", body, during)
    _trim_metrics(rec)


def _trim_metrics(rec: Recorder) -> None:
    """Keep only the preemption and request counters of /metrics answers."""
    for ex in rec.doc["exchanges"]:
        if ex["path"] == "/metrics" and "\n" in ex["body"]:
            keep = [ln for ln in ex["body"].splitlines() if "preempt" in ln or "num_requests" in ln]
            ex["body"] = "\n".join(keep)


async def dynamo_scenario(rec: Recorder, system: str, alt: Path, base: Path) -> None:
    """The frontend's /v1/completions in front of dynamo.vllm, and the worker's engine routes."""
    c = rec.call
    ex = ["completion_token_ids", "worker_id", "timing", "engine_data", "stop_reason"]

    def comp(rid: str, **kw: Any) -> tuple[dict[str, Any], dict[str, str]]:
        import uuid

        body = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": False,
            "n": 1,
            "logprobs": 0,
            "nvext": {"extra_fields": ex, "annotations": [f"rid:{rid}"]},
        }
        body.update(kw)
        return body, {"x-dynamo-request-id": str(uuid.uuid5(uuid.NAMESPACE_URL, rid))}

    for name, kw in (
        ("greedy", {}),
        ("top3", {"logprobs": 3, "return_tokens_as_token_ids": True}),
        ("prompt_logprobs", {"prompt_logprobs": 0, "max_tokens": 1}),
        ("stream", {"stream": True, "stream_options": {"include_usage": True}}),
    ):
        body, headers = comp(name, **kw)
        await c(name, "POST", "/v1/completions", body, headers=headers)
    await c("engine_get_weight_version", "POST", f"{system}/engine/get_weight_version", {})
    await c("engine_liveness", "POST", f"{system}/engine/liveness_probe", {})
    await c("engine_rollout_info", "POST", f"{system}/engine/rollout/info", {}, note="404: not our worker")
    await c("engine_call_tokenizer_manager", "POST", f"{system}/engine/call_tokenizer_manager", {}, note="404 expected")
    long, headers = comp("long", max_tokens=LONG)
    task = asyncio.ensure_future(c("aborted_one", "POST", "/v1/completions", long, headers=headers))
    await asyncio.sleep(0.5)
    await c("abort_one", "POST", f"{system}/engine/abort_request", {"request_id": headers["x-dynamo-request-id"]})
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(task, 60.0)
    for mode, body in (
        ("abort", {"mode": "abort", "clear_cache": False}),
        ("retract", {"mode": "keep", "clear_cache": True}),
        ("in_place", {"mode": "keep", "clear_cache": False}),
    ):
        long, headers = comp(f"paused-{mode}", max_tokens=LONG)  # still running at the pause
        task = asyncio.ensure_future(c(f"in_flight_{mode}", "POST", "/v1/completions", long, headers=headers))
        await asyncio.sleep(0.4)
        await c(f"pause_{mode}", "POST", f"{system}/engine/pause_generation", body)
        await c(f"flush_{mode}", "POST", f"{system}/engine/flush_cache", {}, note="in_place: does it say refused?")
        if mode == "retract":
            await c("disk_while_paused", "POST", f"{system}/engine/update_weights_from_disk", {"model_path": str(alt)})
            await c(
                "start_session_unconfigured",
                "POST",
                f"{system}/engine/update_weights_from_distributed",
                {"engine_rpc": "start_weight_update", "reset_prefix_cache": False},
            )
        await c(f"resume_{mode}", "POST", f"{system}/engine/resume_generation", {})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(task, 60.0)
    await c(
        "disk_unpaused",
        "POST",
        f"{system}/engine/update_weights_from_disk",
        {"model_path": str(base)},
        note="refused: not paused",
    )
    await c("sleep", "POST", f"{system}/engine/control/sleep", {"level": 1})
    await c("wake_up", "POST", f"{system}/engine/control/wake_up", {})
    body, headers = comp("after-wake")
    await c("greedy_after_wake", "POST", "/v1/completions", body, headers=headers)
    # Last: a load from a missing checkpoint (see vllm_scenario), paused as the route wants.
    await c("pause_for_missing", "POST", f"{system}/engine/pause_generation", {"mode": "abort", "clear_cache": False})
    await c(
        "disk_missing", "POST", f"{system}/engine/update_weights_from_disk", {"model_path": str(base.parent / "none")}
    )
    await c("resume_after_missing", "POST", f"{system}/engine/resume_generation", {})
    body, headers = comp("after-failed-load")
    await c("greedy_after_failed_load", "POST", "/v1/completions", body, headers=headers)


@contextlib.asynccontextmanager
async def _vllm_server(work: Path, model: Path, log_dir: Path) -> AsyncIterator[str]:
    from rollout_backends.adapters.vllm import VllmServerCommand
    from rollout_backends.launch import NodeContext, Supervisor

    async with Supervisor(log_dir) as sup:
        cmd = VllmServerCommand(
            model_path=str(model),
            served_model_name="tiny",
            gpu_memory_utilization=0.2,
            sleep_mode=True,  # as the fake (and the dynamo.vllm worker) serve /sleep: a real release
            extra_args=KV_ARGS,
        )
        launch = cmd.build(NodeContext.on(0, "127.0.0.1", str(log_dir), gpu_ids=("0",)))
        await sup.start(launch.spec)
        await sup.wait_ready([launch.spec.name], timeout=400)
        yield launch.control_url


@contextlib.asynccontextmanager
async def _dynamo_fleet(model: Path, log_dir: Path) -> AsyncIterator[tuple[str, str]]:
    from rollout_backends.adapters.dynamo import DynamoFleetConfig, launch_dynamo_fleet

    cfg = DynamoFleetConfig(
        model_path=str(model),
        served_model_name="tiny",
        workers=1,
        worker_kind="vllm",
        router_mode="round-robin",
        gpus=("0",),
        gpu_memory_utilization=0.2,
        vllm_args=KV_ARGS,
        ready_timeout=400,
    )
    async with launch_dynamo_fleet(cfg, log_dir=log_dir) as fleet:
        yield fleet.frontend_url, fleet.worker_urls[0]


async def _capture(which: str, out: Path, work: Path, base: Path, alt: Path) -> None:
    logs = work / f"logs-{which}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        if which == "vllm":
            async with _vllm_server(work, base, logs) as url:
                rec = Recorder(
                    session,
                    url,
                    "vLLM 0.26.0 (VLLM_SERVER_DEV_MODE=1, --enforce-eager, TRITON_ATTN, --enable-sleep-mode),"
                    " tiny Qwen2 seed 0",
                )
                try:
                    await vllm_scenario(rec, alt, base)
                finally:
                    rec.save(out / VLLM_FILE)
        else:
            async with _dynamo_fleet(base, logs) as (frontend, system):
                rec = Recorder(
                    session, frontend, "ai-dynamo 1.4.2 frontend (round-robin) + dynamo.vllm --enable-rl (vLLM 0.26.0)"
                )
                try:
                    await dynamo_scenario(rec, system, alt, base)
                finally:
                    rec.save(out / DYNAMO_FILE)


async def run(out: Path, budget_s: float, only: str | None) -> int:
    from rollout_backends.adapters.reference import make_tiny_model

    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rb-vllm-capture-"))
    base, alt = make_tiny_model(work / "model-seed0", 0), make_tiny_model(work / "model-seed1", 1)
    which = [w for w in ("vllm", "dynamo") if only in (None, w)]
    results = await asyncio.wait_for(
        asyncio.gather(*(_capture(w, out, work, base, alt) for w in which), return_exceptions=True), budget_s
    )
    tails = []
    for w, r in zip(which, results, strict=True):
        print(f"{w}: {'ok' if r is None else f'{type(r).__name__}: {r}'}", flush=True)
        for log in sorted((work / f"logs-{w}").glob("*.log")):
            tails.append(f"== {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-60:]))
    (out / "capture-logs.txt").write_text("\n\n".join(tails)[-200_000:])
    return 0 if all(r is None for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rb_bench.vllm_capture", description=__doc__.split("::")[0])
    ap.add_argument("--out", required=True, type=Path, help="where the answers go (created)")
    ap.add_argument("--budget-s", type=float, default=220.0, help="hard limit for both captures")
    ap.add_argument("--only", choices=("vllm", "dynamo"), default=None, help="one capture only (default: both)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return asyncio.run(run(args.out, args.budget_s, args.only))


if __name__ == "__main__":
    sys.exit(main())
