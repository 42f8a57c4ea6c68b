"""A launched SGLang fleet of real processes: two reference workers behind a real ``smg`` router.

One fleet per module (``launch_sglang_fleet``, cache_aware policy); each test leaves the workers
resumed, on model A's weights. What the router forwards (generation, its 4xx bodies) goes through
it; what it does not (abort, pause, flush, weights, versions) is fanned out by the adapter to each
worker, and checked here on each worker's own routes.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import attrs
import pytest
import pytest_asyncio

from rollout_backends import (
    ControlFailed,
    FinishReason,
    GenerateRequest,
    Generation,
    InvalidRequest,
    PauseMode,
    RoutingKind,
    SamplingParams,
    WeightGroup,
    open_backend,
)
from rollout_backends.adapters.reference import ReferenceBackend, WeightSender, free_port
from rollout_backends.adapters.sglang import SGLangFleet, SGLangFleetConfig, connect, launch_sglang_fleet

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS: list[tuple[int, ...]] = [(1, 17, 42, 99, 300, 7), (5, 6, 7, 8, 9, 10, 11, 12), tuple(range(20, 60)), (400, 3)]
START_VERSION = "v0"
ROOT = Path(__file__).resolve().parents[2]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(model_a: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SGLangFleet]:
    config = SGLangFleetConfig(
        model_path=str(model_a),
        workers=2,
        worker_kind="reference",
        router="smg",
        router_policy="cache_aware",
        health_check_interval_s=1,
        weight_version=START_VERSION,
        log_dir=str(tmp_path_factory.mktemp("fleet-logs")),
        startup_timeout_s=120,
    )
    async with launch_sglang_fleet(config) as f:
        yield f


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def slow_fleet(model_a: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SGLangFleet]:
    """Two workers whose every forward takes >= 10 ms (``slow_engine``): a request of N tokens is in
    flight for >= N * 10 ms, so a test can act on it before it finishes on any machine."""
    config = SGLangFleetConfig(
        model_path=str(model_a),
        workers=2,
        worker_kind="reference",
        router="smg",
        router_policy="cache_aware",
        health_check_interval_s=1,
        weight_version=START_VERSION,
        extra_server_args=("--engine-factory", "tests.sglang.slow_engine:factory"),
        env={"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)},
        log_dir=str(tmp_path_factory.mktemp("slow-fleet-logs")),
        startup_timeout_s=120,
    )
    async with launch_sglang_fleet(config) as f:
        yield f


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def local(model_a: Path) -> AsyncIterator[ReferenceBackend]:
    """The in-process reference on the same model: what the fleet must equal exactly."""
    backend = ReferenceBackend.create(model_a, workers=1)
    yield backend
    await backend.aclose()


async def _get(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
        body = await r.read()
        return r.status, (json.loads(body) if body and r.content_type == "application/json" else body.decode())


async def _each_worker(fleet: SGLangFleet, path: str) -> dict[str, Any]:
    """GET ``path`` on every worker directly (not through the router)."""
    out = {}
    for wid, url in zip(fleet.worker_ids, fleet.worker_urls, strict=True):
        out[wid] = await _get(f"{url}{path}")
    return out


async def _started(task: asyncio.Task[Generation], seconds: float = 0.3) -> None:
    """Give a request time to reach its worker and start decoding; it must still be running."""
    await asyncio.sleep(seconds)
    assert not task.done(), "the request finished before the test could act on it (make it longer)"


# -- launch and parity --------------------------------------------------------------------------


async def test_fleet_handle_and_router_listing(fleet: SGLangFleet) -> None:
    b = fleet.backend
    assert fleet.router_url is not None and fleet.router_url.startswith("http://127.0.0.1:")
    assert b.workers == fleet.worker_ids == tuple(u.removeprefix("http://") for u in fleet.worker_urls)
    assert b.capabilities.routing is RoutingKind.CACHE_AWARE
    assert b.capabilities.vocab_size == 512 and b.capabilities.max_context == 4096
    status, listing = await _get(f"{fleet.router_url}/workers")
    assert status == 200
    assert sorted(w["url"] for w in listing["workers"]) == sorted(fleet.worker_urls)
    assert all(w["is_healthy"] for w in listing["workers"])
    report = await b.health()
    assert report.ready and report.router_live is True
    assert {w.weight_version for w in report.workers} == {START_VERSION}
    assert sorted(p.name for p in fleet.log_dir.iterdir()) == ["router.log", "worker-0.log", "worker-1.log"]


async def test_a_bare_url_discovers_the_limits(fleet: SGLangFleet) -> None:
    """``sglang://host:port`` of the router and nothing else: the vocabulary size (the served model's
    config.json) and the context length (/server_info) come from the workers (issue 16: the
    conformance suite failed 22 checks on such a URL for want of the vocabulary size)."""
    assert fleet.router_url is not None
    for url in (fleet.router_url, fleet.worker_urls[0]):
        backend = await open_backend("sglang://" + url.split("://", 1)[1])
        try:
            assert (backend.capabilities.vocab_size, backend.capabilities.max_context) == (512, 4096)
        finally:
            await backend.aclose()


async def test_greedy_and_seeded_outputs_equal_in_process_reference(
    fleet: SGLangFleet, local: ReferenceBackend
) -> None:
    sampled = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=1234)
    for sampling in (GREEDY, sampled):
        want = [await local.generate(GenerateRequest(input_ids=p, sampling=sampling)) for p in PROMPTS]
        # Twice through the router, so both workers serve each prompt at least once under most policies.
        for _ in range(2):
            got = await asyncio.gather(*(fleet.backend.generate(GenerateRequest(input_ids=p, sampling=sampling))
                                         for p in PROMPTS))  # fmt: skip
            for g, w in zip(got, want, strict=True):
                assert g.output_ids == w.output_ids
                assert g.logprobs == w.logprobs  # exactly: same engine, same thread count, JSON floats round-trip
                assert g.finish_reason is FinishReason.LENGTH and g.weight_version == START_VERSION
    # Pinned to each worker (its own URL, bypassing the router): the same numbers.
    for wid in fleet.worker_ids:
        g = await fleet.backend.generate(GenerateRequest(input_ids=PROMPTS[0], sampling=GREEDY, worker=wid))
        w = await local.generate(GenerateRequest(input_ids=PROMPTS[0], sampling=GREEDY))
        assert (g.output_ids, g.logprobs, g.worker) == (w.output_ids, w.logprobs, wid)


# -- routing ------------------------------------------------------------------------------------

BURST = 16
ONE_BY_ONE = 8
ROUTE_SAMPLING = SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True)
PREFIX_LEN = 64
PAGE = 16
FULL_HIT = (PREFIX_LEN - 1) // PAGE * PAGE  # the last prompt token is always computed


def _prompt(salt: int) -> tuple[int, ...]:
    return tuple((salt * 7919 + i * 31) % 500 + 3 for i in range(PREFIX_LEN))


async def _burst(backend: Any, prompt: tuple[int, ...], label: str) -> list[Generation]:
    reqs = [GenerateRequest(input_ids=prompt, sampling=ROUTE_SAMPLING.replace(seed=i), request_id=f"{label}-{i}")
            for i in range(BURST)]  # fmt: skip
    return list(await asyncio.gather(*(backend.generate(r) for r in reqs)))


def _served(gens: list[Generation]) -> collections.Counter[str]:
    return collections.Counter(str(g.weight_version) for g in gens)


async def _measure(backend: Any, salt: int) -> dict[str, Any]:
    """A cold burst of 16 samples of a fresh prompt; then one request warms another fresh prompt on
    one worker, 8 requests of that prompt follow one at a time (no worker ever busier than the other,
    so the policy alone picks), and then a burst of 16 samples of it."""
    cold = await _burst(backend, _prompt(salt), f"cold-{salt}")
    warm_prompt = _prompt(salt + 1)
    first = await backend.generate(GenerateRequest(input_ids=warm_prompt, sampling=ROUTE_SAMPLING.replace(seed=99)))
    one_by_one = []
    for i in range(ONE_BY_ONE):
        one_by_one.append(
            await backend.generate(
                GenerateRequest(input_ids=warm_prompt, sampling=ROUTE_SAMPLING.replace(seed=200 + i))
            )
        )
    warm = await _burst(backend, warm_prompt, f"warm-{salt}")
    return {
        "cold": _served(cold),
        "cold_hits": sum(g.cached_tokens > 0 for g in cold),
        "warm_worker": first.weight_version,
        "one_by_one": _served(one_by_one),
        "one_by_one_cached": [g.cached_tokens for g in one_by_one if g.weight_version == first.weight_version],
        "warm": _served(warm),
        "warm_cached_on_warm_worker": [g.cached_tokens for g in warm if g.weight_version == first.weight_version],
    }


async def test_routing_cache_aware_vs_round_robin_vs_prefix_hash(fleet: SGLangFleet) -> None:
    """Which worker served a request: each worker is given its own weight-version label through the
    control plane (``/update_weight_version`` on each, as on real SGLang), and every response carries
    ``meta_info.weight_version``. ``cached_tokens`` is each response's own prefix-cache hit count."""
    b = fleet.backend
    w0, w1 = fleet.worker_ids
    await b.set_weight_version("A", workers=[w0])
    await b.set_weight_version("B", workers=[w1])
    try:
        rr = await connect(await fleet.add_router("round_robin"), workers=list(fleet.worker_urls))
        ph = await connect(await fleet.add_router("prefix_hash"), workers=list(fleet.worker_urls))
        results = {}
        salt = 1000
        for name, backend in (("cache_aware", b), ("round_robin", rr), ("prefix_hash", ph)):
            results[name] = [await _measure(backend, salt := salt + 10) for _ in range(2)]
        await rr.client.aclose()
        await ph.client.aclose()
        for name, ms in results.items():
            for m in ms:
                print(f"\n{name}: {json.dumps(m, default=dict)}", end="")

        for m in results["round_robin"]:  # strict alternation, whatever the cache holds
            assert m["cold"] == {"A": 8, "B": 8} and m["warm"] == {"A": 8, "B": 8}
            assert m["cold_hits"] == BURST - 2  # the first request on each worker misses
            assert m["one_by_one"] == {"A": ONE_BY_ONE // 2, "B": ONE_BY_ONE // 2}
        for m in results["cache_aware"]:
            # With no load difference the prefix alone picks: every request follows the warmed worker.
            assert m["one_by_one"] == {m["warm_worker"]: ONE_BY_ONE}, m
            assert m["one_by_one_cached"] == [FULL_HIT] * ONE_BY_ONE
            # In a burst smg spreads part of the requests over the other worker; how many moves with
            # timing (11/5 on an idle machine, 8/8 on the 2-core CI runner of 2026-12-04), so only
            # the cache hits on the warmed worker are asserted, not the split.
            assert m["warm_cached_on_warm_worker"] == [FULL_HIT] * m["warm"][m["warm_worker"]]
        for m in results["prefix_hash"]:  # a pure function of the prefix: all 16 on one worker, hit
            assert len(m["cold"]) == 1 and m["cold_hits"] == BURST - 1
            assert m["one_by_one"] == {m["warm_worker"]: ONE_BY_ONE}
            assert m["warm"] == {m["warm_worker"]: BURST}
            assert m["warm_cached_on_warm_worker"] == [FULL_HIT] * BURST
    finally:
        await b.set_weight_version(START_VERSION)


async def test_a_session_stays_on_one_worker_behind_smg(fleet: SGLangFleet, model_a: Path) -> None:
    """Issue 27 item 3: Miles' session server sends each turn with ``X-SMG-Routing-Key``; behind the
    Miles facade the key reaches smg (the SGLang wire forwards the header), whose ``manual`` policy
    (what ``--use-session-server`` defaults Miles' router to) and ``consistent_hashing`` keep each
    session on one worker, every turn finding the previous one's prompt cached; round robin without
    the key moves them."""
    from transformers import AutoTokenizer

    from rollout_backends.integrations.miles import MilesFacade, start_facade
    from tests.affinity_sessions import assert_sticky_and_cached, moved, run_sessions

    b = fleet.backend
    w0, w1 = fleet.worker_ids
    await b.set_weight_version("A", workers=[w0])
    await b.set_weight_version("B", workers=[w1])
    tokenizer = AutoTokenizer.from_pretrained(str(model_a))
    try:
        for policy, keyed, base in (("manual", True, 20), ("consistent_hashing", True, 21), ("round_robin", False, 22)):
            backend = await connect(await fleet.add_router(policy), workers=list(fleet.worker_urls))
            facade = await start_facade(MilesFacade(backend, tokenizer=tokenizer, model_path="tiny"), port=0)
            try:
                turns = await run_sessions(facade.url, keyed=keyed, base=base)
            finally:
                await facade.stop()
                await backend.client.aclose()
            print(f"\n{policy} keyed={keyed}: {json.dumps(turns)}", end="")
            if keyed:
                assert_sticky_and_cached(turns, 16)
            else:
                assert moved(turns), turns
    finally:
        await b.set_weight_version(START_VERSION)


# -- control fan-out ----------------------------------------------------------------------------


async def test_control_calls_reach_every_worker(fleet: SGLangFleet) -> None:
    b = fleet.backend
    await b.pause(PauseMode.RETRACT)
    try:
        for status, info in (await _each_worker(fleet, "/server_info")).values():
            assert status == 200 and info["internal_states"][0]["paused"] is True
        assert {s for s, _ in (await _each_worker(fleet, "/ready")).values()} == {503}
        await b.flush_cache()  # allowed while paused and idle, on every worker
    finally:
        await b.resume()
    for _status, info in (await _each_worker(fleet, "/server_info")).values():
        assert info["internal_states"][0]["paused"] is False
    assert {s for s, _ in (await _each_worker(fleet, "/ready")).values()} == {200}

    await b.set_weight_version("fan-1")
    for status, info in (await _each_worker(fleet, "/model_info")).values():
        assert status == 200 and info["weight_version"] == "fan-1"
    assert dict(await b.weight_versions()) == dict.fromkeys(fleet.worker_ids, "fan-1")
    # One worker only: the other keeps its label, and the fleet reports the split.
    await b.set_weight_version("fan-2", workers=[fleet.worker_ids[1]])
    infos = await _each_worker(fleet, "/model_info")
    assert [infos[w][1]["weight_version"] for w in fleet.worker_ids] == ["fan-1", "fan-2"]
    await b.set_weight_version(START_VERSION)


# -- abort and pause modes ----------------------------------------------------------------------

LONG = SamplingParams(max_new_tokens=3000, temperature=0.0, ignore_eos=True)


async def _prefix_matches_local(local: ReferenceBackend, prompt: tuple[int, ...], gen: Generation) -> None:
    n = len(gen.output_ids)
    ref = await local.generate(GenerateRequest(input_ids=prompt, sampling=GREEDY.replace(max_new_tokens=n)))
    assert gen.output_ids == ref.output_ids
    assert gen.logprobs is not None and ref.logprobs is not None
    assert gen.logprobs == pytest.approx(ref.logprobs, abs=1e-4)


async def test_abort_through_router_returns_partial_tokens(fleet: SGLangFleet, local: ReferenceBackend) -> None:
    prompt = (9, 8, 7, 6, 5)
    task = asyncio.ensure_future(fleet.backend.generate(GenerateRequest(input_ids=prompt, sampling=LONG,
                                                                        request_id="abort-me")))  # fmt: skip
    await _started(task)
    for _ in range(50):  # the abort fans out to both workers; repeat in case it raced the request
        await fleet.backend.abort("abort-me")
        done, _ = await asyncio.wait([task], timeout=0.2)
        if done:
            break
    gen = await asyncio.wait_for(task, 10)
    assert gen.finish_reason is FinishReason.ABORT
    assert 0 < len(gen.output_ids) < LONG.max_new_tokens
    assert gen.logprobs is not None and len(gen.logprobs) == len(gen.output_ids)
    await _prefix_matches_local(local, prompt, gen)  # the partial output is the real greedy prefix


async def test_pause_abort_ends_in_flight_requests(fleet: SGLangFleet, local: ReferenceBackend) -> None:
    prompt = (11, 12, 13)
    task = asyncio.ensure_future(fleet.backend.generate(GenerateRequest(input_ids=prompt, sampling=LONG)))
    await _started(task)
    await fleet.backend.pause(PauseMode.ABORT)
    try:
        gen = await asyncio.wait_for(task, 10)
    finally:
        await fleet.backend.resume()
    assert gen.finish_reason is FinishReason.ABORT and 0 < len(gen.output_ids) < LONG.max_new_tokens
    await _prefix_matches_local(local, prompt, gen)


@pytest.mark.parametrize("mode", [PauseMode.RETRACT, PauseMode.IN_PLACE])
async def test_pause_retract_and_in_place_complete_after_resume(
    slow_fleet: SGLangFleet, local: ReferenceBackend, mode: PauseMode
) -> None:
    fleet = slow_fleet  # 200 tokens take >= 2 s: the pause below lands while the request runs
    prompt = (21, 22, 23, 24)
    sampling = GREEDY.replace(max_new_tokens=200)
    task = asyncio.ensure_future(fleet.backend.generate(GenerateRequest(input_ids=prompt, sampling=sampling)))
    await _started(task, 0.2)
    await fleet.backend.pause(mode)
    try:
        await asyncio.sleep(0.3)
        assert not task.done(), f"a request finished while the fleet was paused ({mode.value})"
        if mode is PauseMode.IN_PLACE:
            # The worker holding the request's KV refuses; the idle one flushes.
            with pytest.raises(ControlFailed) as err:
                await fleet.backend.flush_cache()
            assert len(err.value.failures) == 1 and err.value.failures[0].worker in fleet.worker_ids
            assert "in_place" in err.value.failures[0].message
        else:
            await fleet.backend.flush_cache()  # RETRACT dropped the KV: flushing is allowed
    finally:
        await fleet.backend.resume()
    gen = await asyncio.wait_for(task, 60)
    assert gen.finish_reason is FinishReason.LENGTH and len(gen.output_ids) == 200
    want = await local.generate(GenerateRequest(input_ids=prompt, sampling=sampling))
    assert gen.output_ids == want.output_ids


# -- weight updates -----------------------------------------------------------------------------


async def _check_fleet_equals(fleet: SGLangFleet, model: Path, version: str) -> None:
    fresh = ReferenceBackend.create(model, workers=1)
    try:
        want = [await fresh.generate(GenerateRequest(input_ids=p, sampling=GREEDY)) for p in PROMPTS]
    finally:
        await fresh.aclose()
    for wid in fleet.worker_ids:  # pinned: each worker separately
        got = [await fleet.backend.generate(GenerateRequest(input_ids=p, sampling=GREEDY, worker=wid)) for p in PROMPTS]
        assert [g.output_ids for g in got] == [w.output_ids for w in want], wid
        assert [g.logprobs for g in got] == [w.logprobs for w in want], wid
        assert {g.weight_version for g in got} == {version}
    routed = await fleet.backend.generate(GenerateRequest(input_ids=PROMPTS[0], sampling=GREEDY))
    assert routed.output_ids == want[0].output_ids and routed.weight_version == version
    for status, info in (await _each_worker(fleet, "/model_info")).values():
        assert status == 200 and info["weight_version"] == version


async def test_weight_updates_from_disk_and_gloo(fleet: SGLangFleet, model_a: Path, model_b: Path) -> None:
    b = fleet.backend
    before = await b.generate(GenerateRequest(input_ids=PROMPTS[0], sampling=GREEDY))
    async with b.weight_update("disk-b") as tx:
        await tx.update_from_disk(str(model_b))
    await _check_fleet_equals(fleet, model_b, "disk-b")
    after = await b.generate(GenerateRequest(input_ids=PROMPTS[0], sampling=GREEDY))
    assert after.output_ids != before.output_ids  # the outputs did change

    # Back to model A over a gloo group: trainer = rank 0, the two workers ranks 1 and 2.
    from safetensors.torch import load_file

    named = list(load_file(str(model_a / "model.safetensors")).items())
    group = WeightGroup(master_address="127.0.0.1", master_port=free_port(), world_size=3, backend="gloo")
    sender = WeightSender(group.master_address, group.master_port, world_size=3, timeout_s=60)
    try:
        await asyncio.gather(asyncio.to_thread(sender.connect), b.init_weight_group(group))
        async with b.weight_update("gloo-a", mode=PauseMode.RETRACT) as tx:
            from rollout_backends import WeightBucket

            bucket = WeightBucket.from_named_tensors(named)
            await asyncio.gather(asyncio.to_thread(sender.broadcast, named), tx.update_from_distributed(bucket))
        await b.destroy_weight_group()
    finally:
        sender.close()
    await _check_fleet_equals(fleet, model_a, "gloo-a")
    await b.set_weight_version(START_VERSION)


async def test_flat_bucket_tensor_updates(fleet: SGLangFleet, model_a: Path, model_b: Path) -> None:
    """TensorBuckets through the transaction: one flattened_bucket payload per bucket to each worker
    (shared memory on CPU), the buffers reused for the push back."""
    from safetensors.torch import load_file

    from rollout_backends import TensorBuckets

    b = fleet.backend
    assert b.capabilities.flattened_buckets
    packer = TensorBuckets(max_bytes=300_000)  # a few buckets of the tiny model
    async with b.weight_update("flat-b") as tx:
        await tx.update_from_tensors(load_file(str(model_b / "model.safetensors")).items(), buckets=packer)
    await _check_fleet_equals(fleet, model_b, "flat-b")
    held = packer.allocated_bytes
    async with b.weight_update("flat-a") as tx:
        await tx.update_from_tensors(load_file(str(model_a / "model.safetensors")).items(), buckets=packer)
    assert packer.allocated_bytes == held  # same layout: the same buffers
    await _check_fleet_equals(fleet, model_a, "flat-a")
    await b.set_weight_version(START_VERSION)


# -- invalid input ------------------------------------------------------------------------------


async def test_invalid_inputs_are_invalid_request(fleet: SGLangFleet) -> None:
    b = fleet.backend
    # Caught by the client before sending (vocab size from the model's config.json, context from /server_info).
    with pytest.raises(InvalidRequest) as e1:
        await b.generate(GenerateRequest(input_ids=(1, 600), sampling=GREEDY))
    assert e1.value.field == "input_ids[1]"
    with pytest.raises(InvalidRequest) as e2:
        await b.generate(GenerateRequest(input_ids=(1,) * 4096, sampling=GREEDY))
    assert e2.value.field == "input_ids"
    # smg silently drops unknown sampling keys, so they must never get that far: the typed params refuse them.
    with pytest.raises(InvalidRequest) as e3:
        SamplingParams.from_mapping({"max_new_tokens": 4, "seed_typo": 1})
    assert e3.value.field == "sampling.seed_typo"

    # Without the client-side limits the same inputs reach a worker through the router: its 400
    # comes back through smg and is mapped to InvalidRequest naming the field.
    raw = await connect(fleet.router_url or "", workers=list(fleet.worker_urls))
    try:
        raw.capabilities = attrs.evolve(raw.capabilities, max_context=None, vocab_size=None)
        with pytest.raises(InvalidRequest) as s1:
            await raw.generate(GenerateRequest(input_ids=(1, 600), sampling=GREEDY))
        assert s1.value.field == "input_ids[1]" and "vocabulary" in str(s1.value)
        with pytest.raises(InvalidRequest) as s2:
            await raw.generate(GenerateRequest(input_ids=(1,) * 4096, sampling=GREEDY))
        assert s2.value.field == "input_ids" and "context length" in str(s2.value)
    finally:
        await raw.client.aclose()
    # The fleet still serves, and names the worker smg routed to (its x-smg-routed-worker-id header).
    ok = await b.generate(GenerateRequest(input_ids=(1, 2, 3), sampling=GREEDY))
    assert len(ok.output_ids) == GREEDY.max_new_tokens
    assert ok.worker in b.workers
