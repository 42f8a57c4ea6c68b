"""Stand-ins for Miles' objects, and Miles' own single-turn logic re-stated as a test oracle.

Field names are copied from radixark/miles ``31f1ca961a94``: ``miles/utils/types.py`` (``Sample``),
``miles/rollout/base_types.py`` (``GenerateFnInput``). The oracle functions restate, independently of
``rollout_backends.integrations.miles``, what Miles does with SGLang's HTTP answers:
``compute_sampling_params`` (inference_rollout_common.py), ``compute_request_payload``,
``compute_routing_headers`` and ``update_sample_from_response`` (generate_endpoint_utils.py),
``Sample.update_from_meta_info`` (types.py), ``get_worker_urls`` + ``router_worker_base_urls``
(inference_rollout_train.py, http_utils.py) and ``extract_completion`` (rollout/session/core.py).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# Miles' session-server check of a chat answer lives with the session stand-in (bench), one copy.
from rb_bench.miles_session import extract_completion as extract_completion


@dataclass
class SpecInfo:
    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0


@dataclass
class PrefixCacheInfo:
    cached_tokens: int = 0
    total_prompt_tokens: int = 0


class Status(Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class BareSample:
    """Miles' ``Sample`` fields, in Miles' order, without its methods."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    rollout_indexer_topk: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    opd_reverse_kl: list[float] | None = None

    Status = Status
    status: Status = Status.PENDING

    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    adapter: Any = None
    reward_spec: Any = None
    routing_key: str | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)


@dataclass
class Sample(BareSample):
    """With Miles' ``update_from_meta_info`` (the real Sample has it; the generate function calls it)."""

    def update_from_meta_info(self, args: Any, meta_info: dict[str, Any]) -> None:
        oracle_update_from_meta_info(args, self, meta_info)


def sample_fields(sample: Any) -> dict[str, Any]:
    return {f.name: copy.deepcopy(getattr(sample, f.name)) for f in dataclasses.fields(BareSample)}


@dataclass
class GenerateState:
    args: Any
    tokenizer: Any
    processor: Any = None
    sampling_params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateFnInput:
    state: GenerateState
    sample: Any
    sampling_params: dict[str, Any]
    evaluation: bool

    @property
    def args(self) -> Any:
        return self.state.args


def make_args(**overrides: Any) -> argparse.Namespace:
    """Miles' defaults for every ``args`` attribute the single-turn path and the integration read."""
    base: dict[str, Any] = {
        "sglang_router_ip": "127.0.0.1",
        "sglang_router_port": 1,
        "sglang_router_policy": None,
        "rollout_max_response_len": 64,
        "rollout_max_context_len": None,
        "rollout_temperature": 1.0,
        "rollout_top_p": 1.0,
        "rollout_top_k": -1,
        "rollout_stop": None,
        "rollout_stop_token_ids": None,
        "rollout_skip_special_tokens": False,
        "rollout_seed": 42,
        "use_rollout_routing_replay": False,
        "use_rollout_indexer_replay": False,
        "sglang_speculative_algorithm": None,
        "sglang_enable_deterministic_inference": False,
        "lora_rank": 0,
        "lora_adapter_path": None,
        "rollout_backend": "sglang",
        "rollout_backend_url": None,
        "rollout_backend_max_retries": 2,
        "rollout_num_gpus_per_engine": 1,
        "num_gpus_per_node": 8,
    }
    base.update(overrides)
    return argparse.Namespace(**base)


# -- the oracle: Miles' logic, restated ---------------------------------------------------------


def compute_sampling_params(args: Any) -> dict[str, Any]:
    return dict(
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        top_k=args.rollout_top_k,
        max_new_tokens=args.rollout_max_response_len,
        stop=args.rollout_stop,
        stop_token_ids=args.rollout_stop_token_ids,
        skip_special_tokens=args.rollout_skip_special_tokens,
        no_stop_trim=True,
        spaces_between_special_tokens=False,
    )


def compute_request_payload(args: Any, input_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any] | None:
    sampling_params = copy.deepcopy(sampling_params)
    max_new_tokens = sampling_params.pop("max_new_tokens", args.rollout_max_response_len)
    if x := args.rollout_max_context_len:
        max_new_tokens = min(max_new_tokens, x - len(input_ids))
    if max_new_tokens <= 0:
        return None
    return {
        "input_ids": input_ids,
        "sampling_params": {**sampling_params, "max_new_tokens": max_new_tokens},
        "return_logprob": True,
        "return_routed_experts": args.use_rollout_routing_replay,
        "return_indexer_topk": args.use_rollout_indexer_replay,
    }


def compute_routing_headers(sample: Any) -> dict[str, str] | None:
    return {"X-SMG-Routing-Key": sample.routing_key} if sample.routing_key else None


def oracle_update_from_meta_info(args: Any, sample: Any, meta_info: dict[str, Any]) -> None:
    if args.sglang_speculative_algorithm:
        sample.spec_info.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
        sample.spec_info.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
        sample.spec_info.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
        sample.spec_info.completion_token_num += meta_info.get("completion_tokens", 0)
    sample.prefix_cache_info.cached_tokens += meta_info.get("cached_tokens", 0)
    sample.prefix_cache_info.total_prompt_tokens += meta_info.get("prompt_tokens", 0)
    if "weight_version" in meta_info:
        sample.weight_versions.append(meta_info["weight_version"])
    match meta_info["finish_reason"]["type"]:
        case "length":
            sample.status = Status.TRUNCATED
        case "abort":
            sample.status = Status.ABORTED
        case "stop":
            sample.status = Status.COMPLETED


def oracle_update_sample_from_response(args: Any, sample: Any, payload: dict[str, Any], output: dict[str, Any]) -> None:
    if (len(sample.response) == 0) and not sample.tokens:
        sample.tokens = payload["input_ids"]
    if x := output["meta_info"].get("output_token_logprobs"):
        new_tokens = [item[1] for item in x]
        new_log_probs = [item[0] for item in x]
    else:
        new_tokens, new_log_probs = [], []
    sample.tokens = sample.tokens + new_tokens
    sample.response_length += len(new_tokens)
    sample.response += output["text"]
    if sample.rollout_log_probs is None:
        sample.rollout_log_probs = []
    sample.rollout_log_probs += new_log_probs
    sample.rollout_routed_experts = None if output["meta_info"].get("routed_experts") is None else "decoded"
    sample.rollout_indexer_topk = None if output["meta_info"].get("indexer_topk") is None else "decoded"
    oracle_update_from_meta_info(args, sample, output["meta_info"])


def worker_base_urls(response: dict[str, Any], *, list_workers: bool) -> list[str]:
    """``get_worker_urls`` on a ``/list_workers`` or ``/workers`` answer, then ``router_worker_base_urls``."""
    urls = response["urls"] if list_workers else [w["url"] for w in response["workers"]]
    bases: list[str] = []
    for url in urls:
        base, sep, rank = url.rpartition("@")
        if sep and rank.isdigit():
            url = base
        if url not in bases:
            bases.append(url)
    return bases
