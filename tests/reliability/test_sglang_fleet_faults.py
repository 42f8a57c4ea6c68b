"""Real processes: three reference SGLang-protocol workers behind ``smg`` (round robin), with an admin
key (SGLang's ``--admin-api-key``: control routes only) and the test-only ``--fault-injection`` route.

(A data ``--api-key`` is not used here: smg 1.13 registers workers by ``GET /server_info`` without
the key, so a keyed fleet never becomes routable; see ``docs/reliability.md``. The data key is
tested end to end on a worker without a router in ``test_admin_surface.py``.)

Worker death (SIGKILL mid-load, restart), worker hang (SIGSTOP/SIGCONT), a failed weight update at
each step, and the admin surface (loopback listeners, keys never shown). Figures go to ``figures``.
"""

from __future__ import annotations

import asyncio
import collections
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import attrs
import pytest
import pytest_asyncio

from rb_bench.soak import run_load
from rollout_backends import (
    BackendTimeout,
    ControlFailed,
    GenerateRequest,
    SamplingParams,
    WeightUpdateFailed,
)
from rollout_backends._http import HttpClient
from rollout_backends._supervisor import redact_argv
from rollout_backends.adapters.sglang import SGLangFleet, SGLangFleetConfig, launch_sglang_fleet
from rollout_backends.adapters.sglang._launch import router_worker_state
from rollout_backends.kit import HttpFleetBackend

from .conftest import HAS_SMG, is_loopback, listening_addresses, size

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HAS_SMG, reason="smg is not installed"),
    pytest.mark.asyncio(loop_scope="module"),
]

API_KEY = "sk-data-Zq81xV"
ADMIN_KEY = "sk-admin-Pw40tY"
SAMPLING = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [tuple(range(3 + i, 11 + i)) for i in range(12)]
#: Errors a request may end with when a worker dies or hangs (anything else is a failure).
TYPED_FAILURES = {"BackendUnavailable", "ConnectionFailed", "BackendTimeout", "Overloaded"}
REQUEST_TIMEOUT_S = 10.0


def _req(i: int, worker: str | None = None) -> GenerateRequest:
    return GenerateRequest(input_ids=PROMPTS[i % len(PROMPTS)], sampling=SAMPLING, worker=worker)


@attrs.define
class Env:
    fleet: SGLangFleet
    backend: HttpFleetBackend
    expected: dict[tuple[int, ...], tuple[int, ...]]
    errors_seen: list[str] = attrs.field(factory=list)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tiny_model: Path, no_orphans: None, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    cfg = SGLangFleetConfig(
        model_path=tiny_model,
        workers=3,
        worker_kind="reference",
        router="smg",
        router_policy="round_robin",
        admin_api_key=ADMIN_KEY,
        weight_version="v0",
        health_check_interval_s=1,
        extra_server_args=["--fault-injection", "--with-begin-end"],
        extra_router_args=["--health-failure-threshold", "1", "--health-success-threshold", "1"],
        log_dir=str(tmp_path_factory.mktemp("sglang-fleet-logs")),
        worker_grace_s=5.0,
    )
    async with launch_sglang_fleet(cfg) as fleet:
        backend = fleet.backend
        backend.client.timeout = REQUEST_TIMEOUT_S
        backend.client.control_timeout = 5.0
        expected = {}
        for i, p in enumerate(PROMPTS):
            gens = [await backend.generate(_req(i, w)) for w in backend.workers]
            assert len({g.output_ids for g in gens}) == 1, "greedy must agree across workers"
            expected[p] = gens[0].output_ids
        yield Env(fleet, backend, expected)


async def _admin(fleet: SGLangFleet, worker: int, method: str, path: str, body: Any = None) -> Any:
    url = fleet.worker_urls[worker] + path
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as r,
    ):
        assert r.status == 200, await r.text()
        return await r.json()


async def _arm(fleet: SGLangFleet, worker: int, path: str, **fault: Any) -> None:
    await _admin(fleet, worker, "POST", "/_faults", {"path": path, **fault})


async def _wait_detected(backend: HttpFleetBackend, worker: str, t0: float, limit: float = 10.0) -> float:
    """Seconds from ``t0`` until ``health()`` shows ``worker`` not live."""
    while True:
        report = await backend.health()
        if not report.worker(worker).live:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < limit, report
        await asyncio.sleep(0.05)


async def _wait_router_healthy(fleet: SGLangFleet, timeout: float = 30.0) -> None:
    client = HttpClient()
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert fleet.router_url is not None
            state = await router_worker_state(client, fleet.router_url)
            if all(state.get(u) == "healthy" for u in fleet.worker_urls):
                return
            assert time.monotonic() < deadline, state
            await asyncio.sleep(0.1)
    finally:
        await client.aclose()


def _check_report(report: Any, env: Env, gens_ok: list[Any]) -> None:
    assert report.lost == 0, report.summary()
    assert report.hung == 0 and not report.untyped, report.summary()
    assert set(report.errors) <= TYPED_FAILURES, report.summary()
    assert report.max_latency_s <= REQUEST_TIMEOUT_S + 2.0, report.summary()
    for g, prompt in gens_ok:  # a request completed elsewhere is a whole new generation, never spliced
        assert g.output_ids == env.expected[prompt]


# -- worker death -------------------------------------------------------------------------------


async def test_worker_death_under_load_then_restart(env: Env, figures: dict[str, Any]) -> None:
    fleet, b = env.fleet, env.backend
    n = size(200, 1000)
    victim_index = 2
    victim = b.workers[victim_index]
    killed_at: list[float] = []
    detect: list[float] = []
    gens_ok: list[Any] = []

    async def generate(req: GenerateRequest) -> Any:
        g = await b.generate(req)
        gens_ok.append((g, req.input_ids))
        return g

    def on_done(i: int, outcome: str) -> None:
        if i >= n // 3 and not killed_at:
            fleet.supervisor.kill(fleet.worker_name(victim_index))
            killed_at.append(time.monotonic())

    async def watch() -> None:
        while not killed_at:
            await asyncio.sleep(0.01)
        detect.append(await _wait_detected(b, victim, killed_at[0]))

    watcher = asyncio.ensure_future(watch())
    report = await run_load(generate, _req, n, concurrency=16, timeout_s=REQUEST_TIMEOUT_S, on_done=on_done)
    await asyncio.wait_for(watcher, 15)
    print(f"\nsglang death: {report.summary()} detected after {detect[0]:.2f}s")
    _check_report(report, env, gens_ok)
    assert detect[0] < 2.0
    health = await b.health()
    assert health.unhealthy_workers == (victim,) and health.any_ready

    # Restart on the same port: it rejoins (health, router, traffic).
    t0 = time.monotonic()
    await fleet.supervisor.restart(fleet.worker_name(victim_index))
    await fleet.supervisor.wait_ready([fleet.worker_name(victim_index)], timeout=120)
    await b.wait_ready(30)
    await _wait_router_healthy(fleet)
    rejoin_s = time.monotonic() - t0
    await _arm(fleet, victim_index, "/generate", mode="delay", delay_s=0, times=1_000_000)  # counts its requests
    after = await run_load(b.generate, _req, 30, concurrency=3, timeout_s=REQUEST_TIMEOUT_S)
    left = (await _admin(fleet, victim_index, "GET", "/_faults"))["faults"]["/generate"]["times"]
    await _admin(fleet, victim_index, "DELETE", "/_faults")
    served_by_victim = 1_000_000 - left
    print(f"sglang restart: ready again after {rejoin_s:.1f}s; {served_by_victim}/30 routed to it")
    assert after.completed == 30 and served_by_victim >= 5
    g = await b.generate(_req(0, victim))
    assert g.output_ids == env.expected[PROMPTS[0]]
    figures["sglang_worker_death"] = {
        **report.summary(),
        "workers": 3,
        "killed_after_requests": n // 3,
        "time_to_detect_s": round(detect[0], 3),
        "restart_ready_s": round(rejoin_s, 2),
        "after_restart_routed_to_restarted": served_by_victim,
    }


# -- worker hang --------------------------------------------------------------------------------


async def test_worker_hang_times_out_typed_and_recovers(env: Env, figures: dict[str, Any]) -> None:
    fleet, b = env.fleet, env.backend
    hung_index = 1
    hung = b.workers[hung_index]
    others = [w for w in b.workers if w != hung]
    timeout_s = 3.0
    old = (b.client.timeout, b.client.control_timeout, b.wire)
    b.client.timeout, b.client.control_timeout = timeout_s, 2.0
    b.wire = attrs.evolve(b.wire, probe_timeout=2.0)  # type: ignore[misc]
    fleet.supervisor.kill(fleet.worker_name(hung_index), signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(ControlFailed) as ei:
            await b.flush_cache()
        control_s = time.monotonic() - t0
        assert ei.value.workers == (hung,), ei.value
        assert control_s < 2.0 + 1.5
        env.errors_seen.append(str(ei.value))

        t0 = time.monotonic()
        report_h = await b.health()
        health_s = time.monotonic() - t0
        assert not report_h.worker(hung).live and all(report_h.worker(w).live for w in others)

        # Pinned to the others: served at once. Through the router: done or a typed timeout.
        for i, w in enumerate(others):
            assert (await b.generate(_req(i, w))).output_ids == env.expected[PROMPTS[i]]
        n = size(60, 300)
        report = await run_load(b.generate, _req, n, concurrency=8, timeout_s=timeout_s)
        print(f"\nsglang hang: control failed in {control_s:.2f}s, health {health_s:.2f}s; load {report.summary()}")
        assert report.lost == 0 and report.hung == 0 and not report.untyped, report.summary()
        assert set(report.errors) <= {"BackendTimeout"}, report.summary()
        assert report.max_latency_s <= timeout_s + 1.0
        with pytest.raises(BackendTimeout) as et:
            await b.generate(_req(0, hung))
        env.errors_seen.append(str(et.value))
    finally:
        fleet.supervisor.kill(fleet.worker_name(hung_index), signal.SIGCONT)
    t0 = time.monotonic()
    await b.wait_ready(30)
    recover_s = time.monotonic() - t0
    assert (await b.generate(_req(3, hung))).output_ids == env.expected[PROMPTS[3]]
    await b.flush_cache()
    b.client.timeout, b.client.control_timeout, b.wire = old  # type: ignore[misc]
    figures["sglang_worker_hang"] = {
        **report.summary(),
        "request_timeout_s": timeout_s,
        "control_call_failed_after_s": round(control_s, 2),
        "health_marked_dead_after_s": round(health_s, 2),
        "recovered_after_sigcont_s": round(recover_s, 2),
    }


# -- failed weight update -----------------------------------------------------------------------

STEPS = [
    ("pause", "/pause_generation", "error"),
    ("flush_cache", "/flush_cache", "error"),
    ("begin", "/begin_weight_update", "error"),
    ("update", "/update_weights_from_disk", "error"),
    ("update", "/update_weights_from_disk", "close"),
    ("set_version", "/update_weight_version", "error"),
    ("end", "/end_weight_update", "error"),
]


async def test_failed_weight_update_at_each_step(
    env: Env, tiny_model: Path, tiny_model_b: Path, figures: dict[str, Any]
) -> None:
    fleet, b = env.fleet, env.backend
    target_index = 1
    target = b.workers[target_index]
    tokens: dict[Path, tuple[int, ...]] = {tiny_model: env.expected[PROMPTS[0]]}
    version = (await b.weight_versions())[target]
    results = []
    for n, (step, path, mode) in enumerate(STEPS):
        checkpoint = tiny_model_b if n % 2 == 0 else tiny_model
        new_version = f"v{n + 1}"
        await _arm(fleet, target_index, path, mode=mode)
        t0 = time.monotonic()
        with pytest.raises(WeightUpdateFailed) as ei:
            async with b.weight_update(new_version) as tx:
                await tx.update_from_disk(str(checkpoint))
        failed_s = time.monotonic() - t0
        err = ei.value
        env.errors_seen.append(str(err))
        assert target in err.workers and step in err.steps, err
        assert next(f.step for f in err.failures if f.worker == target) == step, err
        assert all(f.worker == target for f in err.failures if f.step == step), err
        assert err.version == new_version and err.previous == version
        report = await b.health()
        assert report.ready, f"a worker was left paused after {step}: {report}"
        assert set((await b.weight_versions()).values()) == {version}, f"version advanced after {step}"
        # The fault was one-shot: the whole update again succeeds everywhere.
        async with b.weight_update(new_version) as tx:
            await tx.update_from_disk(str(checkpoint))
        assert set((await b.weight_versions()).values()) == {new_version}
        outs = {(await b.generate(_req(0, w))).output_ids for w in b.workers}
        assert len(outs) == 1, f"workers disagree after the retried update ({step})"
        out = outs.pop()
        assert tokens.setdefault(checkpoint, out) == out
        g = await b.generate(_req(0))
        assert g.weight_version == new_version
        version = new_version
        results.append({"step": step, "mode": mode, "failed_after_s": round(failed_s, 3), "error": str(err)[:160]})
    assert tokens[tiny_model] != tokens[tiny_model_b]
    print("\n" + "\n".join(f"{r['step']:<12} {r['mode']:<5} {r['failed_after_s']}s  {r['error']}" for r in results))

    # A failed resume is named too; the fleet recovers with one more resume().
    await _arm(fleet, target_index, "/continue_generation", mode="error")
    with pytest.raises(WeightUpdateFailed) as ei2:
        async with b.weight_update("v-resume") as tx:
            await tx.update_from_disk(str(tiny_model))
    assert ei2.value.steps == ("resume",) and ei2.value.workers == (target,)
    env.errors_seen.append(str(ei2.value))
    await b.resume()
    assert (await b.health()).ready
    figures["sglang_failed_weight_update"] = {"workers": 3, "faulty_worker": target, "cases": results}


# -- admin surface --------------------------------------------------------------------------------


async def test_control_needs_the_admin_key(env: Env) -> None:
    fleet, b = env.fleet, env.backend
    url = fleet.worker_urls[0]
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": f"Bearer {API_KEY}"}, {"Authorization": "Bearer wrong"}):
            for path in ("/pause_generation", "/update_weight_version", "/flush_cache", "/_faults"):
                async with s.post(url + path, json={}, headers=headers) as r:
                    assert r.status == 401, (path, headers, r.status)
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        async with s.post(url + "/generate", json=body) as r:
            assert r.status == 200  # data routes are open with an admin key alone (SGLang's rule)
        assert fleet.router_url is not None
        async with s.post(fleet.router_url + "/generate", json=body) as r:
            router_status = r.status
    # A client without the admin key cannot pause; it still generates.
    from rollout_backends.adapters.sglang import connect

    data_only = await connect(fleet.entry_url, workers=list(fleet.worker_urls))
    try:
        with pytest.raises(ControlFailed) as ei:
            await data_only.pause()
        assert set(ei.value.workers) == set(b.workers) and "401" in str(ei.value)
        env.errors_seen.append(str(ei.value))
        assert (await data_only.generate(_req(0))).output_ids == env.expected[PROMPTS[0]]
    finally:
        await data_only.client.aclose()
    print(f"\nrouter /generate without a key: HTTP {router_status}")


async def test_listeners_are_loopback_and_keys_never_shown(env: Env, figures: dict[str, Any]) -> None:
    fleet, b = env.fleet, env.backend
    pids = [p for ps in fleet.pids().values() for p in ps]
    addrs = listening_addresses(pids)
    assert addrs and all(is_loopback(a) for a in addrs), addrs
    shown = [repr(fleet), repr(fleet.config), repr(b), repr(b.client), repr(b.wire), *env.errors_seen]
    for name in fleet.supervisor.names:
        shown.append(" ".join(redact_argv(fleet.supervisor.process(name).spec.argv)))
    logs = {p.name: p.read_text(errors="replace") for p in Path(fleet.log_dir).rglob("*") if p.is_file()}
    assert logs and env.errors_seen
    for key in (API_KEY, ADMIN_KEY):
        assert not any(key in s for s in shown), key
        leaked = [name for name, text in logs.items() if key in text]
        assert not leaked, f"key in logs: {leaked}"
    figures["sglang_admin_surface"] = {
        "listening": sorted(addrs),
        "log_files_checked": len(logs),
        "messages_checked": len(shown),
    }
    print(f"\nlisteners: {sorted(addrs)}; {len(logs)} log files and {len(shown)} messages checked")


async def test_outcome_counter_sanity() -> None:
    """The load runner counts every request exactly once, whatever it ends with."""
    from rollout_backends import BackendUnavailable

    async def gen(req: GenerateRequest) -> Any:
        k = req.input_ids[0] % 3
        if k == 0:
            raise BackendUnavailable("down")
        if k == 1:
            raise RuntimeError("untyped")
        await asyncio.sleep(0)
        return type("G", (), {"worker": "w"})()

    report = await run_load(gen, lambda i: GenerateRequest(input_ids=[i + 3]), 30, concurrency=4)
    assert report.sent == 30 and report.completed == 10 and report.errors["BackendUnavailable"] == 10
    assert report.lost == 10 and sum(report.untyped.values()) == 10
    assert collections.Counter(o for *_, o in report.timeline)["ok"] == 10
