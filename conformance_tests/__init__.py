"""The conformance suite (``rollout_backends.conformance``): checks any backend can be run through.

Plain async functions, no pytest needed (trio.testing style)::

    import rollout_backends as rb
    from rollout_backends.conformance import Harness, run_checks, check_greedy_shapes

    factory = lambda: rb.open_backend("sglang://127.0.0.1:30000")
    result = await check_greedy_shapes(factory)               # one check -> CheckResult
    report = await run_checks(factory, Harness(alt_weights_path="/ckpt/other"))
    print(report.summary()); report.raise_for_failures()

Each check declares what it requires (``@requires(pause_mode=PauseMode.IN_PLACE)``, a harness
hook, ...). Undeclared capabilities and missing hooks are skips; a declared capability that
misbehaves is a failure. ``check_parity`` compares backends (and transformers) with each other.
With pytest: ``pytest --pyargs rollout_backends.conformance --rb-backend URL``. See
``docs/conformance.md``.
"""

from typing import Any

from ._contract import (
    check_concurrent_equals_sequential,
    check_concurrent_requests_complete,
    check_continuation_consistent,
    check_finish_length,
    check_finish_stop_token,
    check_generate_group,
    check_greedy_logprob_bound,
    check_greedy_repeatable,
    check_greedy_shapes,
    check_ignore_eos,
    check_max_new_tokens,
    check_seeded_sampling,
)
from ._control import (
    check_abort_all,
    check_abort_one,
    check_pause_abort,
    check_pause_in_place,
    check_pause_retract,
    check_resume_idempotent,
    check_set_version_keeps_inflight,
)
from ._core import (
    ALL_CHECKS,
    Check,
    CheckContext,
    CheckFailed,
    CheckResult,
    Gap,
    HarnessError,
    Outcome,
    Report,
    Requirement,
    SkipCheck,
    check,
    compare,
    expect,
    requires,
    run_check,
    run_checks,
    select_checks,
    validate_generation,
)
from ._harness import BackendFactory, Harness, WeightSender, load_safetensors_dir, permute_safetensors_vocabulary
from ._health import (
    check_health_live_ready,
    check_health_paused_not_ready,
    check_health_progress_probe,
    check_reject_bad_max_new_tokens,
    check_reject_empty_prompt,
    check_reject_out_of_vocab,
    check_reject_prompt_too_long,
    check_reject_unknown_sampling_key,
    check_staleness_visible,
)
from ._labels import check_labels_follow_weights
from ._logprobs import check_prompt_logprobs_rescore, check_stop_strings, check_top_logprobs
from ._parity import (
    HFParity,
    PairParity,
    ParityReport,
    check_hf_logprob_parity,
    check_parity,
    default_parity_prompts,
    hf_logprobs,
    pair_parity,
)
from ._sampling import (
    check_frequency_penalty,
    check_min_new_tokens,
    check_min_p,
    check_presence_penalty,
    check_repetition_penalty,
    check_temperature,
    check_top_k,
    check_top_p,
)
from ._streaming import check_stream_early_exit_aborts, check_stream_matches_generate
from ._versions import (
    check_min_version_after_partial_update,
    check_stream_version_spans_across_in_place_update,
    check_stream_version_spans_across_update,
    check_unknown_exact_version_is_retryable,
    check_version_spans_across_in_place_update,
    check_version_spans_across_update,
    check_version_spans_quiet,
)
from ._weights import (
    check_disk_update_matches_fresh,
    check_distributed_update_matches_fresh,
    check_injected_failure_rolls_back,
    check_memory_release_resume,
    check_stale_prefix_after_update,
    check_tensor_update_matches_fresh,
    check_update_failure_keeps_version,
)

__all__ = [
    "ALL_CHECKS",
    "BackendFactory",
    "Check",
    "CheckContext",
    "CheckFailed",
    "CheckResult",
    "Gap",
    "HFParity",
    "Harness",
    "HarnessError",
    "Outcome",
    "PairParity",
    "ParityReport",
    "Report",
    "Requirement",
    "SkipCheck",
    "WeightSender",
    "check",
    "check_abort_all",
    "check_abort_one",
    "check_concurrent_equals_sequential",
    "check_concurrent_requests_complete",
    "check_continuation_consistent",
    "check_disk_update_matches_fresh",
    "check_distributed_update_matches_fresh",
    "check_finish_length",
    "check_finish_stop_token",
    "check_frequency_penalty",
    "check_generate_group",
    "check_greedy_logprob_bound",
    "check_greedy_repeatable",
    "check_greedy_shapes",
    "check_health_live_ready",
    "check_health_paused_not_ready",
    "check_health_progress_probe",
    "check_hf_logprob_parity",
    "check_ignore_eos",
    "check_injected_failure_rolls_back",
    "check_labels_follow_weights",
    "check_max_new_tokens",
    "check_memory_release_resume",
    "check_min_new_tokens",
    "check_min_p",
    "check_min_version_after_partial_update",
    "check_parity",
    "check_pause_abort",
    "check_pause_in_place",
    "check_pause_retract",
    "check_presence_penalty",
    "check_prompt_logprobs_rescore",
    "check_reject_bad_max_new_tokens",
    "check_reject_empty_prompt",
    "check_reject_out_of_vocab",
    "check_reject_prompt_too_long",
    "check_reject_unknown_sampling_key",
    "check_repetition_penalty",
    "check_resume_idempotent",
    "check_seeded_sampling",
    "check_set_version_keeps_inflight",
    "check_stale_prefix_after_update",
    "check_stop_strings",
    "check_stream_early_exit_aborts",
    "check_stream_matches_generate",
    "check_staleness_visible",
    "check_temperature",
    "check_tensor_update_matches_fresh",
    "check_top_k",
    "check_top_logprobs",
    "check_top_p",
    "check_unknown_exact_version_is_retryable",
    "check_stream_version_spans_across_in_place_update",
    "check_stream_version_spans_across_update",
    "check_version_spans_across_in_place_update",
    "check_version_spans_across_update",
    "check_version_spans_quiet",
    "check_update_failure_keeps_version",
    "compare",
    "default_parity_prompts",
    "expect",
    "hf_logprobs",
    "load_safetensors_dir",
    "pair_parity",
    "permute_safetensors_vocabulary",
    "prompts",
    "requires",
    "run_check",
    "run_checks",
    "sampling_params",
    "select_checks",
    "validate_generation",
]


def __getattr__(name: str) -> Any:
    # The hypothesis strategies import hypothesis, which only test environments have.
    if name in ("prompts", "sampling_params"):
        from . import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
