"""Miles' agentic session through the facade over SGLang and Dynamo, compared with stock SGLang.

    PYTHONPATH=bench python -m rb_bench.miles_chat --out DIR [--engine sglang|reference] [--gpus 0]
        [--budget-s 420] [--targets facade-dynamo,...] [--baseline EARLIER/results.json]

Targets, one after another on the same model (``rb_bench.tool_call_model``: every turn is
reasoning plus a ``get_weather`` call, made here from the tiny model, no download):

* ``stock``: stock SGLang (``sglang.launch_server``) started with ``--tool-call-parser qwen25
  --reasoning-parser qwen3 --enable-cache-report``, its ``/v1/chat/completions`` called directly;
* ``facade-sglang``: the facade (same parser flags) over 2 SGLang workers behind smg (``manual``
  policy, Miles' default with a session server);
* ``facade-dynamo``: the facade over the Dynamo 1.4.2 frontend and 2 ``dynamo.sglang`` workers
  (through our shim).

Each runs :func:`rb_bench.miles_session.tool_session` (Miles' session server stand-in, 4 turns with
tool messages, a ``length`` cut, a one-step rollback retry, a mid-turn abort) with the same user
message (:data:`SESSION_TAG`), so every target is sent the same prompt ids. Every facade target's
answers are compared turn by turn with the baseline's (``stock``; on CPU, where the reference worker
serves no chat route, ``facade-sglang``): the prompt ids sent (where both runs recorded them), the
assistant message (tool-call ids drawn at random are masked), ``finish_reason``, ``matched_stop``,
``meta_info.finish_reason``, the output token ids, ``usage`` without the cache details (each
fleet's cache history differs) and the largest |Δ logprob|; of the aborted turn, only that it
finished ``abort`` with non-null content.

GPUs: ``--gpus`` lists the GPUs the workers take in turn, repeated as needed (``stock`` is one
worker, each facade fleet two): ``--gpus 0`` puts every worker on GPU 0, ``--gpus 0,1`` gives
``stock`` GPU 0 and each facade fleet one worker per GPU. Workers sharing a GPU start with
``--mem-fraction-static 0.9 --max-total-tokens 65536`` (the fanout and GRPO benchmarks' recipe:
SGLang 0.5.16 leaves the KV cache ``free now - (1 - fraction) x free at start``, which a worker
starting beside another drives below zero at a low fraction; the token cap keeps each pool small).
A target starts only once the previous one's processes have exited and the GPUs list no compute
process (``nvidia-smi``; waited for up to :data:`GPU_RELEASE_TIMEOUT_S`).

Reruns: ``--targets`` runs a subset; ``--baseline FILE`` takes ``stock`` from an earlier run's
``results.json`` (refused when its engine or parsers differ, or when it recorded a different
model hash) instead of running it.

Writes ``DIR/results.json`` and ``DIR/results.md``; exit 0 when every compared turn is equal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

from .fanout import MEM_FRACTION
from .miles_session import SessionServer, tool_session
from .tool_call_model import TOOL, make_tool_call_model

TOOL_PARSER, REASONING_PARSER = "qwen25", "qwen3"
PARSER_FLAGS = ("--tool-call-parser", TOOL_PARSER, "--reasoning-parser", REASONING_PARSER, "--enable-cache-report")
SGLANG_FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph")
TARGETS = ("stock", "facade-sglang", "facade-dynamo")
#: Workers of each target's fleet.
WORKERS = {"stock": 1, "facade-sglang": 2, "facade-dynamo": 2}
#: The tag in the session's user message, the same for every target: it once was the target's name,
#: so stock's prompts were 8 tokens shorter than the facades' ("stock" vs "facade-sglang", GPU run
#: of 2026-12-05). "stock" keeps the answers of runs made before this fix a valid ``--baseline``.
SESSION_TAG = "stock"
#: Each SGLang worker's KV pool, in tokens (the session needs a few hundred; gpu_tier's default).
KV_TOKENS = 65536
GPU_RELEASE_TIMEOUT_S = 60.0
LOGPROB_TOLERANCE = 1e-3
_RANDOM_ID = re.compile(r"^call_[0-9a-f]{24}$")


class BaselineError(ValueError):
    """A ``--baseline`` file that cannot stand for this run's ``stock``."""


@attrs.frozen
class Config:
    out: Path
    engine: str = "sglang"
    gpus: tuple[str, ...] = ("0",)
    budget_s: float = 420.0
    mem_fraction: float = MEM_FRACTION
    targets: tuple[str, ...] = TARGETS
    baseline: Path | None = None

    def __attrs_post_init__(self) -> None:
        if not self.gpus or not all(g.strip().isdigit() for g in self.gpus):
            raise ValueError(f"--gpus: GPU indices separated by commas, got {','.join(self.gpus)!r}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"--targets: a subset of {','.join(TARGETS)}, got {','.join(self.targets)!r}")
        if self.baseline is not None and "stock" in self.targets:
            raise ValueError("--baseline stands for stock: leave stock out of --targets")

    @property
    def sglang(self) -> bool:
        return self.engine == "sglang"

    def gpus_of(self, kind: str) -> tuple[str, ...]:
        """``CUDA_VISIBLE_DEVICES`` of each worker of ``kind``'s fleet: ``gpus`` taken in turn."""
        return tuple(itertools.islice(itertools.cycle(self.gpus), WORKERS[kind]))

    def sglang_flags(self) -> tuple[str, ...]:
        """What every GPU worker gets besides the launchers' recipe and the page size."""
        return ("--max-total-tokens", str(KV_TOKENS)) if self.sglang else ()


def _sglang_config(kind: str, cfg: Config, model: Path, logs: Path, timeout: float, **kw: Any) -> Any:
    from rollout_backends.adapters.sglang import SGLangFleetConfig

    gpu: dict[str, Any] = {}
    if cfg.sglang:
        gpu = dict(
            cuda_visible_devices=cfg.gpus_of(kind), mem_fraction_static=cfg.mem_fraction,
            attention_backend=SGLANG_FLAGS[1], sampling_backend=SGLANG_FLAGS[3], disable_cuda_graph=True,
        )  # fmt: skip
    extra = (*kw.pop("extra_server_args", ()), *cfg.sglang_flags())
    return SGLangFleetConfig(
        model_path=str(model), worker_kind=cfg.engine, workers=WORKERS[kind], page_size=16,
        health_check_interval_s=2, log_dir=str(logs), startup_timeout_s=timeout, extra_server_args=extra, **gpu, **kw,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def _stock(cfg: Config, model: Path, logs: Path, timeout: float) -> AsyncIterator[str]:
    from rollout_backends.adapters.sglang import launch_sglang_fleet

    config = _sglang_config("stock", cfg, model, logs, timeout, router="none", extra_server_args=PARSER_FLAGS)
    async with launch_sglang_fleet(config) as fleet:
        yield fleet.worker_urls[0]


def _dynamo_config(kind: str, cfg: Config, model: Path, timeout: float) -> Any:
    from rollout_backends.adapters.dynamo import DynamoFleetConfig

    sglang_args = (*SGLANG_FLAGS, "--mem-fraction-static", str(cfg.mem_fraction), *cfg.sglang_flags())
    return DynamoFleetConfig(
        model_path=model, workers=WORKERS[kind], worker_kind=cfg.engine, router_mode="round-robin", page_size=16,
        session_affinity_ttl_secs=600, gpus=cfg.gpus_of(kind) if cfg.sglang else (),
        sglang_args=sglang_args if cfg.sglang else (), ready_timeout=timeout,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def _backend(kind: str, cfg: Config, model: Path, logs: Path, timeout: float) -> AsyncIterator[Any]:
    if kind == "facade-sglang":
        from rollout_backends.adapters.sglang import launch_sglang_fleet

        config = _sglang_config(kind, cfg, model, logs, timeout, router="smg", router_policy="manual")
        async with launch_sglang_fleet(config) as fleet:
            yield fleet.backend
        return
    from rollout_backends.adapters.dynamo import launch_dynamo_fleet

    config = _dynamo_config(kind, cfg, model, timeout)
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


def _open(kind: str, cfg: Config, model: Path, logs: Path, timeout: float) -> Any:
    """``kind``'s fleet (and facade) as an async context manager yielding the router's URL."""
    return _stock(cfg, model, logs, timeout) if kind == "stock" else _facade(kind, cfg, model, logs, timeout)


async def run_target(
    kind: str, cfg: Config, model: Path, timeout: float, *, transport: httpx.AsyncBaseTransport | None = None
) -> dict[str, Any]:
    """One target's session: its answers and the prompt ids sent, by turn, or the error that stopped it."""
    from transformers import AutoTokenizer

    logs = cfg.out / "logs" / kind
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        async with (
            _open(kind, cfg, model, logs, timeout) as router,
            httpx.AsyncClient(timeout=120, transport=transport) as client,
        ):
            started = time.monotonic() - t0
            session = SessionServer(client, router, AutoTokenizer.from_pretrained(str(model)))
            turns = await tool_session(session, [TOOL], SESSION_TAG, lambda: miles_abort(client, router))
    except Exception as exc:  # a target that fails is reported, the others still run
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "seconds": round(time.monotonic() - t0, 1)}
    prompts = {name: sent["input_ids"] for name, sent in zip(turns, session.sent, strict=True)}
    return {
        "ok": True, "startup_s": round(started, 1), "seconds": round(time.monotonic() - t0, 1), "turns": turns,
        "prompts": prompts,
    }  # fmt: skip


def gpu_compute_pids() -> list[int] | None:
    """The processes ``nvidia-smi`` lists on any GPU, this one aside (``None``: no ``nvidia-smi``)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    pids = (int(line) for line in done.stdout.split() if line.strip().isdigit())
    return [pid for pid in pids if pid != os.getpid()]


async def wait_gpus_released(
    timeout: float = GPU_RELEASE_TIMEOUT_S, query: Callable[[], list[int] | None] = gpu_compute_pids
) -> dict[str, Any]:
    """Wait until no process holds GPU memory (the last target's workers are gone from the driver's
    list, not only from the process table); how long it took, or which processes still hold it."""
    t0 = time.monotonic()
    while True:
        pids = await asyncio.to_thread(query)
        waited = round(time.monotonic() - t0, 1)
        if not pids:
            return {"released": True, "waited_s": waited, "nvidia_smi": pids is not None}
        if waited >= timeout:
            return {"released": False, "waited_s": waited, "held_by": pids}
        await asyncio.sleep(1.0)


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


def prompt_difference(base: Sequence[int] | None, other: Sequence[int] | None) -> str | None:
    """How two turns' prompt ids differ (``None``: equal, or one run did not record them)."""
    if base is None or other is None or list(base) == list(other):
        return None
    at = next((i for i, (x, y) in enumerate(zip(base, other, strict=False)) if x != y), min(len(base), len(other)))
    return f"input_ids: baseline {len(base)} ids, target {len(other)} ids, first difference at {at}"


def compare_turn(
    name: str,
    base: dict[str, Any],
    other: dict[str, Any],
    prompts: tuple[Sequence[int] | None, Sequence[int] | None] = (None, None),
) -> dict[str, Any]:
    """The differences of one turn's answers (empty: equal), and the largest |Δ logprob|; ``prompts``:
    the prompt ids each side sent, where recorded (answers to different prompts cannot be compared)."""
    diffs = [d for d in (prompt_difference(*prompts),) if d]
    if name == "turn4_abort":
        diffs += [
            f"{who}: finish {a['choices'][0]['finish_reason']!r}, content {a['choices'][0]['message']['content']!r}"
            for who, a in (("baseline", base), ("target", other))
            if a["choices"][0]["finish_reason"] != "abort" or a["choices"][0]["message"]["content"] is None
        ]
        return {"equal": not diffs, "differences": diffs, "max_abs_dlogprob": None}
    a, b = _comparable(base), _comparable(other)
    diffs += [f"{key}: baseline {a[key]!r}, target {b[key]!r}" for key in a if a[key] != b[key]]
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
        if kind == base or base is None:
            continue
        turns, prompts = results[base]["turns"], results[base].get("prompts") or {}
        mine = results[kind].get("prompts") or {}
        out[kind] = {
            name: compare_turn(name, turns[name], results[kind]["turns"][name], (prompts.get(name), mine.get(name)))
            for name in turns
        }
    return base, out


def model_sha256(model: Path) -> str:
    return hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()


def load_baseline(path: Path, cfg: Config, model_sha: str) -> dict[str, Any]:
    """``stock``'s result from an earlier run's ``results.json``, checked against this run."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BaselineError(f"--baseline {path}: {exc}") from None
    stock = (doc.get("targets") or {}).get("stock") or {}
    if not stock.get("ok"):
        why = stock.get("error") or stock.get("skipped") or "absent"
        raise BaselineError(f"--baseline {path}: its stock target did not run ({why})")
    parsers = {"tool_call_parser": TOOL_PARSER, "reasoning_parser": REASONING_PARSER}
    for key, want in (("engine", cfg.engine), ("parsers", parsers)):
        if doc.get(key) != want:
            raise BaselineError(f"--baseline {path}: {key} {doc.get(key)!r}, this run {want!r}")
    recorded = doc.get("model_sha256")
    if recorded is not None and recorded != model_sha:
        raise BaselineError(f"--baseline {path}: model sha256 {recorded}, this run's {model_sha}")
    checked = "same model sha256" if recorded else "model not recorded there (made by the same code: not checked)"
    return {**stock, "baseline_file": str(path), "baseline_versions": doc.get("versions"), "model_check": checked}


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
        if res.get("baseline_file"):
            state = f"from {res['baseline_file']} ({res['model_check']})"
        lines.append(f"* `{kind}`: {state}")
    lines += ["", "| target | turn | equal | max abs dlogprob | differences |", "|---|---|---|---|---|"]
    for kind, turns in doc["comparisons"].items():
        for name, c in turns.items():
            lines.append(
                f"| {kind} | {name} | {c['equal']} | {c['max_abs_dlogprob']} | {'; '.join(c['differences'])} |"
            )
    lines += ["", f"verdict: **{doc['verdict']}**", ""]
    return "\n".join(lines)


def _skipped(kind: str, cfg: Config, left: float) -> str | None:
    """Why ``kind`` does not run now (``None``: it runs)."""
    if kind not in cfg.targets:
        return "not in --targets"
    if kind == "stock" and not cfg.sglang:
        return "no stock SGLang on CPU (the reference worker serves no chat route)"
    if left < 60:
        return f"budget: {left:.0f} s left"
    return None


async def run(cfg: Config) -> dict[str, Any]:
    """Every target of ``cfg`` in turn (raises :class:`BaselineError` before any starts)."""
    from rollout_backends.adapters.reference import make_tiny_model

    t0 = time.monotonic()
    cfg.out.mkdir(parents=True, exist_ok=True)
    model = make_tool_call_model(cfg.out / "model", make_tiny_model(cfg.out / "model-base", seed=0))
    sha = model_sha256(model)
    results: dict[str, dict[str, Any]] = {}
    if cfg.baseline is not None:
        results["stock"] = load_baseline(cfg.baseline, cfg, sha)
    for kind in TARGETS:
        if kind in results:
            continue
        left = cfg.budget_s - (time.monotonic() - t0)
        why = _skipped(kind, cfg, left)
        if why is not None:
            results[kind] = {"ok": False, "skipped": why}
        else:
            results[kind] = await run_target(kind, cfg, model, timeout=min(240.0, left - 30.0))
            if cfg.sglang:  # the next fleet starts on GPUs this one has let go of
                results[kind]["gpu_release"] = await wait_gpus_released()
        print(f"miles_chat: {kind}: {results[kind].get('error') or results[kind].get('skipped') or 'ok'}", flush=True)
    base, comparisons = compare(results)
    equal = bool(comparisons) and all(c["equal"] for turns in comparisons.values() for c in turns.values())
    doc = {
        "engine": cfg.engine,
        "versions": _versions(),
        "parsers": {"tool_call_parser": TOOL_PARSER, "reasoning_parser": REASONING_PARSER},
        "model_sha256": sha,
        "gpus": {kind: list(cfg.gpus_of(kind)) for kind in TARGETS} if cfg.sglang else None,
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
    p.add_argument("--gpus", default="0", help="GPUs the workers take in turn, repeated as needed (default: 0)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for all targets (default: 420)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"which to run, of {','.join(TARGETS)} (default: all)")
    p.add_argument("--baseline", type=Path, help="an earlier run's results.json whose stock is the baseline")
    ns = p.parse_args(argv)
    try:
        cfg = Config(
            out=ns.out, engine=ns.engine, gpus=tuple(ns.gpus.split(",")), budget_s=ns.budget_s,
            targets=tuple(t.strip() for t in ns.targets.split(",") if t.strip()), baseline=ns.baseline,
        )  # fmt: skip
    except ValueError as exc:
        p.error(str(exc))
    try:
        doc = asyncio.run(run(cfg))
    except BaselineError as exc:
        p.error(str(exc))
    print(_markdown(doc), flush=True)
    return 0 if doc["verdict"] == "equal" else 1


if __name__ == "__main__":
    sys.exit(main())
