"""Probe ``smg`` (the SGLang model gateway) with reference servers as workers; dump what it does.

    PYTHONPATH=bench .venv/bin/python -m rb_bench.smg_probe [--out docs/data/smg-probe.json] [--engine fake|reference]

Everything binds 127.0.0.1 and is stopped at the end (one ``Supervisor``). The findings are
summarised in ``docs/sglang.md`` ("smg 1.13.0, as observed"); this script is the evidence and can
be re-run on a new smg.

Workers: two reference servers (``w0``/``w1``, started with weight versions ``w0``/``w1`` so that a
response tells which worker served it) and an ``echo`` worker that records the exact request the
router forwards and answers a fixed SGLang-shaped body (to see which fields survive both ways).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import attrs
from aiohttp import web

from rollout_backends.launch import ProcessSpec, Supervisor, free_port

from . import REPO_ROOT as ROOT
from . import with_bench_path

PY = sys.executable
H = "127.0.0.1"

# -- the echo worker (runs as `python -m rb_bench.smg_probe echo --port P`) ---------------------------------------

ECHO_RESPONSE = {
    "output_ids": [5, 6],
    "meta_info": {
        "id": "echo-rid",
        "finish_reason": {"type": "length", "length": 2},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "weight_version": "echo",
        "e2e_latency": 0.001,
        "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
        "weight_versions": [{"version": "echo", "start": 0, "end": 2}],
        "extra_meta_key": {"nested": [1, 2]},
    },
    "extra_top_key": "kept?",
}


def run_echo(port: int) -> None:
    recorded: list[dict[str, Any]] = []

    async def record(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        headers = {k: v for k, v in request.headers.items() if k.lower() != "authorization"}
        headers["authorization-present"] = str("Authorization" in request.headers)
        recorded.append({"method": request.method, "path": request.path_qs, "headers": headers, "body": body})
        if request.path == "/_recorded":
            recorded.pop()
            return web.json_response(recorded)
        if request.path.startswith("/health"):
            return web.Response(status=200)
        if request.path in ("/generate",):
            return web.json_response(ECHO_RESPONSE)
        if request.path in ("/model_info", "/get_model_info"):
            return web.json_response({"model_path": "/echo", "weight_version": "echo", "is_generation": True})
        if request.path in ("/server_info", "/get_server_info"):
            return web.json_response({"version": "0.5.16", "model_path": "/echo", "page_size": 16})
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "/echo", "object": "model"}]})
        return web.json_response({"echo": True, "path": request.path})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    web.run_app(app, host=H, port=port, print=None, access_log=None)


# -- helpers --------------------------------------------------------------------------------------


class Probe:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.s = session
        self.out: dict[str, Any] = {}

    async def call(self, method: str, url: str, body: Any = None, *, timeout: float = 10, **kw: Any) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            async with self.s.request(method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout), **kw) as r:
                raw = await r.read()
                try:
                    parsed: Any = json.loads(raw) if raw else None
                except ValueError:
                    parsed = raw.decode(errors="replace")
                return {"status": r.status, "body": parsed, "content_type": r.content_type,
                        "elapsed_s": round(time.monotonic() - t0, 3)}  # fmt: skip
        except Exception as e:
            return {"status": None, "error": f"{type(e).__name__}: {e}", "elapsed_s": round(time.monotonic() - t0, 3)}

    def note(self, key: str, value: Any) -> None:
        self.out[key] = value
        print(f"[probe] {key}: {json.dumps(value)[:300]}", flush=True)


def gen(rid: str | None = None, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
        "return_logprob": True,
    }
    if rid:
        body["rid"] = rid
    body.update(kw)
    return body


def served_by(resp: dict[str, Any]) -> str | None:
    try:
        return str(resp["body"]["meta_info"]["weight_version"])
    except (KeyError, TypeError):
        return None


def router_spec(name: str, port: int, prom: int, log_dir: Path, extra: list[str]) -> ProcessSpec:
    argv = [PY, "-m", "smg.launch_router", "--host", H, "--port", str(port), "--prometheus-host", H,
            "--prometheus-port", str(prom), "--log-dir", str(log_dir / name), "--log-level", "info",
            "--disable-tokenizer-autoload", *extra]  # fmt: skip
    return ProcessSpec(name=name, argv=argv, ready=f"http://{H}:{port}/liveness", ports=[port, prom], grace=8)


def worker_spec(name: str, port: int, engine: str) -> ProcessSpec:
    argv = [PY, "-m", "rollout_backends.adapters.reference.serve", "--model-path", f"/models/{name}",
            "--host", H, "--port", str(port), "--worker-id", name, "--weight-version", name]  # fmt: skip
    env = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
    if engine == "fake":
        argv += ["--engine-factory", "fake_engine:factory"]
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "reference"), os.environ.get("PYTHONPATH", "")])
    else:
        argv += ["--make-model", "0"]
        argv[argv.index("--model-path") + 1] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "smg-probe-model")
    return ProcessSpec(name=name, argv=argv, env=env, ready=f"http://{H}:{port}/health", ports=[port], grace=5)


async def wait_until(pred: Any, timeout: float, interval: float = 0.05) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await pred():
            return round(time.monotonic() - t0, 3)
        await asyncio.sleep(interval)
    return None


# -- the probe ------------------------------------------------------------------------------------


@attrs.define
class Lab:
    """What every stage of the probe shares: the recorder, the supervisor, the ports and URLs."""

    p: Probe
    sup: Supervisor
    ports: dict[str, int]
    u: dict[str, str]
    log_dir: Path
    #: Router flags of the probe's routers: fast health checks, no retries.
    common: list[str] = attrs.field(factory=lambda: [
        "--health-check-interval-secs", "1", "--worker-startup-check-interval", "1", "--disable-retries",
        "--health-failure-threshold", "1", "--health-success-threshold", "1"])  # fmt: skip


async def main(args: argparse.Namespace) -> None:
    """Every stage in order (each notes what it saw), then the notes as JSON to ``args.out``."""
    log_dir = Path(args.log_dir)
    ports = {n: free_port() for n in ("w0", "w1", "echo", "r", "rprom", "re", "reprom")}
    u = {n: f"http://{H}:{p}" for n, p in ports.items()}
    async with Supervisor(log_dir, grace=5) as sup, aiohttp.ClientSession() as session:
        lab = Lab(Probe(session), sup, ports, u, log_dir)
        await _start(lab, args.engine)
        await _registration(lab)
        await _forwarding(lab)
        await _control(lab)
        await _rl_plane(lab)
        await _field_survival(lab)
        await _worker_death(lab)
        await _shutdown(lab)
        await _retries_and_cache_aware(lab)
        Path(args.out).write_text(json.dumps(lab.p.out, indent=1, sort_keys=False, default=str) + "\n")
        print(f"[probe] wrote {args.out}", flush=True)


async def _start(lab: Lab, engine: str) -> None:
    """Two reference workers, the echo worker and a round-robin router with ``--enable-rl``."""
    p, sup, ports, u = lab.p, lab.sup, lab.ports, lab.u
    from importlib.metadata import version

    p.note("smg_version", version("smg"))
    for n in ("w0", "w1"):
        await sup.start(worker_spec(n, ports[n], engine))
    echo = [PY, "-m", "rb_bench.smg_probe", "echo", "--port", str(ports["echo"])]
    echo_env = with_bench_path({"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    await sup.start(ProcessSpec(name="echo", argv=echo, env=echo_env,
                                ready=f"{u['echo']}/health", ports=[ports["echo"]]))  # fmt: skip
    t_router = time.monotonic()
    await sup.start(router_spec("router", ports["r"], ports["rprom"], lab.log_dir,
                                ["--policy", "round_robin", "--enable-rl", *lab.common]))  # fmt: skip
    await sup.wait_ready(["router"], timeout=30)
    p.note("router_startup_s", round(time.monotonic() - t_router, 2))
    await sup.wait_ready(["w0", "w1", "echo"], timeout=120)


async def _registration(lab: Lab) -> None:
    """The empty router, then w0 and w1 registered through ``POST /workers`` (timed), round robin."""
    p, u, R = lab.p, lab.u, lab.u["r"]
    p.note("empty.GET /workers", await p.call("GET", f"{R}/workers"))
    p.note("empty.GET /readiness", await p.call("GET", f"{R}/readiness"))
    p.note("empty.GET /health", await p.call("GET", f"{R}/health"))
    p.note("empty.POST /generate", await p.call("POST", f"{R}/generate", gen()))

    # --- register w0 and time it ---------------------------------------------------------
    t0 = time.monotonic()
    add = await p.call("POST", f"{R}/workers", {"url": u["w0"]})
    p.note("POST /workers w0", add)

    async def w0_routable() -> bool:
        one_token = gen(sampling_params={"max_new_tokens": 1, "temperature": 0.0})
        return bool((await p.call("POST", f"{R}/generate", one_token))["status"] == 200)

    routable = await wait_until(w0_routable, 30)
    p.note("w0 routable after s", routable and round(time.monotonic() - t0, 3))
    p.note("POST /workers duplicate", await p.call("POST", f"{R}/workers", {"url": u["w0"]}))
    wid = (add.get("body") or {}).get("worker_id")
    p.note("GET /workers one", await p.call("GET", f"{R}/workers"))
    if wid:
        p.note("GET /workers/{id}", await p.call("GET", f"{R}/workers/{wid}"))
    p.note("POST /workers bad url", await p.call("POST", f"{R}/workers", {"url": f"http://{H}:1"}))
    await asyncio.sleep(2)
    p.note("GET /workers after bad url", await p.call("GET", f"{R}/workers"))

    # --- w1 and round robin -------------------------------------------------------------
    t0 = time.monotonic()
    add1 = await p.call("POST", f"{R}/workers", {"url": u["w1"], "worker_type": "regular"})
    p.note("POST /workers w1", add1)

    async def both_used() -> bool:
        seen = {served_by(await p.call("POST", f"{R}/generate", gen())) for _ in range(4)}
        return {"w0", "w1"} <= seen

    p.note("w1 routable after s", (await wait_until(both_used, 30)) and round(time.monotonic() - t0, 3))
    seq = [served_by(await p.call("POST", f"{R}/generate", gen())) for _ in range(6)]
    p.note("round_robin sequence", seq)


async def _forwarding(lab: Lab) -> None:
    """A forwarded ``/generate`` against a direct one, bad requests, a duplicate rid, aborts."""
    p, u, R = lab.p, lab.u, lab.u["r"]
    direct = await p.call("POST", f"{u['w0']}/generate", gen(rid="direct-1"))
    for _ in range(4):
        via = await p.call("POST", f"{R}/generate", gen(rid=f"via-{_}"))
        if served_by(via) == "w0":
            break
    p.note("generate direct body", direct["body"])
    p.note("generate via router body", via["body"])
    p.note("generate bodies equal except latency", _strip(direct["body"]) == _strip(via["body"]))
    errs = {}
    for label, body in {
        "oov": gen(input_ids=[1, 10**6]),
        "unknown sampling key": gen(sampling_params={"seed": 1}),
        "float max_new_tokens": gen(sampling_params={"max_new_tokens": 4.0}),
        "negative sampling_seed": gen(sampling_params={"max_new_tokens": 2, "sampling_seed": -1}),
        "batch input_ids": gen(input_ids=[[1, 2], [3]]),
        "text": {"text": "hello", "sampling_params": {"max_new_tokens": 2}},
        "no input": {"sampling_params": {"max_new_tokens": 2}},
        "stream": gen(stream=True),
    }.items():
        errs[label] = await p.call("POST", f"{R}/generate", body)
    p.note("errors via router", errs)

    # duplicate rid in flight through the router (slow generation on one worker)
    long = gen(rid="dup-rid", sampling_params={"max_new_tokens": 200, "temperature": 0.0})
    t1 = asyncio.ensure_future(p.call("POST", f"{R}/generate", long, timeout=30))
    await asyncio.sleep(0.3)
    t2 = await p.call("POST", f"{R}/generate", long, timeout=30)
    r1 = await t1
    p.note("duplicate rid via router (round robin)", {"first": _fr(r1), "second": _fr(t2)})

    # abort through the router vs directly
    t1 = asyncio.ensure_future(
        p.call("POST", f"{R}/generate", gen(rid="abort-me", sampling_params={"max_new_tokens": 300}), timeout=30)
    )
    await asyncio.sleep(0.3)
    p.note("POST router /abort_request", await p.call("POST", f"{R}/abort_request", {"rid": "abort-me"}))
    await asyncio.sleep(0.2)
    direct_abort = [await p.call("POST", f"{u[w]}/abort_request", {"rid": "abort-me"}) for w in ("w0", "w1")]
    r1 = await t1
    p.note(
        "abort by rid on every worker directly",
        {"abort_calls": [a["status"] for a in direct_abort], "result": _fr(r1)},
    )


async def _control(lab: Lab) -> None:
    """Each SGLang control route asked through the router."""
    p, R = lab.p, lab.u["r"]
    ctl: dict[str, Any] = {}
    for method, path, payload in [
        ("GET", "/model_info", None), ("GET", "/get_model_info", None), ("GET", "/server_info", None),
        ("GET", "/get_server_info", None), ("GET", "/health_generate", None), ("GET", "/v1/models", None),
        ("GET", "/get_loads", None), ("POST", "/flush_cache", None), ("GET", "/flush_cache", None),
        ("POST", "/pause_generation", {"mode": "retract"}), ("POST", "/continue_generation", {}),
        ("POST", "/update_weight_version", {"new_version": "x", "abort_all_requests": False}),
        ("POST", "/update_weights_from_disk", {"model_path": "/x"}), ("GET", "/openapi.json", None),
        ("GET", "/ready", None), ("GET", "/liveness", None), ("GET", "/readiness", None), ("GET", "/health", None),
    ]:  # fmt: skip
        r = await p.call(method, f"{R}{path}", payload)
        if isinstance(r.get("body"), dict) and path == "/openapi.json":
            r["body"] = sorted(r["body"].get("paths", {}))[:40]
        ctl[f"{method} {path}"] = r
    p.note("control via router", ctl)


async def _rl_plane(lab: Lab) -> None:
    """The RL control plane (``--enable-rl``): per worker and fanned out by selector."""
    p, u, R = lab.p, lab.u, lab.u["r"]
    rl = {}
    rl["GET /v1/rl/workers"] = await p.call("GET", f"{R}/v1/rl/workers")
    ws = (rl["GET /v1/rl/workers"].get("body") or {}).get("workers") or []
    if ws:
        w = ws[0]
        rl["GET /v1/rl/workers/{id}"] = await p.call("GET", f"{R}/v1/rl/workers/{w['id']}")
        rl["POST /v1/rl/workers/{id}/engine/flush_cache"] = await p.call(
            "POST", f"{R}/v1/rl/workers/{w['id']}/engine/flush_cache", {}
        )
        rl["GET /v1/rl/workers/{id}/engine/model_info"] = await p.call(
            "GET", f"{R}/v1/rl/workers/{w['id']}/engine/model_info"
        )
    for sel in ("engine=sglang", "all", "*", ""):
        rl[f"fanout flush_cache selector={sel!r}"] = await p.call(
            "POST", f"{R}/v1/rl/engine/flush_cache", {}, params={"selector": sel}
        )
    rl["fanout pause retract"] = await p.call("POST", f"{R}/v1/rl/engine/pause_generation", {"mode": "retract"},
                                              params={"selector": "engine=sglang"})  # fmt: skip
    rl["w0 /ready while paused"] = await p.call("GET", f"{u['w0']}/ready")
    rl["fanout continue"] = await p.call("POST", f"{R}/v1/rl/engine/continue_generation", {},
                                         params={"selector": "engine=sglang"})  # fmt: skip
    rl["fanout update_weight_version"] = await p.call(
        "POST",
        f"{R}/v1/rl/engine/update_weight_version",
        {"new_version": "rl-1", "abort_all_requests": False},
        params={"selector": "engine=sglang"},
    )
    rl["GET /v1/rl/workers after version"] = await p.call("GET", f"{R}/v1/rl/workers")
    rl["fanout failing route (disk, bad path)"] = await p.call(
        "POST",
        f"{R}/v1/rl/engine/update_weights_from_disk",
        {"model_path": "/nonexistent"},
        params={"selector": "engine=sglang"},
    )
    rl["fanout 404 route (begin_weight_update)"] = await p.call(
        "POST", f"{R}/v1/rl/engine/begin_weight_update", {}, params={"selector": "engine=sglang"}
    )
    rl["GET /v1/rl"] = await p.call("GET", f"{R}/v1/rl")
    # put the versions back for the rest of the probe
    for w_ in ("w0", "w1"):
        await p.call("POST", f"{u[w_]}/update_weight_version", {"new_version": w_, "abort_all_requests": False})
    p.note("rl control plane", rl)


async def _field_survival(lab: Lab) -> None:
    """A router in front of the echo worker alone: which request fields and headers survive both ways."""
    p, sup, ports, u = lab.p, lab.sup, lab.ports, lab.u
    t0 = time.monotonic()
    await sup.start(router_spec("router-echo", ports["re"], ports["reprom"], lab.log_dir,
                                ["--policy", "cache_aware", "--worker-urls", u["echo"], *lab.common]))  # fmt: skip
    await sup.wait_ready(["router-echo"], timeout=30)
    RE = u["re"]

    async def echo_routable() -> bool:
        return bool((await p.call("POST", f"{RE}/generate", gen()))["status"] == 200)

    p.note("--worker-urls routable after s (from router start)",
           (await wait_until(echo_routable, 30)) and round(time.monotonic() - t0, 3))  # fmt: skip
    full: dict[str, Any] = {
        "input_ids": [1, 2, 3],
        "rid": "rid-survival",
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "return_text_in_logprobs": False,
        "return_prompt_token_ids": True,
        "stream": False,
        "extra_key": "ek",
        "routing_key": "rk",
        "custom_top_level": {"x": 1},
        "sampling_params": {
            "max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
            "stop_token_ids": [2], "ignore_eos": False, "min_new_tokens": 1, "n": 1, "sampling_seed": 1234,
            "repetition_penalty": 1.1, "frequency_penalty": 0.1, "presence_penalty": 0.2,
            "no_stop_trim": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
            "stop": [], "stop_regex": "x+", "logit_bias": {"5": 1.0}, "custom_params": {"a": 1},
            "stream_interval": 3, "unknown_sampling_key": 1,
        },
    }  # fmt: skip
    await p.call("GET", f"{u['echo']}/_recorded")
    resp = await p.call("POST", f"{RE}/generate", full, headers={"X-SMG-Routing-Key": "k1", "X-Custom": "c"})
    rec = (await p.call("GET", f"{u['echo']}/_recorded"))["body"]
    forwarded = [r for r in rec if r["path"] == "/generate"]
    p.note("survival.sent", full)
    p.note("survival.forwarded", forwarded[-1] if forwarded else None)
    if forwarded:
        fb = forwarded[-1]["body"]
        p.note("survival.dropped top-level", sorted(set(full) - set(fb)))
        p.note("survival.added top-level", sorted(set(fb) - set(full)))
        p.note("survival.dropped sampling", sorted(set(full["sampling_params"]) - set(fb.get("sampling_params", {}))))
        p.note(
            "survival.changed values",
            {k: (full[k], fb.get(k)) for k in full if k in fb and fb[k] != full[k] and k != "sampling_params"},
        )
        sp_sent, sp_fwd = full["sampling_params"], fb.get("sampling_params", {})
        p.note(
            "survival.changed sampling values",
            {k: (sp_sent[k], sp_fwd[k]) for k in sp_sent if k in sp_fwd and sp_fwd[k] != sp_sent[k]},
        )
    p.note("survival.response status", resp["status"])
    p.note("survival.response body == echo body", resp.get("body") == ECHO_RESPONSE)
    p.note("survival.response body", resp.get("body"))
    # health probes the router sent to the echo worker
    rec = (await p.call("GET", f"{u['echo']}/_recorded"))["body"]
    p.note("echo: paths the router called", sorted({f"{r['method']} {r['path']}" for r in rec}))
    # router-side flush fan-out reaches the echo worker?
    await p.call("POST", f"{RE}/flush_cache")
    rec = (await p.call("GET", f"{u['echo']}/_recorded"))["body"]
    p.note("echo: after POST router /flush_cache", [f"{r['method']} {r['path']}" for r in rec if "flush" in r["path"]])


async def _worker_death(lab: Lab) -> None:
    """A worker killed, restarted, killed mid-request, stopped (SIGSTOP), deleted."""
    p, sup, u, R = lab.p, lab.sup, lab.u, lab.u["r"]
    death: dict[str, Any] = {}
    t_kill = time.monotonic()
    sup.kill("w1", signal.SIGKILL)
    samples = []
    for _ in range(40):
        r = await p.call("POST", f"{R}/generate", gen(), timeout=5)
        samples.append({"t": round(time.monotonic() - t_kill, 2), "status": r["status"], "by": served_by(r),
                        "err": r.get("body") if r["status"] != 200 else None})  # fmt: skip
        await asyncio.sleep(0.1)
    death["requests after SIGKILL"] = _compress(samples)
    death["GET /workers after death"] = await p.call("GET", f"{R}/workers")
    death["GET /readiness after death"] = await p.call("GET", f"{R}/readiness")
    # restart on the same port: re-admitted?
    t_restart = time.monotonic()
    await sup.restart("w1")
    await sup.wait_ready(["w1"], timeout=60)
    death["w1 restarted (ready) after s"] = round(time.monotonic() - t_restart, 2)

    async def w1_back() -> bool:
        for _ in range(2):
            if served_by(await p.call("POST", f"{R}/generate", gen())) == "w1":
                return True
        return False

    back = await wait_until(w1_back, 30, interval=0.2)
    death["w1 routable again after s (from restart ready)"] = back
    death["GET /workers after restart"] = await p.call("GET", f"{R}/workers")

    # in-flight request on a worker that is SIGKILLed
    fut = asyncio.ensure_future(
        p.call("POST", f"{R}/generate", gen(rid="inflight-kill", sampling_params={"max_new_tokens": 400}), timeout=30)
    )
    await asyncio.sleep(0.4)
    # round robin: the next short request goes to the other worker, so the long one is on `holder`
    other = served_by(await p.call("POST", f"{R}/generate", gen()))
    holder = "w0" if other == "w1" else "w1"
    sup.kill(holder, signal.SIGKILL)
    r = await fut
    death["in-flight request whose worker is SIGKILLed"] = {
        "killed": holder, "status": r["status"], "by": served_by(r), "elapsed_s": r["elapsed_s"],
        "body": r.get("body") if r["status"] != 200 else _fr(r), "error": r.get("error"),
    }  # fmt: skip

    # hung worker (SIGSTOP): does the router route around it?
    await sup.restart(holder)
    await sup.wait_ready([holder], timeout=60)
    await wait_until(lambda: _served_set(p, R, {"w0", "w1"}), 30, interval=0.2)
    sup.kill("w1", signal.SIGSTOP)
    t_stop = time.monotonic()
    samples = []
    for _ in range(20):
        r = await p.call("POST", f"{R}/generate", gen(), timeout=3)
        samples.append({"t": round(time.monotonic() - t_stop, 2), "status": r["status"], "by": served_by(r),
                        "err": (r.get("body") or r.get("error")) if r["status"] != 200 else None})  # fmt: skip
    death["requests while w1 is SIGSTOPped"] = _compress(samples)
    death["GET /workers while w1 stopped"] = await p.call("GET", f"{R}/workers")
    sup.kill("w1", signal.SIGCONT)

    # DELETE a worker
    ws = ((await p.call("GET", f"{R}/workers"))["body"] or {}).get("workers", [])
    w1_entry = next((w for w in ws if w.get("url") == u["w1"]), None)
    if w1_entry:
        death["DELETE /workers/{id}"] = await p.call("DELETE", f"{R}/workers/{w1_entry['id']}")
        await asyncio.sleep(1.0)
        death["GET /workers after DELETE"] = await p.call("GET", f"{R}/workers")
    p.note("worker death", death)


async def _shutdown(lab: Lab) -> None:
    """How long the router takes to exit on SIGTERM."""
    p, sup = lab.p, lab.sup
    t0 = time.monotonic()
    code = await sup.stop("router", grace=15)
    p.note("router SIGTERM exit", {"code": code, "seconds": round(time.monotonic() - t0, 2)})
    await sup.stop("router-echo", grace=0.5)


async def _retries_and_cache_aware(lab: Lab) -> None:
    """A cache_aware router with retries on (the default): stickiness, version labels, a dead worker."""
    p, sup, ports, u = lab.p, lab.sup, lab.ports, lab.u
    await sup.restart("w1")
    await sup.wait_ready(["w0", "w1"], timeout=60)
    ports["r2"], ports["r2prom"] = free_port(), free_port()
    R2 = f"http://{H}:{ports['r2']}"
    await sup.start(router_spec("router-ca", ports["r2"], ports["r2prom"], lab.log_dir,
                                ["--policy", "cache_aware", "--worker-urls", u["w0"], u["w1"],
                                 "--health-check-interval-secs", "1", "--worker-startup-check-interval", "1",
                                 "--enable-rl"]))  # fmt: skip
    await sup.wait_ready(["router-ca"], timeout=30)
    await wait_until(lambda: _served_set(p, R2, {"w0"}), 30, interval=0.2)
    ca: dict[str, Any] = {}
    same = [served_by(await p.call("POST", f"{R2}/generate", gen(input_ids=[9, 8, 7, 6, 5, 4]))) for _ in range(6)]
    ca["same prompt x6 (cache_aware)"] = same
    diff = [served_by(await p.call("POST", f"{R2}/generate", gen(input_ids=[i + 1, 2, 3]))) for i in range(8)]
    ca["8 distinct prompts (cache_aware)"] = diff
    # weight_version label refresh after a direct version change
    await p.call("POST", f"{u['w0']}/update_weight_version", {"new_version": "fresh", "abort_all_requests": False})
    labels = []
    for i in range(6):
        ws = ((await p.call("GET", f"{R2}/v1/rl/workers"))["body"] or {}).get("workers", [])
        labels.append({"t": i, "w0": next((w["weight_version"] for w in ws if w["url"] == u["w0"]), None)})
        await asyncio.sleep(1.0)
    ca["/v1/rl/workers weight_version after a direct update (1 s apart)"] = labels
    # a dead worker with retries enabled: is the failed attempt re-sent to the other worker?
    sup.kill("w1", signal.SIGKILL)
    outcomes = [(await p.call("POST", f"{R2}/generate", gen(input_ids=[i + 20, 2, 3]), timeout=10)) for i in range(8)]
    ca["after SIGKILL of w1, retries on"] = [(o["status"], served_by(o), o["elapsed_s"]) for o in outcomes]
    p.note("retries and cache_aware", ca)


async def _served_set(p: Probe, R: str, want: set[str]) -> bool:
    seen = {served_by(await p.call("POST", f"{R}/generate", gen())) for _ in range(4)}
    return want <= seen


def _fr(r: dict[str, Any]) -> Any:
    try:
        m = r["body"]["meta_info"]
        return {"status": r["status"], "finish_reason": m["finish_reason"], "n": m["completion_tokens"],
                "by": m["weight_version"]}  # fmt: skip
    except (KeyError, TypeError):
        return {"status": r.get("status"), "body": r.get("body"), "error": r.get("error")}


def _strip(body: Any) -> Any:
    if not isinstance(body, dict):
        return body
    b = json.loads(json.dumps(body))
    b.get("meta_info", {}).pop("e2e_latency", None)
    b.get("meta_info", {}).pop("id", None)
    return b


def _compress(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge consecutive samples with the same outcome: [{from, to, count, status, by, err}]."""
    out: list[dict[str, Any]] = []
    for s in samples:
        key = (s["status"], s["by"], json.dumps(s["err"]))
        if out and out[-1]["_key"] == key:
            out[-1]["to"] = s["t"]
            out[-1]["count"] += 1
        else:
            out.append({"_key": key, "from": s["t"], "to": s["t"], "count": 1, "status": s["status"], "by": s["by"],
                        "err": s["err"]})  # fmt: skip
    for o in out:
        o.pop("_key")
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "echo":
        run_echo(int(sys.argv[sys.argv.index("--port") + 1]))
        sys.exit(0)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "data" / "smg-probe.json"))
    ap.add_argument("--engine", choices=["fake", "reference"], default="fake")
    ap.add_argument("--log-dir", default="/tmp/smg-probe-logs")
    asyncio.run(main(ap.parse_args()))
