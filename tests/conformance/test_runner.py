"""The conformance machinery against a fake backend: passes, skips, failures, errors, selection."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, NoReturn

import attrs
import pytest

import rollout_backends as rb
from rollout_backends.conformance import (
    ALL_CHECKS,
    CheckContext,
    CheckFailed,
    Gap,
    Harness,
    Outcome,
    Report,
    SkipCheck,
    check,
    check_disk_update_matches_fresh,
    check_greedy_shapes,
    check_labels_follow_weights,
    check_parity,
    check_top_k,
    compare,
    expect,
    permute_safetensors_vocabulary,
    requires,
    run_check,
    run_checks,
    select_checks,
)
from rollout_backends.testing import FakeFleet, permute_checkpoint, write_checkpoint
from tests.conformance.fake_backend import BUGS, FULL, VOCAB, BuggyDriver, FakeBackend, fake_factory, fake_harness

_NO_ENGINE_SPANS = "capability version_spans=RESPONSE not declared (spans across an update come only from an engine)"
_NO_STREAM_SPANS = "capability stream_version_spans=True not declared"  # streaming is declared
_NOT_WHILE_PARKED = "capability update_while_parked not declared (a RETRACT update with requests parked is refused)"
NEEDS_HOOK_OR_CAPABILITY = {
    "distributed_update_matches_fresh": (
        "weight transport 'distributed' not declared; harness hook 'make_sender' not provided"
    ),
    "hf_logprob_parity": "harness hook 'hf_model_path' not provided",
    "staleness_visible": "needs >= 2 workers, the fleet has 1",
    "min_version_after_partial_update": "needs >= 2 workers, the fleet has 1",
    "version_spans_quiet": "capability version_spans not declared (it is NONE: answers carry no per-token versions)",
    "version_spans_across_update": f"{_NO_ENGINE_SPANS}; {_NOT_WHILE_PARKED}",
    "stream_version_spans_across_update": f"{_NO_STREAM_SPANS}; {_NOT_WHILE_PARKED}",
    "version_spans_across_in_place_update": _NO_ENGINE_SPANS,
    "stream_version_spans_across_in_place_update": _NO_STREAM_SPANS,
}


def _outcomes(report: Report) -> dict[str, Outcome]:
    return {r.name: r.outcome for r in report.results}


async def test_full_fake_passes_every_check_it_can(tmp_path: Path) -> None:
    report = await run_checks(fake_factory(), fake_harness(tmp_path), label="fake")
    assert [r.name for r in report.results] == [c.name for c in ALL_CHECKS]
    bad = [r.line() for r in report.results if not r.ok]
    assert not bad, "\n".join(bad)
    skipped = {r.name: r.message for r in report.skipped}
    assert skipped == NEEDS_HOOK_OR_CAPABILITY
    assert report.ok
    assert "fake" in report.summary() and f"{len(report.passed)} pass" in report.summary()
    # measured numbers are reported
    assert report["concurrent_equals_sequential"].measurements["requests"] == 40
    assert report["abort_one"].measurements["abort_tokens_kept"] >= 1


async def test_two_workers_run_the_staleness_check(tmp_path: Path) -> None:
    report = await run_checks(
        fake_factory(workers=2), fake_harness(tmp_path), select=["staleness_visible", "health_*", "injected_*"]
    )
    assert _outcomes(report) == {
        "staleness_visible": Outcome.PASS,
        "health_live_ready": Outcome.PASS,
        "health_progress_probe": Outcome.PASS,
        "health_paused_not_ready": Outcome.PASS,
        "injected_failure_rolls_back": Outcome.PASS,
    }


async def test_backend_declaring_nothing_is_skipped_not_failed(tmp_path: Path) -> None:
    nothing = rb.Capabilities(abort=False)
    # The harness supplies the vocabulary the capabilities leave out (prompt ids stay in range).
    report = await run_checks(fake_factory(declare=nothing), fake_harness(tmp_path, vocab_size=64))
    assert not report.failed and not report.errors, report.summary()
    skipped = {r.name: r.message for r in report.skipped}
    for name in ("pause_abort", "pause_retract", "pause_in_place"):
        assert "not declared" in skipped[name], (name, skipped[name])
    assert skipped["resume_idempotent"] == skipped["health_paused_not_ready"] == "no pause mode declared"
    assert skipped["pause_in_place"] == "pause mode 'in_place' not declared"
    assert skipped["abort_one"] == "capability abort=True not declared"
    assert skipped["seeded_sampling"] == "capability seeded_sampling=True not declared"
    assert "weight transport 'disk' not declared" in skipped["disk_update_matches_fresh"]
    assert "context length unknown" in skipped["reject_prompt_too_long"]
    assert report["reject_out_of_vocab"].outcome is Outcome.PASS
    unknown = await run_checks(fake_factory(declare=nothing), Harness(), select=["reject_out_of_vocab"])
    assert "vocab size unknown" in unknown["reject_out_of_vocab"].message
    # the data-plane contract still ran
    for name in ("greedy_shapes", "finish_stop_token", "concurrent_requests_complete", "generate_group"):
        assert report[name].outcome is Outcome.PASS, report[name].line()
    assert skipped["concurrent_equals_sequential"] == "capability batch_invariant=True not declared"


async def test_missing_harness_hooks_skip_with_the_hook_named() -> None:
    report = await run_checks(fake_factory(), Harness(concurrency=8), select=["weights"])
    skipped = {r.name: r.message for r in report.skipped}
    assert "harness hook 'alt_weights_path' not provided" in skipped["disk_update_matches_fresh"]
    assert "harness hook 'fresh_factory_on' not provided" in skipped["disk_update_matches_fresh"]
    assert "harness hook 'inject_failure' not provided" in skipped["injected_failure_rolls_back"]
    # the one weight check that needs no hook runs
    assert report["update_failure_keeps_version"].outcome is Outcome.PASS


# Each bug breaks the contract in one way; the named check must report it as a failure.
BUG_TO_CHECK = {
    "resume_forgets_weights": "memory_release_resume",
    "first_resume_ends_sleep": "memory_release_resume",
    "positive_logprob": "greedy_shapes",
    "wrong_prompt_tokens": "greedy_shapes",
    "ignore_stop": "finish_stop_token",
    "off_by_one": "max_new_tokens",
    "abort_drops_tokens": "abort_one",
    "abort_noop": "abort_all",
    "concurrency_noise": "concurrent_equals_sequential",
    "set_version_aborts": "set_version_keeps_inflight",
    "stale_prefix": "stale_prefix_after_update",
    "version_lag": "disk_update_matches_fresh",
    "retract_as_abort": "pause_retract",
    "retract_flips_token": "pause_retract",
    "in_place_flush_ok": "pause_in_place",
    "paused_serves": "pause_abort",
    "failed_load_corrupts": "update_failure_keeps_version",
    "no_stale_report": "staleness_visible",
    "accept_oov": "reject_out_of_vocab",
    "seed_ignored": "seeded_sampling",
    "probe_none": "health_progress_probe",
    "resume_not_idempotent": "resume_idempotent",
    "paused_still_ready": "health_paused_not_ready",
    "top_logprobs_skip_best": "top_logprobs",
    "logprobs_shifted": "greedy_logprob_bound",
    "logprobs_shifted_ahead": "continuation_consistent",
    "pause_abort_noop": "pause_abort",
    "generation_value_error": "greedy_shapes",
    "prompt_logprobs_shifted": "prompt_logprobs_rescore",
    "version_constraints_ignored": "min_version_after_partial_update",
    "stop_string_late": "stop_strings",
    "stream_repeats_token": "stream_matches_generate",
    "stream_unversioned": "stream_matches_generate",
    "stream_no_abort": "stream_early_exit_aborts",
    "label_before_load": "labels_follow_weights",
    "loads_only_paused": "disk_update_matches_fresh",
    "temperature_ignored": "temperature",
    "top_k_ignored": "top_k",
    "filtered_logprobs_undeclared": "top_k",
    "filtered_logprobs_unfiltered": "top_p",
    "top_p_ignored": "top_p",
    "min_p_ignored": "min_p",
    "min_new_tokens_ignored": "min_new_tokens",
    "repetition_penalty_ignored": "repetition_penalty",
    "frequency_penalty_ignored": "frequency_penalty",
    "presence_penalty_ignored": "presence_penalty",
}


#: The penalty checks.
PENALTIES = {"repetition_penalty", "frequency_penalty", "presence_penalty"}
#: Checks that need a fleet of two.
TWO_WORKERS = {"staleness_visible", "min_version_after_partial_update"}


async def test_a_fleet_that_ignores_version_constraints_fails_both_checks(tmp_path: Path) -> None:
    bug = frozenset({"version_constraints_ignored"})
    for name in ("unknown_exact_version_is_retryable", "min_version_after_partial_update"):
        (c,) = select_checks([name])
        bad = await c(fake_factory(workers=2, bugs=bug), fake_harness(tmp_path))
        assert bad.outcome is Outcome.FAIL and "served" in (bad.message or ""), bad.line()
        good = await c(fake_factory(workers=2), fake_harness(tmp_path))
        assert good.outcome is Outcome.PASS, good.line()


def test_every_bug_is_mapped() -> None:
    assert set(BUG_TO_CHECK) == BUGS


@pytest.mark.parametrize("bug", sorted(BUG_TO_CHECK))
async def test_declared_capability_that_misbehaves_fails(bug: str, tmp_path: Path) -> None:
    name = BUG_TO_CHECK[bug]
    (c,) = select_checks([name])
    factory = fake_factory(workers=2 if name in TWO_WORKERS else 1, bugs=frozenset({bug}))
    result = await c(factory, fake_harness(tmp_path))
    assert result.outcome is Outcome.FAIL, result.line()
    assert result.message and result.traceback
    # and the same check passes without the bug (the failure is the bug's, not the check's)
    clean = await c(fake_factory(workers=2 if name in TWO_WORKERS else 1), fake_harness(tmp_path))
    assert clean.outcome is Outcome.PASS, clean.line()


@pytest.mark.parametrize(
    ("bug", "caught_by"),
    [("logprobs_shifted", "greedy_logprob_bound"), ("logprobs_shifted_ahead", "continuation_consistent")],
)
async def test_misaligned_logprobs_fail_with_no_harness(bug: str, caught_by: str) -> None:
    """Logprobs one position off, and nothing but the backend given: the run is not green, also
    where the backend offers no top-k or prompt logprobs to compare with (re-scoring catches it too)."""
    # Not streaming either: the bug shifts the answer's logprobs only, so a stream's chunks would
    # disagree with its final Generation and fail the stream check too.
    no_top = attrs.evolve(FULL, top_logprobs=0, prompt_logprobs=False, streaming=False)
    report = await run_checks(fake_factory(bugs=frozenset({bug}), declare=no_top), Harness(concurrency=8))
    assert not report.ok
    failed = [r.name for r in report.failed]
    # The penalty checks compare logprobs position by position, and see a shift too.
    assert caught_by in failed and set(failed) <= {caught_by, *PENALTIES}, report.summary()
    assert not report.errors, report.summary()
    assert "logprob" in report[caught_by].message
    with_top = await run_checks(fake_factory(bugs=frozenset({bug})), Harness(concurrency=8), select=["contract"])
    assert caught_by in [r.name for r in with_top.failed], with_top.summary()


def _gen(ids: tuple[int, ...], lps: tuple[float, ...], tops: tuple[tuple[tuple[int, float], ...], ...] | None) -> Any:
    return rb.Generation(
        request_id="r", output_ids=ids, logprobs=lps, finish_reason=rb.FinishReason.LENGTH,
        weight_version="v0", prompt_tokens=3, top_logprobs=tops,
    )  # fmt: skip


def test_compare_accepts_a_first_difference_only_where_it_is_a_near_tie() -> None:
    # Position 1: got chose 7 (-0.6905) over 9 (-0.6910); want chose 9 (-0.6900) over 7 (-0.6950).
    got = _gen(
        (5, 7, 4), (-0.1, -0.6905, -2.0), (((5, -0.1), (6, -3.0)), ((7, -0.6905), (9, -0.6910)), ((4, -2.0), (1, -2.5)))
    )
    want = _gen(
        (5, 9, 8), (-0.1, -0.6900, -0.3), (((5, -0.1), (6, -3.0)), ((9, -0.6900), (7, -0.6950)), ((8, -0.3), (4, -2.0)))
    )
    assert compare([got], [want], what="t", tolerance=0.01, near_ties=True) == 0.0  # after the tie: not compared
    with pytest.raises(CheckFailed, match="differ at position 1"):
        compare([got], [want], what="t", tolerance=0.01)  # allowed only when asked for
    with pytest.raises(CheckFailed, match=r"token 9 \(logprob -0.69\) beat 7 \(-0.695\) by more than the tolerance"):
        compare([got], [want], what="t", tolerance=0.001, near_ties=True)
    not_listed = attrs.evolve(want, top_logprobs=(want.top_logprobs[0], ((9, -0.69), (3, -0.8)), want.top_logprobs[2]))
    with pytest.raises(CheckFailed, match="token 7 is not in the top 2"):
        compare([got], [not_listed], what="t", tolerance=0.01, near_ties=True)
    with pytest.raises(CheckFailed, match="no top_logprobs"):
        compare([got], [attrs.evolve(want, top_logprobs=None)], what="t", tolerance=0.01, near_ties=True)
    # Everything before the tie is still held to the tolerance.
    drifted = attrs.evolve(got, logprobs=(-0.2, -0.6905, -2.0))
    with pytest.raises(CheckFailed, match=re.escape("max |Δlogprob| 0.1 > tolerance 0.01")):
        compare([drifted], [want], what="t", tolerance=0.01, near_ties=True)
    shorter = _gen((5, 9), (-0.1, -0.69), want.top_logprobs[:2])
    with pytest.raises(CheckFailed, match="a length difference is not a near tie"):
        compare([shorter], [want], what="t", tolerance=0.01, near_ties=True)


async def test_retract_near_tie_allowance_holds_where_the_engine_is_not_batch_invariant(tmp_path: Path) -> None:
    """Declared not batch invariant, pause_retract asks top-2 logprobs and lets a near tie flip
    after the recompute; a flip by more than the tolerance still fails, and so does any flip on a
    batch-invariant engine (BUG_TO_CHECK)."""
    (c,) = select_checks(["pause_retract"])
    variant = attrs.evolve(FULL, batch_invariant=False)
    bug = frozenset({"retract_flips_token"})
    bad = await c(fake_factory(declare=variant, bugs=bug), fake_harness(tmp_path))
    assert bad.outcome is Outcome.FAIL and "not a near tie" in bad.message, bad.line()
    # The same flip within a (wide) tolerance is a near tie: accepted, and where it was recorded.
    wide = await c(fake_factory(declare=variant, bugs=bug), fake_harness(tmp_path, logprob_tolerance=50.0))
    assert wide.outcome is Outcome.PASS, wide.line()
    assert wide.measurements["near_tie_at"].startswith("case 0 at "), wide.measurements
    clean = await c(fake_factory(declare=variant), fake_harness(tmp_path))
    assert clean.outcome is Outcome.PASS and "near_tie_at" not in clean.measurements, clean.line()


async def test_pause_that_did_nothing_is_blamed_not_the_budget(tmp_path: Path) -> None:
    (c,) = select_checks(["pause_abort"])
    r = await c(fake_factory(bugs=frozenset({"pause_abort_noop"})), fake_harness(tmp_path))
    assert r.outcome is Outcome.FAIL, r.line()
    assert "in flight when pause(ABORT) was sent" in r.message and "did not abort it" in r.message
    assert "long_max_new_tokens" not in r.message
    # A request that was done before pause was sent: the harness's budget, an error (not a failure).
    short = await c(fake_factory(), fake_harness(tmp_path, long_max_new_tokens=2))
    assert short.outcome is Outcome.ERROR, short.line()
    assert "before pause(ABORT) was sent" in short.message and "raise Harness.long_max_new_tokens" in short.message


async def test_a_plain_exception_out_of_the_backend_is_a_failure() -> None:
    """A plain exception out of the adapter's own parsing (ValueError) is the backend's fault."""
    r = await check_greedy_shapes(fake_factory(bugs=frozenset({"generation_value_error"})))
    assert r.outcome is Outcome.FAIL, r.line()
    assert r.message.startswith("backend raised ValueError (not a RolloutBackendError)")
    # The same exception out of a harness hook (another object than the backend) stays an error.

    async def broken_oracle_factory() -> rb.RolloutBackend:
        raise ValueError("oracle path missing")

    harness = Harness(alt_weights_path="/alt", fresh_factory_on=lambda path: broken_oracle_factory)
    r = await check_disk_update_matches_fresh(fake_factory(), harness)
    assert r.outcome is Outcome.ERROR and "ValueError: oracle path missing" in r.message, r.line()


async def test_a_refused_request_with_unknown_limits_is_a_setup_error() -> None:
    """Nothing says the vocabulary size: a prompt id the backend refuses is the setup's problem."""
    blind = rb.Capabilities(pause_modes=[rb.PauseMode.RETRACT])
    r = await check_greedy_shapes(fake_factory(declare=blind), Harness(max_prompt_token=4096))
    assert r.outcome is Outcome.ERROR, r.line()
    assert r.message.startswith("setup: the backend refused a request the suite built")
    assert "the vocabulary size and the context length are unknown" in r.message and "--rb-vocab-size" in r.message
    # Known limits: the same refusal is the backend's failure.
    r = await check_greedy_shapes(fake_factory(declare=blind), Harness(vocab_size=4096, max_context=256))
    assert r.outcome is Outcome.FAIL and "InvalidRequest" in r.message, r.line()


async def test_declared_transport_that_raises_unsupported_fails() -> None:
    declared = rb.Capabilities(
        pause_modes=[rb.PauseMode.RETRACT], weight_transports=[rb.WeightTransport.DISTRIBUTED], vocab_size=64
    )

    class NullSender:
        def connect(self) -> None:
            return None

        def broadcast(self, named: Any) -> rb.WeightBucket:
            return rb.WeightBucket.from_named_tensors(named)

        def close(self) -> None:
            return None

    def make_sender(world_size: int) -> tuple[rb.WeightGroup, NullSender]:
        group = rb.WeightGroup(master_address="127.0.0.1", master_port=29500, world_size=world_size, backend="gloo")
        return group, NullSender()

    harness = Harness(
        alt_weights_path="/unused", fresh_factory_on=lambda p: fake_factory(), make_sender=make_sender
    ).replace(load_weights=lambda p: [])
    (c,) = select_checks(["distributed_update_matches_fresh"])
    result = await c(fake_factory(declare=declared), harness)
    assert result.outcome is Outcome.FAIL
    assert "Unsupported" in result.message and "distributed" in result.message


async def test_factory_failure_and_check_bug_are_errors_not_failures() -> None:
    async def broken() -> rb.RolloutBackend:
        raise OSError("engine binary missing")

    r = await check_greedy_shapes(broken)
    assert r.outcome is Outcome.ERROR and "factory failed" in r.message and "engine binary missing" in r.message

    @check("test", register=False)
    async def check_buggy(ctx: CheckContext) -> None:
        raise TypeError("bug in the check")

    r = await check_buggy(fake_factory())
    assert r.outcome is Outcome.ERROR and "TypeError: bug in the check" in r.message


async def test_hang_is_a_failure_and_the_backend_is_closed_and_resumed() -> None:
    made: list[FakeBackend] = []

    async def factory() -> FakeBackend:
        made.append(FakeBackend())
        return made[-1]

    @check("test", register=False)
    async def check_hangs(ctx: CheckContext) -> None:
        await ctx.backend.pause(rb.PauseMode.RETRACT)
        await ctx.backend.generate(ctx.request((1, 2, 3)))  # waits for a resume that never comes

    r = await check_hangs(factory, Harness(check_timeout_s=0.3))
    assert r.outcome is Outcome.FAIL and "timed out" in r.message
    assert made[0].closed
    assert (await made[0].health()).ready  # the runner resumed it


async def test_requires_decorator_order_and_combination() -> None:
    @requires(min_workers=3)
    @check("test", register=False)
    @requires(pause_mode=rb.PauseMode.IN_PLACE, hooks=("alt_weights_path",), methods=("no_such_method",))
    async def check_needs(ctx: CheckContext) -> None:
        raise AssertionError("must not run")

    r = await check_needs(fake_factory(declare=rb.Capabilities()))
    assert r.outcome is Outcome.SKIP
    for part in (
        "pause mode 'in_place' not declared",
        "harness hook 'alt_weights_path' not provided",
        "backend has no no_such_method()",
        "needs >= 3 workers",
    ):
        assert part in r.message
    r = await check_needs(fake_factory(workers=3), Harness(alt_weights_path="/x"))
    assert r.outcome is Outcome.SKIP and r.message == "backend has no no_such_method() (not part of the protocol)"


async def test_plain_assertion_and_skip_inside_a_check() -> None:
    @check("test", register=False)
    async def check_asserts(ctx: CheckContext) -> None:
        expect(1 == 2, "one is not two")

    @check("test", register=False)
    async def check_skips(ctx: CheckContext) -> None:
        ctx.measure("seen", 1)
        ctx.skip("not today")

    r = await check_asserts(fake_factory())
    assert r.outcome is Outcome.FAIL and r.message == "one is not two"
    r = await check_skips(fake_factory())
    assert r.outcome is Outcome.SKIP and r.message == "not today" and r.measurements == {"seen": 1}


def test_select_checks() -> None:
    names = [c.name for c in select_checks(["pause"])]
    assert names == [
        "pause_abort",
        "pause_retract",
        "pause_in_place",
        "resume_idempotent",
        "set_version_keeps_inflight",
    ]
    assert [c.name for c in select_checks(["reject_*"], exclude=["reject_empty_prompt"])] == [
        "reject_out_of_vocab",
        "reject_bad_max_new_tokens",
        "reject_prompt_too_long",
        "reject_unknown_sampling_key",
    ]
    assert select_checks([check_greedy_shapes, "greedy_shapes"]) == [check_greedy_shapes]
    with pytest.raises(ValueError, match="no check matches 'nope'"):
        select_checks(["nope"])


async def test_report_raise_for_failures(tmp_path: Path) -> None:
    report = await run_checks(
        fake_factory(bugs=frozenset({"positive_logprob"})),
        fake_harness(tmp_path),
        select=["greedy_shapes", "health_live_ready"],
    )
    assert not report.ok and [r.name for r in report.failed] == ["greedy_shapes"]
    assert [r.name for r in report.passed] == ["health_live_ready"]
    with pytest.raises(CheckFailed, match="greedy_shapes"):
        report.raise_for_failures()
    seen: list[str] = []
    await run_checks(fake_factory(), select=["finish_length"], on_result=lambda r: seen.append(r.name))
    assert seen == ["finish_length"]


async def test_a_single_check_is_a_plain_coroutine(tmp_path: Path) -> None:
    r = await check_disk_update_matches_fresh(fake_factory(), fake_harness(tmp_path))
    assert r.passed and r.measurements["max_abs_dlogprob"] == 0.0
    r = await run_check(check_disk_update_matches_fresh, fake_factory(), Harness())
    assert r.outcome is Outcome.SKIP


async def test_parity_between_backends() -> None:
    same = await check_parity({"a": fake_factory(1), "b": fake_factory(1)}, [(1, 2, 3), (4, 5, 6, 7)])
    assert same.ok and same.pairs[0].ids_equal and same.pairs[0].max_abs_dlogprob == 0.0
    assert [r.outcome for r in same.results()] == [Outcome.PASS]
    differ = await check_parity({"a": fake_factory(1), "b": fake_factory(2)}, [(1, 2, 3)])
    assert not differ.ok and differ.pairs[0].first_mismatch == (0, 0)
    assert differ.results()[0].outcome is Outcome.FAIL and "differ" in differ.results()[0].message
    noisy = await check_parity(
        {"a": fake_factory(1), "b": fake_factory(1, bugs=frozenset({"positive_logprob"}))}, [(1, 2, 3)]
    )
    assert noisy.pairs[0].ids_equal and not noisy.ok and noisy.pairs[0].max_abs_dlogprob > 0.5
    assert "parity of a, b" in noisy.summary()


def test_check_parity_needs_a_backend() -> None:
    with pytest.raises(ValueError):
        asyncio.run(check_parity({}))


async def test_abort_all_fails_when_every_request_drops_its_tokens(tmp_path: Path) -> None:
    (c,) = select_checks(["abort_all"])
    bug = frozenset({"abort_drops_tokens"})
    # Caught by timing (no streaming), a request the engine had not scheduled yet may keep no token,
    # but not all of them.
    timed = await c(fake_factory(bugs=bug, declare=attrs.evolve(FULL, streaming=False)), fake_harness(tmp_path))
    assert timed.outcome is Outcome.FAIL, timed.line()
    assert "every request aborted with no token kept" in timed.message
    # Streamed, each request had tokens out before abort_all(): the answer that drops them is refused.
    streamed = await c(fake_factory(bugs=bug), fake_harness(tmp_path))
    assert streamed.outcome is Outcome.FAIL and "ContractViolation" in streamed.message, streamed.line()


class _LateDriver(BuggyDriver):
    """A route that delivers one request (the second long one of abort_all) 0.6 s late: the race
    of a Dynamo frontend that received one of three concurrent requests 70 ms after the others."""

    LATE = "-long-3-"
    DELAY_S = 0.6

    async def generate(self, request: rb.GenerateRequest) -> rb.Generation:
        if self.LATE in request.request_id:
            await asyncio.sleep(self.DELAY_S)
        return await super().generate(request)

    async def stream(self, request: rb.GenerateRequest) -> AsyncGenerator[rb.TokenChunk, None]:
        if self.LATE in request.request_id:
            await asyncio.sleep(self.DELAY_S)
        async for chunk in super().stream(request):
            yield chunk


async def test_abort_all_waits_for_a_request_still_on_its_way(tmp_path: Path) -> None:
    """Streamed, abort_all() is sent once every request streamed a token: the late one is aborted
    too (a pass). Caught by timing, abort_all() is sent twice, but the late one arrives after both
    and runs to completion while the others were aborted: the check cannot tell that from
    abort_all() missing it, an error naming the knob (never a pass, never the backend's fault)."""
    (c,) = select_checks(["abort_all"])
    # The fake's context caps a long request at 242 tokens: at 5 ms a token (1.2 s) the others
    # still run when the late one streams its first token (at 0.6 s, within the 1 s the check
    # waits for first tokens); at the default 2 ms (0.5 s) they had finished on an idle machine.
    # Timed, abort_all() is sent at ~0.1 s and ~0.3 s: before the late one comes.
    harness = fake_harness(tmp_path, long_max_new_tokens=2000)
    streamed = await c(fake_factory(driver=_LateDriver, token_delay=0.005), harness)
    assert streamed.outcome is Outcome.PASS and streamed.measurements["seen_generating"] == 3, streamed.line()
    assert all(streamed.measurements[f"abort_all_{i}_tokens_kept"] >= 1 for i in range(3)), streamed.measurements
    not_streamed = attrs.evolve(FULL, streaming=False)
    timed = await c(fake_factory(driver=_LateDriver, declare=not_streamed, token_delay=0.005), harness)
    assert timed.outcome is Outcome.ERROR, timed.line()
    assert "request(s) [1] ran to completion while the others were aborted" in timed.message
    assert "raise Harness.progress_wait_s" in timed.message
    # Late by less than the second call waits: aborted, a pass.
    timed = await c(fake_factory(driver=_SlightlyLate, declare=not_streamed, token_delay=0.005), harness)
    assert timed.outcome is Outcome.PASS, timed.line()


class _SlightlyLate(_LateDriver):
    DELAY_S = 0.05


async def test_labels_are_checked_with_no_alt_weights_and_no_oracle(tmp_path: Path) -> None:
    """``labels_follow_weights`` needs the served checkpoint and a way to permute it, nothing else:
    it fails a label moved before its weights load and a stale label (the bug ``version_lag``,
    which the oracle checks catch only with alt weights and a fresh engine)."""
    bare = Harness(
        base_weights_path=write_checkpoint(tmp_path / "base", 1),
        permute_vocabulary=permute_checkpoint,
        wait_s=0.1,
    )
    for bug, words in (
        ("label_before_load", "the label moved before the weights loaded"),
        ("version_lag", "a stale label"),
    ):
        r = await check_labels_follow_weights(fake_factory(bugs=frozenset({bug})), bare)
        assert r.outcome is Outcome.FAIL and words in r.message, (bug, r.line())
    r = await check_labels_follow_weights(fake_factory(), bare)
    assert r.outcome is Outcome.PASS and r.measurements["answers_judged"] >= 6, r.line()
    # Without the checkpoint, or with one the harness cannot permute: a skip that says so.
    r = await check_labels_follow_weights(fake_factory(), Harness())
    assert r.outcome is Outcome.SKIP and r.gaps == (
        (
            Gap.WEIGHTS,
            "the served checkpoint is unknown (Capabilities.model_path and Harness.base_weights_path are None)",
        ),
    ), r.line()
    r = await check_labels_follow_weights(
        fake_factory(), bare.replace(permute_vocabulary=permute_safetensors_vocabulary)
    )
    assert r.outcome is Outcome.SKIP and "cannot derive weights from the served checkpoint" in r.message, r.line()
    assert "no config.json" in r.message


class _SharedServer(BuggyDriver):
    """An engine that outlives its clients (a long-lived server the factory connects to)."""

    async def aclose(self) -> None:
        return None


async def test_stale_prefix_probe_that_cannot_tell_skips(tmp_path: Path) -> None:
    """A shared server whose checkpoint nobody knows keeps the alt weights after the first mode's
    update: the later modes' updates change nothing, so the probe skips naming them (it passed
    with a "weak" note before)."""
    (c,) = select_checks(["stale_prefix_after_update"])
    server = [_SharedServer("fake-0", bugs=frozenset(), capabilities=FULL)]

    async def connect() -> FakeFleet:
        return FakeFleet(server, capabilities=FULL)

    unknown = fake_harness(tmp_path).replace(base_weights_path=None)
    r = await c(connect, unknown)
    assert r.outcome is Outcome.SKIP, r.line()
    assert "in pause mode(s) ['abort', 'in_place'] the update left the probes' outputs unchanged" in r.message
    server[0].seed = 1  # the served weights again; with the checkpoint known each mode loads them back
    r = await c(connect, fake_harness(tmp_path))
    assert r.outcome is Outcome.PASS, r.line()


async def test_random_tokens_skip_every_check_that_compares_tokens(tmp_path: Path) -> None:
    """A load simulator (``greedy_decoding=False``, as ``dynamo.mocker`` declares) is not failed for
    tokens no model chose: the checks that compare tokens skip, saying so."""
    mocker = attrs.evolve(FULL, greedy_decoding=False)
    report = await run_checks(fake_factory(declare=mocker), fake_harness(tmp_path), select=["sampling", "labels_*"])
    assert {r.outcome for r in report.results} == {Outcome.SKIP}, report.summary()
    assert all("capability greedy_decoding=True not declared" in r.message for r in report.results)


async def test_a_parameter_refused_as_unsupported_skips_with_the_refusal() -> None:
    class NoTopK(BuggyDriver):
        def _check(self, request: rb.GenerateRequest) -> None:
            if request.sampling.top_k != -1:
                raise rb.Unsupported("sampling.top_k", "this engine samples without top-k")
            super()._check(request)

    r = await check_top_k(fake_factory(driver=NoTopK))
    assert r.outcome is Outcome.SKIP, r.line()
    assert (
        r.message == "top_k=1: the backend refuses it (unsupported: sampling.top_k (this engine samples without top-k))"
    )


FILTERS = ("top_k", "top_p", "min_p")


@pytest.mark.parametrize(
    ("bug", "cause"),
    [
        ("filtered_logprobs_undeclared", "does not declare (Capabilities.filtered_logprobs)"),
        ("filtered_logprobs_unfiltered", "so filtered_logprobs is declared wrongly"),
    ],
)
async def test_filtered_logprobs_must_match_the_declaration(bug: str, cause: str, tmp_path: Path) -> None:
    """Logprobs renormalised after the filter (vLLM's processed_logprobs) where not declared, or
    unfiltered where declared: every filter check fails, naming the cause."""
    report = await run_checks(fake_factory(bugs=frozenset({bug})), fake_harness(tmp_path), select=list(FILTERS))
    for name in FILTERS:
        assert report[name].outcome is Outcome.FAIL, report[name].line()
        assert cause in report[name].message, report[name].line()


async def test_declared_filtered_logprobs_pass_where_they_are_0(tmp_path: Path) -> None:
    """The honest fake declaring filtered_logprobs answers 0 for the one token kept: the filter
    checks pass (measuring it), and the temperature and penalty checks are untouched (no filter)."""
    filtered = attrs.evolve(FULL, filtered_logprobs=True)
    select = [*FILTERS, "temperature", "repetition_penalty", "frequency_penalty", "presence_penalty"]
    report = await run_checks(fake_factory(declare=filtered), fake_harness(tmp_path), select=select)
    assert {r.outcome for r in report.results} == {Outcome.PASS}, report.summary()
    for name in FILTERS:
        assert report[name].measurements["max_abs_dlogprob_vs_kept"] == 0.0, report[name].line()


def test_a_filter_may_keep_tokens_tied_with_the_top() -> None:
    """An exact tie (bf16 logits) keeps two tokens: logprob -log 2 is the filtered answer there,
    and the runs may part at it; never where the greedy run's top logprobs show no tie."""
    from rollout_backends.conformance._sampling import _kept_only_the_top

    half = -0.6931
    tied = (((5, -0.1), (6, -3.0)), ((7, half), (9, half)), ((4, -2.0), (1, -2.5)))
    greedy = _gen((5, 7, 4), (-0.1, half, -2.0), tied)

    class Ctx:
        harness = Harness(logprob_tolerance=0.1)  # the GPU tier's

        def __init__(self) -> None:
            self.measurements: dict[str, Any] = {}

        def measure(self, key: str, value: Any) -> None:
            self.measurements[key] = value

        def skip(self, reason: str) -> NoReturn:
            raise SkipCheck(reason)

    ctx: Any = Ctx()
    _kept_only_the_top(ctx, [_gen((5, 7, 4), (0.0, half, 0.0), None)], [greedy], "t")
    _kept_only_the_top(ctx, [_gen((5, 9, 3), (0.0, 0.0, 0.0), None)], [greedy], "t")  # parted at the tie
    assert ctx.measurements["near_tie_at"] == "case 0 at 1 of 3"
    untied = attrs.evolve(greedy, top_logprobs=(tied[0], ((7, half), (9, -1.5)), tied[2]))
    with pytest.raises(CheckFailed, match=re.escape("case 0 position 1: sampled logprob -0.693, want 0 within 0.1")):
        _kept_only_the_top(ctx, [_gen((5, 7, 4), (0.0, half, 0.0), None)], [untied], "t")
    with pytest.raises(CheckFailed, match=re.escape("not a tie in the greedy run: token 9 is not within 0.1 of 7")):
        _kept_only_the_top(ctx, [_gen((5, 9, 3), (0.0, 0.0, 0.0), None)], [untied], "t")
    # No top logprobs (dynamo.vllm 1.4.2): a pick about one half likely may be a tie: a skip saying
    # so, never a pass; a sure pick cannot be one: a failure.
    unseen = attrs.evolve(greedy, top_logprobs=None)
    with pytest.raises(
        SkipCheck,
        match=re.escape("position 1 (got [5, 9, 3], want [5, 7, 4]), where the greedy pick had logprob -0.6931"),
    ):
        _kept_only_the_top(ctx, [_gen((5, 9, 3), (0.0, 0.0, 0.0), None)], [unseen], "t")
    with pytest.raises(CheckFailed, match=re.escape("the greedy pick had logprob -0.1, above log(1/2) + 0.1")):
        _kept_only_the_top(ctx, [_gen((6, 7, 4), (0.0, 0.0, 0.0), None)], [unseen], "t")


class _Buffered(BuggyDriver):
    """A stream whose chunks come when the request ends (Dynamo with our reference worker)."""

    async def stream(self, request: rb.GenerateRequest) -> AsyncGenerator[rb.TokenChunk, None]:
        chunks = [c async for c in super().stream(request)]
        for c in chunks:
            yield c


async def test_a_stream_that_is_not_live_cannot_show_the_abort_on_leaving_it(tmp_path: Path) -> None:
    """The first chunk of a buffered stream comes after the whole request: leaving the stream then
    proves nothing, a skip saying why (it passed before, after waiting for the whole request)."""
    (c,) = select_checks(["stream_early_exit_aborts"])
    r = await c(fake_factory(driver=_Buffered), fake_harness(tmp_path))
    assert r.outcome is Outcome.SKIP, r.line()
    assert "the stream does not deliver tokens as they come" in r.message, r.line()
    # abort_all waits for first tokens no longer than one takes (and then some): a request of 2.4 s
    # shows none by then, and is caught by timing (aborted twice).
    (c,) = select_checks(["abort_all"])
    r = await c(fake_factory(driver=_Buffered, token_delay=0.01), fake_harness(tmp_path))
    assert r.outcome is Outcome.PASS and r.measurements["seen_generating"] == 0, r.line()


class _OutOfVocab(BuggyDriver):
    """An engine whose last output id is past the vocabulary (what a load simulator's random ids are)."""

    async def generate(self, request: rb.GenerateRequest) -> rb.Generation:
        gen = await super().generate(request)
        return attrs.evolve(gen, output_ids=(*gen.output_ids[:-1], VOCAB + 7))


async def test_output_ids_are_held_to_the_vocabulary_where_tokens_come_from_a_model() -> None:
    """Every answer's ids must be in the declared vocabulary, unless the backend declares no model
    behind its tokens (``greedy_decoding=False``: the Dynamo mocker's ids are random in [1000, 2000)
    whatever the model's vocabulary, which it still declares: its frontend takes only the model's
    prompt ids)."""
    (c,) = select_checks(["finish_length"])
    r = await c(fake_factory(driver=_OutOfVocab))
    assert r.outcome is Outcome.FAIL and f"an output id is >= vocab size {VOCAB}" in r.message, r.line()
    simulator = attrs.evolve(FULL, greedy_decoding=False)
    r = await c(fake_factory(driver=_OutOfVocab, declare=simulator))
    assert r.outcome is Outcome.PASS, r.line()


class _Ctx:
    """What ``compare`` uses of a ``CheckContext``: ``measure`` and ``skip``."""

    def __init__(self) -> None:
        self.measurements: dict[str, Any] = {}

    def measure(self, key: str, value: Any) -> None:
        self.measurements[key] = value

    def skip(self, reason: str) -> None:
        raise SkipCheck(reason)


def test_compare_without_top_logprobs_skips_where_a_near_tie_is_possible_and_fails_where_not() -> None:
    # Position 1: got chose 7 at -0.70, want chose 9 at -0.69: both unsure, about as likely.
    got = _gen((5, 7, 4), (-0.1, -0.70, -2.0), None)
    want = _gen((5, 9, 8), (-0.1, -0.69, -0.3), None)
    with pytest.raises(SkipCheck, match=r"case 0 parts at position 1 of 3 .* cannot be told from a bug"):
        compare([got], [want], what="t", tolerance=0.1, ctx=_Ctx(), ties_unseen=True)  # type: ignore[arg-type]
    sure = _gen((5, 7, 4), (-0.1, -0.2, -2.0), None)  # 7 was picked at 0.82: no tie
    with pytest.raises(CheckFailed, match=r"token 7 was picked with logprob -0.2, above log\(1/2\)"):
        compare([sure], [want], what="t", tolerance=0.1, ctx=_Ctx(), ties_unseen=True)  # type: ignore[arg-type]
    apart = _gen((5, 7, 4), (-0.1, -1.5, -2.0), None)  # 7 at -1.5 vs 9 at -0.69: not the same chance
    with pytest.raises(CheckFailed, match="differ by more than the tolerance"):
        compare([apart], [want], what="t", tolerance=0.1, ctx=_Ctx(), ties_unseen=True)  # type: ignore[arg-type]


async def test_pause_retract_without_top_logprobs_still_fails_a_flipped_token(tmp_path: Path) -> None:
    """The ``retract_flips_token`` engine (the second most likely token after a resume), on a backend
    that is not batch invariant and has no top logprobs: failed (where the flip could be a near tie
    it would skip with the reason: never a pass). The honest one passes."""
    (c,) = select_checks(["pause_retract"])
    no_top = attrs.evolve(FULL, top_logprobs=0, batch_invariant=False)
    bad = await c(fake_factory(bugs=frozenset({"retract_flips_token"}), declare=no_top), fake_harness(tmp_path))
    # The fake's flip takes a token less likely by more than the tolerance (deterministic here).
    assert bad.outcome is Outcome.FAIL and "not a near tie" in bad.message, bad.line()
    good = await c(fake_factory(declare=no_top), fake_harness(tmp_path))
    assert good.outcome is Outcome.PASS, good.line()


def test_compare_without_a_context_never_lets_a_possible_tie_pass() -> None:
    got = _gen((5, 7, 4), (-0.1, -0.70, -2.0), None)
    want = _gen((5, 9, 8), (-0.1, -0.69, -0.3), None)
    with pytest.raises(CheckFailed, match="no check context to skip through"):
        compare([got], [want], what="t", tolerance=0.1, ties_unseen=True)


async def test_min_p_ignored_still_fails_without_top_logprobs(tmp_path: Path) -> None:
    """min_p skips (never passes) where a first difference could be a tie and no top logprobs can
    tell; a backend that ignores min_p still fails where a sampled pick is far from the greedy one."""
    (c,) = select_checks(["min_p"])
    no_top = attrs.evolve(FULL, top_logprobs=0, batch_invariant=False)
    bad = await c(fake_factory(bugs=frozenset({"min_p_ignored"}), declare=no_top), fake_harness(tmp_path))
    assert bad.outcome is Outcome.FAIL, bad.line()
    good = await c(fake_factory(declare=no_top), fake_harness(tmp_path))
    assert good.outcome is Outcome.PASS, good.line()
