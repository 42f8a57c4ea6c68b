"""The conformance suite on two fake vLLM 0.26 servers (``fake_vllm.py``) through ``vllm://``:
every check the adapter declares passes; what it does not declare skips, for a reason."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import rollout_backends as rb
from rollout_backends.conformance import ALL_CHECKS, Outcome, Report, run_checks
from tests.vllm.conftest import fake_fleet, fake_harness

#: Checks that skip on the fake, and the reason each must give (anything else is a failure).
EXPECTED_SKIPS = {
    "tensor_update_matches_fresh": "'tensor' not declared",  # no CUDA IPC on a CPU
    # a failed reload_weights killed vLLM 0.26's engine core (H100 capture of 2026-12-06)
    "update_failure_keeps_version": "survives_failed_load=True not declared",
    "injected_failure_rolls_back": "survives_failed_load=True not declared",
    "distributed_update_matches_fresh": "'distributed' not declared",  # no NCCL on a CPU
    "stop_strings": "stop_strings=True not declared",  # 0.26's generate answers no text
    # vLLM is batch invariant only with VLLM_BATCH_INVARIANT=1 (test_batch_invariant_fake below).
    "seeded_sampling": "seeded_sampling=True not declared",
    "concurrent_equals_sequential": "batch_invariant=True not declared",
    # 0.26 keeps no weight version: the fleet stamps spans where no update overlapped.
    "version_spans_across_update": "version_spans=RESPONSE not declared",
    "version_spans_across_in_place_update": "version_spans=RESPONSE not declared",
    "stream_version_spans_across_update": "stream_version_spans=True not declared",
    "stream_version_spans_across_in_place_update": "stream_version_spans=True not declared",
}


@pytest.fixture(scope="module")
def fake_report(tiny_model: Path, tiny_model_b: Path) -> Report:
    async def run() -> Report:
        async with fake_fleet(tiny_model, 2) as (fakes, url):
            harness = fake_harness(fakes, tiny_model, tiny_model_b, concurrency=24)
            return await run_checks(lambda: rb.open_backend(url), harness, label="fake vLLM 0.26 x2")

    report = asyncio.run(run())
    print("\n" + report.summary())
    return report


@pytest.mark.parametrize("name", [c.name for c in ALL_CHECKS])
def test_fake_vllm_conforms(fake_report: Report, name: str) -> None:
    result = fake_report[name]
    if name in EXPECTED_SKIPS:
        assert result.outcome is Outcome.SKIP, result.line()
        assert EXPECTED_SKIPS[name] in result.line(), result.line()
    else:
        assert result.outcome is Outcome.PASS, f"{result.line()}\n{result.traceback or ''}"


def test_batch_invariant_fake(tiny_model: Path, tiny_model_b: Path) -> None:
    """With ``VLLM_BATCH_INVARIANT=1`` in its environment (``/server_info``) a server declares
    seeded sampling and batch invariance, and the checks that need them pass."""

    async def run() -> Report:
        async with fake_fleet(tiny_model, 1, batch_invariant=True) as (fakes, url):
            harness = fake_harness(fakes, tiny_model, tiny_model_b, concurrency=16)
            select = ["seeded_sampling", "concurrent_equals_sequential"]
            return await run_checks(lambda: rb.open_backend(url), harness, select=select)

    report = asyncio.run(run())
    assert [r.outcome for r in report.results] == [Outcome.PASS, Outcome.PASS], report.summary()


FILTERS = ["top_k", "top_p", "min_p"]


@pytest.mark.parametrize(
    ("mode", "answers_filtered", "fails_with"),
    [
        ("processed_logprobs", None, None),  # the launcher's: declared, and answered so
        ("raw_logprobs", None, None),  # vLLM's default: unfiltered, not declared
        ("raw_logprobs", True, "which the backend does not declare"),  # says raw, filters all the same
        ("processed_logprobs", False, "so filtered_logprobs is declared wrongly"),  # says processed, does not
    ],
)
def test_filtered_logprobs_follow_the_servers_logprobs_mode(
    tiny_model: Path, tiny_model_b: Path, mode: str, answers_filtered: bool | None, fails_with: str | None
) -> None:
    """``filtered_logprobs`` is what ``/server_info``'s ``logprobs_mode`` says; the filter checks
    pass where the answers agree with it and fail, naming the cause, where they do not."""

    async def run() -> tuple[rb.Capabilities, Report]:
        async with fake_fleet(tiny_model, 1, logprobs_mode=mode, answers_filtered=answers_filtered) as (fakes, url):
            backend = await rb.open_backend(url)
            caps = backend.capabilities
            await backend.aclose()
            harness = fake_harness(fakes, tiny_model, tiny_model_b)
            return caps, await run_checks(lambda: rb.open_backend(url), harness, select=FILTERS)

    caps, report = asyncio.run(run())
    assert caps.filtered_logprobs is (mode == "processed_logprobs")
    for result in report.results:
        if fails_with is None:
            assert result.outcome is Outcome.PASS, result.line()
        else:
            assert result.outcome is Outcome.FAIL and fails_with in result.line(), result.line()


def test_resume_after_a_partial_resume_wakes_what_still_sleeps(tiny_model: Path) -> None:
    """Miles' colocated order (weights back, load, then the KV cache) and a plain resume after a
    partial one, on a fake that fails a plain ``/wake_up`` after ``tags=weights`` as vLLM 0.26
    did on the H100 (``fake_vllm.FakeVllm.wake_up``): greedy tokens as before, every server awake."""

    async def run() -> None:
        async with fake_fleet(tiny_model, 2) as (fakes, url):
            backend = await rb.open_backend(url)
            try:
                request = rb.GenerateRequest(
                    input_ids=[5, 6, 7], sampling=rb.SamplingParams(max_new_tokens=6, temperature=0.0)
                )
                before = (await backend.generate(request)).output_ids
                for second in ((rb.MemoryTag.KV_CACHE,), None):
                    await backend.release_memory()
                    assert all(f.sleeping_tags == {"weights", "kv_cache"} for f in fakes)
                    await backend.resume_memory([rb.MemoryTag.WEIGHTS])
                    await backend.resume_memory(second)
                    assert not any(f.sleeping or f.stuck.is_set() for f in fakes), second
                    assert (await backend.generate(request)).output_ids == before, second
            finally:
                await backend.aclose()

    asyncio.run(asyncio.wait_for(run(), 60))
