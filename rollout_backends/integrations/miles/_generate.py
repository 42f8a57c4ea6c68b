"""The custom generate function: ``--custom-generate-function-path rollout_backends.integrations.miles.generate``.

It is Miles' single-turn generate (``miles/rollout/generate_hub/single_turn.py`` at radixark/miles
``31f1ca961a94``) with the HTTP ``POST /generate`` replaced by ``backend.generate``: the prompt,
partial-rollout resume, budget and routing-key rules are Miles', and the sample is filled exactly as
``update_sample_from_response`` + ``Sample.update_from_meta_info`` fill it from SGLang's response.

Miles is not imported: ``input`` (Miles' ``GenerateFnInput``) and its ``Sample`` are duck-typed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import attrs

from rollout_backends import (
    BackendUnavailable,
    FinishReason,
    GenerateRequest,
    Generation,
    InvalidRequest,
    RolloutBackend,
    TransientError,
    Unsupported,
)
from rollout_backends.sglang_native import ParseRules, decode_text, meta_info, parse_sampling

from ._config import add_arguments, get_backend

__all__ = ["GenerateOutput", "apply_generation", "generate", "prompt_ids_from_sample", "served_versions"]

logger = logging.getLogger(__name__)

#: Miles' ``post()`` sleeps 1 s between retries.
RETRY_INTERVAL_S = 1.0


@attrs.define
class GenerateOutput:
    """Stands in for Miles' ``GenerateFnOutput`` when Miles is not importable (Miles reads ``.samples``)."""

    samples: Any


def _output(sample: Any) -> Any:
    try:
        from miles.rollout.base_types import GenerateFnOutput  # type: ignore[import-not-found]
    except ImportError:
        return GenerateOutput(samples=sample)
    return GenerateFnOutput(samples=sample)


def prompt_ids_from_sample(state: Any, sample: Any) -> list[int]:
    """Miles' ``compute_prompt_ids_from_sample`` for text prompts (multimodal is refused)."""
    mm = getattr(sample, "multimodal_inputs", None)
    if getattr(state, "processor", None) and mm and any(v is not None for v in mm.values()):
        raise InvalidRequest("sample.multimodal_inputs", "multimodal prompts are not supported by the rollout backends")
    prompt = sample.prompt
    if not isinstance(prompt, str):
        prompt = state.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, tools=None)
    return list(state.tokenizer.encode(prompt, add_special_tokens=False))


def _check_supported(args: Any) -> None:
    """Payload features Miles may ask for that the protocol cannot deliver: refuse, never drop."""
    if getattr(args, "use_rollout_routing_replay", False):
        raise Unsupported("routed_experts", "--use-rollout-routing-replay needs SGLang's routed experts")
    if getattr(args, "use_rollout_indexer_replay", False):
        raise Unsupported("indexer_topk", "--use-rollout-indexer-replay needs SGLang's indexer top-k")
    lora = getattr(args, "lora_rank", 0) > 0 or getattr(args, "lora_adapter_path", None) is not None
    if lora and not getattr(args, "lora_train_only", False):
        raise Unsupported("lora", "rollout-side LoRA is not part of the protocol")


def _routing_key(args: Any, sample: Any) -> str | None:
    """Miles' ``compute_routing_headers``: the key is required under consistent_hashing/manual."""
    key = getattr(sample, "routing_key", None)
    policy = getattr(args, "sglang_router_policy", None)
    if policy in ("consistent_hashing", "manual") and not key:
        raise ValueError(
            f"router policy {policy} routes by X-SMG-Routing-Key, "
            f"but sample (index={getattr(sample, 'index', None)}) has no routing_key set"
        )
    return key or None


async def _generate(backend: RolloutBackend, request: GenerateRequest, retries: int) -> Generation:
    attempt = 0
    while True:
        try:
            return await backend.generate(request)
        except (TransientError, BackendUnavailable) as exc:
            # Safe to resend: TransientError is raised only when no token can have been produced,
            # and BackendUnavailable returned nothing. Miles' post() retries any failure likewise.
            attempt += 1
            if attempt > retries:
                raise
            logger.info("generate %s failed (%s), retry %d/%d", request.request_id, exc, attempt, retries)
            await asyncio.sleep(RETRY_INTERVAL_S)


def _update_from_meta_info(args: Any, sample: Any, meta: Mapping[str, Any]) -> None:
    """``Sample.update_from_meta_info`` for samples without the method (duck-typed stand-ins)."""
    if getattr(args, "sglang_speculative_algorithm", None):
        spec = sample.spec_info
        spec.spec_accept_token_num += meta.get("spec_accept_token_num", 0)
        spec.spec_draft_token_num += meta.get("spec_draft_token_num", 0)
        spec.spec_verify_ct += meta.get("spec_verify_ct", 0)
        spec.completion_token_num += meta.get("completion_tokens", 0)
    sample.prefix_cache_info.cached_tokens += meta.get("cached_tokens", 0)
    sample.prefix_cache_info.total_prompt_tokens += meta.get("prompt_tokens", 0)
    status = type(sample).Status
    sample.status = {
        "length": status.TRUNCATED,
        "abort": status.ABORTED,
        "stop": status.COMPLETED,
    }[meta["finish_reason"]["type"]]


def apply_generation(args: Any, sample: Any, *, input_ids: list[int], gen: Generation, text: str) -> None:
    """Fill ``sample`` from ``gen`` as Miles' ``update_sample_from_response`` fills it from SGLang."""
    if gen.logprobs is None:
        raise Unsupported("logprobs", "Miles takes the response tokens and rollout logprobs from the logprobs")
    if len(sample.response) == 0 and not sample.tokens:
        sample.tokens = list(input_ids)
    new_tokens = list(gen.output_ids)
    sample.tokens = sample.tokens + new_tokens
    sample.response_length += len(new_tokens)
    sample.response += text
    if sample.rollout_log_probs is None:
        sample.rollout_log_probs = []
    sample.rollout_log_probs += list(gen.logprobs)
    # Miles sets these from the response on every turn; the protocol carries neither.
    sample.rollout_routed_experts = None
    sample.rollout_indexer_topk = None
    meta = meta_info(gen, return_logprob=True)
    meta.pop("weight_version", None)  # recorded below, split where the generation spanned an update
    update = getattr(sample, "update_from_meta_info", None)
    if callable(update):
        update(args, meta)
    else:
        _update_from_meta_info(args, sample, meta)
    sample.weight_versions.extend(served_versions(gen))


def served_versions(gen: Generation) -> list[str]:
    """Every version that served ``gen``, in order, each once per run: the one it started under, then
    each run of its tokens (``version_spans``), else the one at its end.

    Miles records one entry in ``Sample.weight_versions`` per generation call (``update_from_meta_info``
    in ``miles/utils/types.py`` at 31f1ca961a94), so a sample that an abort-mode pause cut and partial
    rollout resumed under the next version holds both. A call that spanned an in-place or retract
    update is recorded the same way, one entry per version, rather than under its end alone: Miles'
    ``oldest_weight_version`` (the staleness it reports) and ``mixed_version`` metric then see it."""
    runs = [gen.version_at_start, *(v for _, v in gen.version_spans or ()), gen.weight_version]
    out: list[str] = []
    for v in runs:
        if v is not None and (not out or out[-1] != v):
            out.append(v)
    return out


async def generate(input: Any) -> Any:
    """Miles' generate-function contract: ``GenerateFnInput`` in, ``GenerateFnOutput`` out."""
    args = input.args
    sample = input.sample
    sampling_params = dict(input.sampling_params)
    status = type(sample).Status
    if sample.status not in {status.PENDING, status.ABORTED}:
        raise ValueError(f"sample.status={sample.status!r}: only PENDING or ABORTED samples are generated")

    prompt_ids = prompt_ids_from_sample(input.state, sample)
    if len(sample.response) > 0:  # partial rollout: resume from the tokens so far
        input_ids = list(sample.tokens)
        sampling_params["max_new_tokens"] -= len(sample.tokens) - len(prompt_ids)
        if sampling_params["max_new_tokens"] < 0:
            raise ValueError(f"negative budget resuming sample {getattr(sample, 'index', None)}")
        if sampling_params["max_new_tokens"] == 0:
            sample.status = status.TRUNCATED
            return _output(sample)
    else:
        input_ids = prompt_ids

    # Miles' compute_request_payload: the budget, clamped to the context.
    max_new_tokens = sampling_params.pop("max_new_tokens", getattr(args, "rollout_max_response_len", None))
    if x := getattr(args, "rollout_max_context_len", None):
        max_new_tokens = min(max_new_tokens, x - len(input_ids))
    if max_new_tokens <= 0:
        sample.status = status.TRUNCATED
        return _output(sample)
    _check_supported(args)
    if (getattr(sample, "multimodal_inputs", None) or {}).get("images"):
        raise InvalidRequest("sample.multimodal_inputs", "images are not supported by the rollout backends")
    backend = await get_backend(args)
    # --rollout-stop strings go to a backend that matches them (else refused, naming the field).
    rules = ParseRules(stop_strings=backend.capabilities.stop_strings)
    sampling, text_opts = parse_sampling({**sampling_params, "max_new_tokens": max_new_tokens}, rules=rules)
    assert sampling is not None  # max_new_tokens > 0: not a prefill
    request = GenerateRequest(
        input_ids=input_ids,
        sampling=sampling,
        return_logprobs=True,
        routing_key=_routing_key(args, sample),
    )
    gen = await _generate(backend, request, int(getattr(args, "rollout_backend_max_retries", 60)))
    if gen.finish_reason is FinishReason.ABORT:
        logger.debug("sample %s aborted after %d tokens", getattr(sample, "index", None), len(gen.output_ids))
    text = decode_text(input.state.tokenizer, gen, text_opts)
    apply_generation(args, sample, input_ids=input_ids, gen=gen, text=text)
    return _output(sample)


# Miles' add_user_provided_function_arguments calls ``<generate fn>.add_arguments(parser)``.
generate.add_arguments = add_arguments  # type: ignore[attr-defined]
