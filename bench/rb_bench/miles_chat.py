"""Miles' agentic session through the facade over SGLang and Dynamo, compared with stock SGLang.

    PYTHONPATH=bench python -m rb_bench.miles_chat --out DIR [--engine sglang|reference] [--gpus 0]
        [--budget-s 420]

Targets, one after another on the same model (``rb_bench.tool_call_model``: every turn is
reasoning plus a ``get_weather`` call, made here from the tiny model, no download):

* ``stock``: stock SGLang (``sglang.launch_server``) started with ``--tool-call-parser qwen25
  --reasoning-parser qwen3 --enable-cache-report``, its ``/v1/chat/completions`` called directly;
* ``facade-sglang``: the facade (same parser flags) over 2 SGLang workers behind smg (``manual``
  policy, Miles' default with a session server);
* ``facade-dynamo``: the facade over the Dynamo 1.4.2 frontend and 2 ``dynamo.sglang`` workers
  (through our shim).

Each runs :func:`rb_bench.miles_session.tool_session` (Miles' session server stand-in, 4 turns with
tool messages, a ``length`` cut, a one-step rollback retry, a mid-turn abort). Every facade target's
answers are compared turn by turn with the baseline's (``stock``; on CPU, where the reference worker
serves no chat route, ``facade-sglang``): the assistant message (tool-call ids drawn at random are
masked), ``finish_reason``, ``matched_stop``, ``meta_info.finish_reason``, the output token ids,
``usage`` without the cache details (each fleet's cache history differs) and the largest
|Δ logprob|; of the aborted turn, only that it finished ``abort`` with non-null content.

Writes ``DIR/results.json`` and ``DIR/results.md``; exit 0 when every compared turn is equal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

from .miles_session import SessionServer, tool_session
from .tool_call_model import TOOL, make_tool_call_model

TOOL_PARSER, REASONING_PARSER = "qwen25", "qwen3"
PARSER_FLAGS = ("--tool-call-parser", TOOL_PARSER, "--reasoning-parser", REASONING_PARSER, "--enable-cache-report")
SGLANG_FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph")
TARGETS = ("stock", "facade-sglang", "facade-dynamo")
LOGPROB_TOLERANCE = 1e-3
_RANDOM_ID = re.compile(r"^call_[0-9a-f]{24}$")


@attrs.frozen
class Config:
    out: Path
    engine: str = "sglang"
    gpus: tuple[str, ...] = ("0",)
    budget_s: float = 420.0
    mem_fraction: float = 0.12

    @property
    def sglang(self) -> bool:
        return self.engine == "sglang"


def _sglang_config(cfg: Config, model: Path, logs: Path, timeout: float, **kw: Any) -> Any:
    from rollout_backends.adapters.sglang import SGLangFleetConfig

    gpu: dict[str, Any] = {}
    if cfg.sglang:
        gpu = dict(
            cuda_visible_devices=cfg.gpus, mem_fraction_static=cfg.mem_fraction, attention_backend=SGLANG_FLAGS[1],
            sampling_backend=SGLANG_FLAGS[3], disable_cuda_graph=True,
        )  # fmt: skip
    return SGLangFleetConfig(
        model_path=str(model), worker_kind=cfg.engine, page_size=16, health_check_interval_s=2,
        log_dir=str(logs), startup_timeout_s=timeout, **gpu, **kw,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def _stock(cfg: Config, model: Path, logs: Path, timeout: float) -> AsyncIterator[str]:
    from rollout_backends.adapters.sglang import launch_sglang_fleet

    config = _sglang_config(cfg, model, logs, timeout, workers=1, router="none", extra_server_args=PARSER_FLAGS)
    async with launch_sglang_fleet(config) as fleet:
        yield fleet.worker_urls[0]


@contextlib.asynccontextmanager
async def _backend(kind: str, cfg: Config, model: Path, logs: Path, timeout: float) -> AsyncIterator[Any]:
    if kind == "facade-sglang":
        from rollout_backends.adapters.sglang import launch_sglang_fleet

        config = _sglang_config(cfg, model, logs, timeout, workers=2, router="smg", router_policy="manual")
        async with launch_sglang_fleet(config) as fleet:
            yield fleet.backend
        return
    from rollout_backends.adapters.dynamo import DynamoFleetConfig, launch_dynamo_fleet

    sglang_args = (*SGLANG_FLAGS, "--mem-fraction-static", str(cfg.mem_fraction)) if cfg.sglang else ()
    config = DynamoFleetConfig(
        model_path=model, workers=2, worker_kind=cfg.engine, router_mode="round-robin", page_size=16,
        session_affinity_ttl_secs=600, gpus=cfg.gpus if cfg.sglang else (), sglang_args=sglang_args,
        ready_timeout=timeout,
    )  # fmt: skip
    async with launch_dynamo_fleet(config, log_dir=logs) as running:
        yield await running.connect()


@contextlib.asynccontextmanager
async def _facade(kind: str, cfg: Config, model: Path, logs: Path, timeout: float) -> AsyncIterator[str]:
    from transformers import AutoTokenizer

    from rollout_backends.integrations.miles import MilesFacade, start_facade

    async with _backend(kind, cfg, model, logs, timeout) as backend:
        await backend.wait_ready(timeout)
        facade = MilesFacade(
            backend,
            tokenizer=AutoTokenizer.from_pretrained(str(model)),
            model_path=str(model),
            tool_call_parser=TOOL_PARSER,
            reasoning_parser=REASONING_PARSER,
        )
        running = await start_facade(facade, port=0)
        try:
            yield running.url
        finally:
            await running.stop()


async def miles_abort(client: httpx.AsyncClient, router: str) -> None:
    """Miles' abort loop: ``abort_all`` on every worker the router lists; a bare engine (no worker
    list) is aborted itself."""
    listing = await client.get(f"{router}/workers")
    urls = [w["url"] for w in listing.json()["workers"]] if listing.status_code == 200 else [router]
    for url in urls:
        (await client.post(f"{url}/abort_request", json={"abort_all": True})).raise_for_status()


async def run_target(kind: str, cfg: Config, model: Path, timeout: float) -> dict[str, Any]:
    """One target's session: its answers by turn, or the error that stopped it."""
    from transformers import AutoTokenizer

    logs = cfg.out / "logs" / kind
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    opened = _stock(cfg, model, logs, timeout) if kind == "stock" else _facade(kind, cfg, model, logs, timeout)
    try:
        async with opened as router, httpx.AsyncClient(timeout=120) as client:
            started = time.monotonic() - t0
            session = SessionServer(client, router, AutoTokenizer.from_pretrained(str(model)))
            turns = await tool_session(session, [TOOL], kind, lambda: miles_abort(client, router))
    except Exception as exc:  # a target that fails is reported, the others still run
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "seconds": round(time.monotonic() - t0, 1)}
    return {"ok": True, "startup_s": round(started, 1), "seconds": round(time.monotonic() - t0, 1), "turns": turns}


def _comparable(answer: dict[str, Any]) -> dict[str, Any]:
    choice = answer["choices"][0]
    message = json.loads(json.dumps(choice["message"]))
    for call in message.get("tool_calls") or ():
        if _RANDOM_ID.match(call.get("id") or ""):
            call["id"] = "call_<random>"
    usage = {k: v for k, v in answer["usage"].items() if k != "prompt_tokens_details"}
    meta = choice["meta_info"]
    return {
        "message": message,
        "finish_reason": choice["finish_reason"],
        "matched_stop": choice["matched_stop"],
        "meta_info.finish_reason": meta["finish_reason"],
        "output_ids": [e[1] for e in meta["output_token_logprobs"]],
        "usage": usage,
    }


def compare_turn(name: str, base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """The differences of one turn's answers (empty: equal), and the largest |Δ logprob|."""
    if name == "turn4_abort":
        diffs = [
            f"{who}: finish {a['choices'][0]['finish_reason']!r}, content {a['choices'][0]['message']['content']!r}"
            for who, a in (("baseline", base), ("target", other))
            if a["choices"][0]["finish_reason"] != "abort" or a["choices"][0]["message"]["content"] is None
        ]
        return {"equal": not diffs, "differences": diffs, "max_abs_dlogprob": None}
    a, b = _comparable(base), _comparable(other)
    diffs = [f"{key}: baseline {a[key]!r}, target {b[key]!r}" for key in a if a[key] != b[key]]
    base_lps, other_lps = (t["choices"][0]["meta_info"]["output_token_logprobs"] for t in (base, other))
    lps = [(x[0], y[0]) for x, y in zip(base_lps, other_lps, strict=False)]  # a length gap is in output_ids
    worst = max((abs(x - y) for x, y in lps), default=0.0)
    if worst > LOGPROB_TOLERANCE:
        diffs.append(f"logprobs differ by {worst:.3g} > {LOGPROB_TOLERANCE}")
    return {"equal": not diffs, "differences": diffs, "max_abs_dlogprob": worst}


def compare(results: dict[str, dict[str, Any]]) -> tuple[str | None, dict[str, Any]]:
    """Each facade target against the baseline (``stock`` where it ran, else the first that did)."""
    ran = [k for k in TARGETS if results.get(k, {}).get("ok")]
    base = "stock" if "stock" in ran else (ran[0] if ran else None)
    out: dict[str, Any] = {}
    for kind in ran:
        if kind == base:
            continue
        turns = results[base]["turns"] if base else {}
        out[kind] = {name: compare_turn(name, turns[name], results[kind]["turns"][name]) for name in turns}
    return base, out


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {}
    for dist in ("rollout-backends", "sglang", "ai-dynamo", "smg", "torch", "transformers"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def _markdown(doc: dict[str, Any]) -> str:
    lines = [f"# Miles' agentic session: facade vs {doc['baseline']} ({doc['engine']})", ""]
    for kind, res in doc["targets"].items():
        state = f"ran in {res['seconds']} s" if res.get("ok") else res.get("error") or res.get("skipped")
        lines.append(f"* `{kind}`: {state}")
    lines += ["", "| target | turn | equal | max abs dlogprob | differences |", "|---|---|---|---|---|"]
    for kind, turns in doc["comparisons"].items():
        for name, c in turns.items():
            lines.append(
                f"| {kind} | {name} | {c['equal']} | {c['max_abs_dlogprob']} | {'; '.join(c['differences'])} |"
            )
    lines += ["", f"verdict: **{doc['verdict']}**", ""]
    return "\n".join(lines)


async def run(cfg: Config) -> dict[str, Any]:
    from rollout_backends.adapters.reference import make_tiny_model

    t0 = time.monotonic()
    cfg.out.mkdir(parents=True, exist_ok=True)
    model = make_tool_call_model(cfg.out / "model", make_tiny_model(cfg.out / "model-base", seed=0))
    results: dict[str, dict[str, Any]] = {}
    for kind in TARGETS:
        left = cfg.budget_s - (time.monotonic() - t0)
        if kind == "stock" and not cfg.sglang:
            results[kind] = {
                "ok": False,
                "skipped": "no stock SGLang on CPU (the reference worker serves no chat route)",
            }
        elif left < 60:
            results[kind] = {"ok": False, "skipped": f"budget: {left:.0f} s left"}
        else:
            results[kind] = await run_target(kind, cfg, model, timeout=min(240.0, left - 30.0))
        print(f"miles_chat: {kind}: {results[kind].get('error') or results[kind].get('skipped') or 'ok'}", flush=True)
    base, comparisons = compare(results)
    equal = bool(comparisons) and all(c["equal"] for turns in comparisons.values() for c in turns.values())
    doc = {
        "engine": cfg.engine,
        "versions": _versions(),
        "parsers": {"tool_call_parser": TOOL_PARSER, "reasoning_parser": REASONING_PARSER},
        "baseline": base,
        "targets": results,
        "comparisons": comparisons,
        "verdict": "equal" if equal else ("nothing compared" if not comparisons else "different"),
        "seconds": round(time.monotonic() - t0, 1),
    }
    (cfg.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    (cfg.out / "results.md").write_text(_markdown(doc), encoding="utf-8")
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rb_bench.miles_chat", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="results folder (results.json, results.md, logs/)")
    p.add_argument("--engine", choices=("sglang", "reference"), default="sglang", help="worker kind (default: sglang)")
    p.add_argument("--gpus", default="0", help="GPU indices for every fleet (default: 0)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for all targets (default: 420)")
    ns = p.parse_args(argv)
    cfg = Config(out=ns.out, engine=ns.engine, gpus=tuple(ns.gpus.split(",")), budget_s=ns.budget_s)
    doc = asyncio.run(run(cfg))
    print(_markdown(doc), flush=True)
    return 0 if doc["verdict"] == "equal" else 1


if __name__ == "__main__":
    sys.exit(main())
