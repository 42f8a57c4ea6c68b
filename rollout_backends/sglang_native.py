"""SGLang's native HTTP protocol, both directions, in one pure module (no I/O, no state).

Everything that speaks SGLang's ``/generate`` uses it: the SGLang wire (client), the Dynamo wire's
native path (client), the reference server, the Miles facade and our Dynamo worker (servers).

* :func:`request_body` / :func:`sampling_params_body`: ``GenerateRequest`` -> the JSON body.
* :func:`parse_request` / :func:`parse_sampling`: a JSON body -> ``GenerateRequest`` under one
  strictness rule (:class:`ParseRules`): every field's JSON type (a string is not a bool, a bool is
  not an int), its range (integers fit a signed 64-bit integer, token ids fit the vocabulary),
  sizes, nesting depth, and keys: a key we cannot honour is refused while set, an unknown key is
  refused naming it as the caller spelled it. ``UnknownKeys.IGNORE`` keeps SGLang's own rule
  (unknown top-level keys ignored; unknown ``sampling_params`` keys are refused by SGLang too).
  Every refusal is an ``InvalidRequest`` whose ``field`` is the caller's spelling
  (``sampling_params.sampling_seed``, ``input_ids[3]``, ``rid``).
* :func:`answer_body` / :func:`parse_answer`: ``Generation`` <-> SGLang's answer (one abort
  message, one set of optional fields).
* :func:`error_body` / :func:`error_message` / :func:`error_field`: SGLang's error bodies, and the
  field a refusal names, in our spelling; :func:`named_field` the same through a channel that
  carries only a message.
* control bodies both ways: ``disk_body`` / :func:`parse_disk_body` and the like (the SGLang and
  Dynamo wires build them, the facade parses them).
* :data:`ADMIN_ROUTES`: the routes that take SGLang's admin key.

Shapes are SGLang 0.5.16's (0.5.23's where they differ), read from ``GenerateReqInput`` and the
``sampling_params`` schema gate (``python/sglang/srt/managers/io_struct.py``,
``python/sglang/api/v1/api_types.py``).
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Mapping, Sequence
from operator import countOf
from typing import Any

import attrs

from rollout_backends._errors import ContractViolation, InvalidRequest
from rollout_backends._ops import (
    AbortAll,
    AbortRequest,
    DestroyWeightGroup,
    InitWeightGroup,
    Pause,
    SetVersion,
    UpdateFromDisk,
    UpdateFromDistributed,
    UpdateFromTensors,
)
from rollout_backends._types import (
    MAX_TOP_LOGPROBS,
    FinishReason,
    GenerateRequest,
    Generation,
    MemoryTag,
    PauseMode,
    SamplingParams,
    TensorSpec,
    TokenChunk,
    WeightBucket,
    WeightGroup,
)

__all__ = [
    "disk_body",
    "distributed_body",
    "init_group_body",
    "memory_body",
    "parse_abort_body",
    "parse_destroy_group_body",
    "parse_disk_body",
    "parse_distributed_body",
    "parse_init_group_body",
    "parse_memory_body",
    "parse_pause_body",
    "parse_set_version_body",
    "parse_tensors_body",
    "parse_stream_event",
    "set_version_body",
    "tensors_body",
    "ABORT_MESSAGE",
    "ADMIN_ROUTES",
    "ROUTING_KEY_HEADER",
    "SAMPLING_PARAM_KEYS",
    "NativeRequest",
    "ParseRules",
    "StopStrings",
    "TensorsBody",
    "TextOptions",
    "UnknownKeys",
    "BATCH_LIST_KEYS",
    "answer_body",
    "batch_field",
    "check_depth",
    "decode_text",
    "trim_at_stop",
    "error_body",
    "error_field",
    "error_message",
    "finish_reason_body",
    "meta_info",
    "named_field",
    "native_field",
    "our_field",
    "parse_answer",
    "parse_request",
    "parse_sampling",
    "request_body",
    "sampling_params_body",
    "split_batch",
]

#: The header smg's consistent-hashing policy routes on (Miles sends it; harmless elsewhere).
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"

#: ``meta_info.finish_reason.message`` of an aborted request (SGLang's ``/abort_request`` text).
ABORT_MESSAGE = "Abort request."

#: SGLang's admin routes (``ADMIN_OPTIONAL`` in ``http_server.py``): with ``--admin-api-key`` set they
#: take only that key, else the API key.
ADMIN_ROUTES: frozenset[str] = frozenset(
    {
        "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache", "/update_weight_version",
        "/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
        "/update_weights_from_distributed", "/destroy_weights_update_group", "/begin_weight_update",
        "/end_weight_update", "/release_memory_occupation", "/resume_memory_occupation", "/weights_checker",
        "/pull_weights", "/load_lora_adapter", "/load_lora_adapter_from_tensors",
        "/load_lora_adapter_from_distributed", "/unload_lora_adapter",
    }
)  # fmt: skip

#: The ``sampling_params`` keys SGLang accepts (``_FIELDS_SamplingParams`` of 0.5.23, plus 0.5.16's
#: ``watermark``); SGLang refuses any other with a 400, and so do we, in either mode.
SAMPLING_PARAM_KEYS: tuple[str, ...] = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_regex", "stop_token_ids",
    "ignore_eos", "min_new_tokens", "n", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "sampling_seed", "logit_bias", "json_schema",
    "regex", "ebnf", "structural_tag", "choice", "stream_interval", "custom_params", "beam_width", "watermark",
)  # fmt: skip

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
#: SGLang rewrites ``0 <= temperature < 1e-6`` to greedy (``sampling_params.py``).
_GREEDY_EPS = 1e-6
#: ``SamplingParams`` field -> SGLang's ``sampling_params`` key, where they differ.
_OURS_TO_NATIVE = {"seed": "sampling_seed"}
_NATIVE_TO_OURS = {v: k for k, v in _OURS_TO_NATIVE.items()}
#: ``GenerateRequest`` fields -> SGLang's top-level keys, where they differ.
_TOP_OURS_TO_NATIVE = {
    "request_id": "rid",
    "return_logprobs": "return_logprob",
    "sampling": "sampling_params",
    "prompt_logprobs_start": "logprob_start_len",
}
_TOP_NATIVE_TO_OURS = {v: k for k, v in _TOP_OURS_TO_NATIVE.items()}
#: ``SamplingParams`` fields SGLang carries at the top level of the body, not in ``sampling_params``.
_SAMPLING_AT_TOP = {"top_logprobs": "top_logprobs_num"}
_TOP_AT_SAMPLING = {v: k for k, v in _SAMPLING_AT_TOP.items()}


class UnknownKeys(enum.Enum):
    """What :func:`parse_request` does with a top-level key SGLang does not define."""

    REFUSE = "refuse"  #: an ``InvalidRequest`` naming it (a typo such as ``return_logprobs`` is caught)
    IGNORE = "ignore"  #: SGLang's own rule: dropped (for clients that send extra keys)


@attrs.frozen(slots=True, kw_only=True)
class ParseRules:
    """The server's side of the strictness rule: its limits and what it can honour."""

    unknown_keys: UnknownKeys = UnknownKeys.REFUSE
    #: Token ids (prompt and ``stop_token_ids``) must be below it, where known.
    vocab_size: int | None = None
    #: SGLang's context rule, where known: ``len(input_ids) < max_context`` and
    #: ``len(input_ids) + max_new_tokens < max_context`` (refused, never clamped, like SGLang).
    max_context: int | None = None
    #: ``"stream": true`` is accepted (our Dynamo worker: the 1.6 frontend always streams).
    allow_stream: bool = False
    #: ``max_new_tokens: 0`` (prefill only) is accepted; the result's ``prefill_only`` says so.
    allow_prefill_only: bool = False
    #: ``sampling_params.stop`` (stop strings) is accepted: the server has a tokenizer and matches
    #: them (SGLang refuses them under ``--skip-tokenizer-init``).
    stop_strings: bool = False
    #: JSON nesting depth of the whole body (SGLang's deepest field is 4 levels down).
    max_depth: int = 16
    #: Longest prompt when no context is known.
    max_input_ids: int = 1 << 22
    max_stop_token_ids: int = 4096
    max_rid_chars: int = 4096
    #: ``max_new_tokens`` when the body does not set it (SGLang's default).
    default_max_new_tokens: int = 128


@attrs.frozen(slots=True, kw_only=True)
class TextOptions:
    """SGLang's detokenisation options (defaults are SGLang's): they shape ``text`` only."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False


@attrs.frozen(slots=True, kw_only=True)
class NativeRequest:
    """A parsed ``/generate`` body: the protocol's request and what only the server acts on."""

    request: GenerateRequest
    text_options: TextOptions = TextOptions()
    #: ``return_prompt_token_ids``: the answer carries ``prompt_token_ids``.
    return_prompt_token_ids: bool = False
    #: ``max_new_tokens: 0``: a prefill with no output (``request`` asks for one token: ignore it).
    prefill_only: bool = False
    stream: bool = False


# -- field names --------------------------------------------------------------------------------


def native_field(field: str) -> str:
    """Our field name (``sampling.seed``, ``request_id``) -> SGLang's (``sampling_params.sampling_seed``, ``rid``)."""
    head, dot, rest = field.partition(".")
    if head == "sampling" and dot:
        name, bracket, index = rest.partition("[")
        if name in _SAMPLING_AT_TOP:
            return f"{_SAMPLING_AT_TOP[name]}{bracket}{index}"
        return f"sampling_params.{_OURS_TO_NATIVE.get(name, name)}{bracket}{index}"
    name, bracket, index = field.partition("[")
    return f"{_TOP_OURS_TO_NATIVE.get(name, name)}{bracket}{index}"


def our_field(field: str) -> str:
    """SGLang's field name -> ours (the inverse of :func:`native_field`)."""
    head, dot, rest = field.partition(".")
    if head == "sampling_params" and dot:
        name, bracket, index = rest.partition("[")
        return f"sampling.{_NATIVE_TO_OURS.get(name, name)}{bracket}{index}"
    name, bracket, index = field.partition("[")
    if name in _TOP_AT_SAMPLING:
        return f"sampling.{_TOP_AT_SAMPLING[name]}{bracket}{index}"
    return f"{_TOP_NATIVE_TO_OURS.get(name, name)}{bracket}{index}"


def _renamed(exc: InvalidRequest) -> InvalidRequest:
    """``exc`` naming the field as a native caller spelled it."""
    return InvalidRequest(native_field(exc.field), exc.reason)


# -- GenerateRequest -> body ---------------------------------------------------------------------


def sampling_params_body(s: SamplingParams) -> dict[str, Any]:
    """Only keys SGLang knows; every value explicit (server defaults differ between versions)."""
    body: dict[str, Any] = {
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "ignore_eos": s.ignore_eos,
        "repetition_penalty": s.repetition_penalty,
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        "skip_special_tokens": False,
        "no_stop_trim": s.no_stop_trim,
    }
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.min_new_tokens:
        body["min_new_tokens"] = s.min_new_tokens
    if s.seed is not None:
        body["sampling_seed"] = s.seed
    return body


def request_body(request: GenerateRequest, *, stream: bool = False) -> dict[str, Any]:
    """SGLang's ``/generate`` body for one request (``stream`` for Dynamo 1.6's native route)."""
    body: dict[str, Any] = {
        # The validated tuple itself: JSON encodes it as the same array, and a list copy
        # (one 1 KB allocation per 128 tokens, freed cold after the answer) was measurable.
        "input_ids": request.input_ids,
        "sampling_params": sampling_params_body(request.sampling),
        "return_logprob": request.return_logprobs,
        "rid": request.request_id,
    }
    if request.sampling.top_logprobs:
        body["top_logprobs_num"] = request.sampling.top_logprobs
    if request.prompt_logprobs_start is not None:
        body["logprob_start_len"] = request.prompt_logprobs_start
    if stream:
        body["stream"] = True
    return body


# -- body -> GenerateRequest ---------------------------------------------------------------------


def _type_name(v: object) -> str:
    return "null" if v is None else type(v).__name__


def _int(field: str, v: object, *, low: int = _INT64_MIN, high: int = _INT64_MAX) -> int:
    if type(v) is not int:  # JSON ints are exact ints; a bool is not one
        raise InvalidRequest(field, f"must be an integer, got {_type_name(v)}")
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise InvalidRequest(field, f"{v} does not fit a signed 64-bit integer")
    if not low <= v <= high:
        raise InvalidRequest(field, f"must be in [{low}, {high}], got {v}")
    return v


def _number(field: str, v: object) -> float:
    if type(v) is not float and type(v) is not int:
        raise InvalidRequest(field, f"must be a number, got {_type_name(v)}")
    if type(v) is int and not _INT64_MIN <= v <= _INT64_MAX:
        raise InvalidRequest(field, f"{v} does not fit a signed 64-bit integer")
    f = float(v)
    if not math.isfinite(f):
        raise InvalidRequest(field, f"must be finite, got {v!r}")
    return f


def _bool(field: str, v: object) -> bool:
    if type(v) is not bool:
        raise InvalidRequest(field, f"must be a boolean (true/false), got {_type_name(v)}")
    return v


def _str(field: str, v: object, max_chars: int) -> str:
    if type(v) is not str:
        raise InvalidRequest(field, f"must be a string, got {_type_name(v)}")
    if len(v) > max_chars:
        raise InvalidRequest(field, f"is {len(v)} characters long (at most {max_chars})")
    return v


def _token_ids(field: str, v: object, *, vocab: int | None, max_len: int) -> tuple[int, ...]:
    if type(v) is not list:
        raise InvalidRequest(field, f"must be a list of token ids, got {_type_name(v)}")
    if len(v) > max_len:
        raise InvalidRequest(field, f"has {len(v)} token ids (at most {max_len})")
    top = _INT64_MAX if vocab is None else vocab - 1
    # The common case in C-level passes; anything else names its first offending entry.
    if not v or (countOf(map(type, v), int) == len(v) and min(v) >= 0 and max(v) <= top):
        return tuple(v)
    for i, t in enumerate(v):
        if type(t) is list:
            raise InvalidRequest(field, "batches (a list of lists) are not supported: send one request per prompt")
        _int(f"{field}[{i}]", t)
        if t < 0:
            raise InvalidRequest(f"{field}[{i}]", f"token ids are >= 0, got {t}")
        if t > top:
            raise InvalidRequest(f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {vocab})")
    raise AssertionError("unreachable")  # pragma: no cover


def check_depth(value: Any, max_depth: int, field: str = "body") -> None:
    """Refuse JSON nested deeper than ``max_depth`` (a typed 400, not a RecursionError 500).

    Iterative, and lists of plain scalars are passed over in one C-level pass each (a long
    ``input_ids`` costs no Python frame per token)."""
    stack: list[tuple[str, Any, int]] = [(field, value, 1)]
    while stack:
        path, v, depth = stack.pop()
        if depth > max_depth:
            raise InvalidRequest(path, f"nested deeper than {max_depth} levels")
        if type(v) is dict:
            for k, x in v.items():
                if type(x) is dict or type(x) is list:
                    stack.append((k if path == field else f"{path}.{k}", x, depth + 1))
        elif type(v) is list:
            if countOf(map(type, v), list) == 0 and countOf(map(type, v), dict) == 0:
                continue
            for i, x in enumerate(v):
                if type(x) is dict or type(x) is list:
                    stack.append((f"{path}[{i}]", x, depth + 1))


def _unset(v: object) -> bool:
    """Null, false or empty: SGLang's "not asked for"."""
    return v is None or v is False or ((type(v) is str or type(v) is list or type(v) is dict) and not v)


#: Sampling keys whose meaning is not part of the protocol: refused while set.
_SAMPLING_REFUSED = {
    "stop": "stop strings need a tokenizer, which this server has not: use stop_token_ids",
    "stop_regex": "stop regexes are not part of the protocol; use stop_token_ids",
    "logit_bias": "logit_bias is not part of the protocol",
    "json_schema": "constrained decoding is not part of the protocol",
    "regex": "constrained decoding is not part of the protocol",
    "ebnf": "constrained decoding is not part of the protocol",
    "structural_tag": "constrained decoding is not part of the protocol",
    "choice": "constrained decoding is not part of the protocol",
    "custom_params": "custom logit processors are not part of the protocol",
    "watermark": "watermarking is not part of the protocol",
}
_SAMPLING_FLOATS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
}
_TEXT_KEYS = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


def parse_sampling(
    params: object,
    *,
    field: str = "sampling_params",
    rules: ParseRules = ParseRules(),
    prompt_len: int | None = None,
) -> tuple[SamplingParams | None, TextOptions]:
    """SGLang's ``sampling_params`` -> ``SamplingParams`` and the text options.

    ``None`` values mean SGLang's default. The ``SamplingParams`` is ``None`` for
    ``max_new_tokens: 0`` (prefill only), which only ``rules.allow_prefill_only`` accepts. With
    ``prompt_len`` and ``rules.max_context``, SGLang's context rule applies.
    """
    sampling, opts = _parse_sampling(params, field=field, rules=rules, prompt_len=prompt_len)
    return (None if sampling.max_new_tokens == 0 else sampling), opts


def _read_sampling_key(
    key: str, field: str, v: object, rules: ParseRules, ours: dict[str, Any], text: dict[str, bool]
) -> None:
    """One set (non-null) sampling key other than ``max_new_tokens``, read into ``ours`` (the
    ``SamplingParams`` fields) and ``text`` (the text options); ``field`` is the key's field as written."""
    if key in _SAMPLING_FLOATS:
        x = _number(field, v)
        if key == "temperature" and 0.0 <= x < _GREEDY_EPS:
            x = 0.0
        ours[_SAMPLING_FLOATS[key]] = x
    elif key == "top_k":
        ours["top_k"] = _int(field, v)
    elif key == "min_new_tokens":
        ours["min_new_tokens"] = _int(field, v, low=0)
    elif key == "stop_token_ids":
        ours["stop_token_ids"] = _token_ids(field, v, vocab=rules.vocab_size, max_len=rules.max_stop_token_ids)
    elif key == "ignore_eos":
        ours["ignore_eos"] = _bool(field, v)
    elif key == "sampling_seed":
        # SGLang takes a signed int64; the protocol's seed is [0, 2**63): map it there.
        ours["seed"] = _int(field, v) % 2**63
    elif key == "n":
        if _int(field, v) != 1:
            raise InvalidRequest(field, "n > 1 is not supported: send n requests (one per sample)")
    elif key == "beam_width":
        if _int(field, v) not in (0, 1):
            raise InvalidRequest(field, "beam search is not part of the protocol")
    elif key == "stream_interval":
        _int(field, v, low=1)  # shapes streamed chunks only: nothing to honour in one answer
    elif key in _TEXT_KEYS:
        text[key] = _bool(field, v)
        if key == "no_stop_trim":
            ours["no_stop_trim"] = text[key]
    elif key == "stop" and rules.stop_strings:
        # SGLang takes one string or a list of them; SamplingParams checks each.
        if type(v) is str:
            ours["stop"] = (v,)
        elif type(v) is list:
            ours["stop"] = tuple(v)
        else:
            raise InvalidRequest(field, f"must be a string or a list of strings, got {_type_name(v)}")
    elif not _unset(v):
        raise InvalidRequest(field, _SAMPLING_REFUSED[key])


def _max_new_in_context(
    max_new: int | None, *, explicit: bool, field: str, rules: ParseRules, prompt_len: int | None
) -> int:
    """``max_new_tokens`` under SGLang's context rule: ``None`` (up to the context) resolved, the
    default capped, an explicit one past the context refused."""
    ctx = rules.max_context
    room = None if ctx is None or prompt_len is None else max(ctx - prompt_len - 1, 1)
    if max_new is None:
        if room is None:
            raise InvalidRequest(f"{field}.max_new_tokens", "null (up to the context) needs a known context length")
        return room
    if not explicit and room is not None:
        return min(max_new, room)  # SGLang's default, capped by the scheduler
    if ctx is not None and prompt_len is not None and prompt_len + max_new >= ctx:
        # SGLang's TokenizerManager rule and words (refused, not truncated).
        raise InvalidRequest(
            f"{field}.max_new_tokens",
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested "
            f"a total of {prompt_len + max_new} tokens: {prompt_len} tokens from the input messages and "
            f"{max_new} tokens for the completion.",
        )
    return max_new


def _parse_sampling(
    params: object, *, field: str, rules: ParseRules, prompt_len: int | None
) -> tuple[SamplingParams, TextOptions]:
    """:func:`parse_sampling`, with ``max_new_tokens: 0`` kept (``parse_request`` re-scores with it)."""
    if params is None:
        params = {}
    if type(params) is list:
        raise InvalidRequest(field, "a list of sampling_params (a batch) is not supported: send one request each")
    if type(params) is not dict:
        raise InvalidRequest(field, f"must be an object, got {_type_name(params)}")
    ours: dict[str, Any] = {}
    text: dict[str, bool] = {}
    max_new: int | None = rules.default_max_new_tokens
    explicit = False  # SGLang checks the context only against a max_new_tokens the caller set
    for key, v in params.items():
        f = f"{field}.{key}"
        if key not in SAMPLING_PARAM_KEYS:
            known = ", ".join(f"`{k}`" for k in SAMPLING_PARAM_KEYS)
            raise InvalidRequest(f, f"unknown field `{key}`, expected one of {known}")  # the schema gate's words
        if v is None:
            if key == "max_new_tokens":
                max_new = None
            continue
        if key == "max_new_tokens":
            max_new, explicit = _int(f, v, low=0), True
        else:
            _read_sampling_key(key, f, v, rules, ours, text)
    max_new = _max_new_in_context(max_new, explicit=explicit, field=field, rules=rules, prompt_len=prompt_len)
    opts = TextOptions(**text)
    if max_new == 0:
        if not rules.allow_prefill_only:
            raise InvalidRequest(f"{field}.max_new_tokens", "0 (a prefill with no output) is not supported")
        ours.pop("min_new_tokens", None)
    ours["max_new_tokens"] = max_new
    try:
        return SamplingParams(**ours), opts
    except InvalidRequest as exc:
        name = exc.field.removeprefix("sampling.")
        name, bracket, index = name.partition("[")
        raise InvalidRequest(f"{field}.{_OURS_TO_NATIVE.get(name, name)}{bracket}{index}", exc.reason) from None


#: Top-level keys the protocol carries (read by :func:`parse_request`).
_CARRIED = frozenset(
    {"input_ids", "text", "sampling_params", "rid", "return_logprob", "stream", "return_prompt_token_ids",
     "routing_key", "logprob_start_len", "top_logprobs_num", "token_ids_logprob"}
)  # fmt: skip
#: Keys that change nothing in one non-streamed token answer (or that smg adds to every request it
#: forwards: ``model``, ``log_metrics``, ``background``, ``no_logs``, ``return_bytes``,
#: ``return_entropy``, docs/sglang.md, smg's /generate forwarding): accepted when their JSON type is right.
_INERT: dict[str, str] = {
    "model": "str",
    "log_metrics": "bool",
    "no_logs": "bool",
    "return_text_in_logprobs": "bool",
    "extra_key": "str",
    "cache_salt": "str",
    "priority": "int",
    "custom_labels": "dict",
    "conversation_id": "str",
    "session_id": "str",
    "routed_dp_rank": "int",
    "data_parallel_rank": "int",
    "received_time": "number",
    "external_trace_header": "dict",
}


def _check_inert(key: str, kind: str, v: object) -> None:
    if v is None:
        return
    if kind == "str":
        _str(key, v, 1 << 16)
    elif kind == "bool":
        _bool(key, v)
    elif kind == "int":
        _int(key, v)
    elif kind == "number":
        _number(key, v)
    elif type(v) is not dict:
        raise InvalidRequest(key, f"must be an object, got {_type_name(v)}")


#: Keys SGLang defines that the protocol cannot honour: refused while set (not null/false/empty).
_TOP_REFUSED = {
    "input_embeds": "input embeddings are not part of the protocol (send input_ids)",
    "image_data": "multimodal input is not part of the protocol",
    "video_data": "multimodal input is not part of the protocol",
    "audio_data": "multimodal input is not part of the protocol",
    "mm_hashes": "multimodal input is not part of the protocol",
    "mm_content_hashes": "multimodal input is not part of the protocol",
    "modalities": "multimodal input is not part of the protocol",
    "use_audio_in_video": "multimodal input is not part of the protocol",
    "video_config": "multimodal input is not part of the protocol",
    "images_config": "multimodal input is not part of the protocol",
    "max_dynamic_patch": "multimodal input is not part of the protocol",
    "min_dynamic_patch": "multimodal input is not part of the protocol",
    "image_max_dynamic_patch": "multimodal input is not part of the protocol",
    "video_max_dynamic_patch": "multimodal input is not part of the protocol",
    "return_hidden_states": "hidden states are not part of the protocol",
    "return_routed_experts": "routed experts are not part of the protocol",
    "routed_experts_start_len": "routed experts are not part of the protocol",
    "return_indexer_topk": "indexer top-k is not part of the protocol",
    "return_entropy": "entropy is not part of the protocol",
    "return_sampling_mask": "sampling masks are not part of the protocol",
    "sampling_logprobs_mode": "sampling masks are not part of the protocol",
    "return_flat_raw_top_logprobs": "top logprobs are not part of the protocol",
    "return_flat_raw_top_logprobs_b64": "top logprobs are not part of the protocol",
    "return_flat_raw_output_top_logprobs": "top logprobs are not part of the protocol",
    "return_bytes": "image generation is not part of the protocol",
    "lora_path": "LoRA is not part of the protocol",
    "lora_id": "LoRA is not part of the protocol",
    "custom_logit_processor": "custom logit processors are not part of the protocol",
    "positional_embed_overrides": "embedding overrides are not part of the protocol",
    "session_params": "sessions are not part of the protocol",
    "bootstrap_host": "disaggregated serving is not part of the protocol",
    "bootstrap_port": "disaggregated serving is not part of the protocol",
    "bootstrap_room": "disaggregated serving is not part of the protocol",
    "bootstrap_pair_key": "disaggregated serving is not part of the protocol",
    "decode_tp_size": "disaggregated serving is not part of the protocol",
    "disagg_prefill_dp_rank": "disaggregated serving is not part of the protocol",
    "kv_router_hint": "KV router hints are not part of the protocol",
    "background": "background requests are not part of the protocol",
    "require_reasoning": "reasoning controls are not part of the protocol",
    "max_thinking_tokens": "reasoning controls are not part of the protocol",
    "need_wait_for_mm_inputs": "multimodal input is not part of the protocol",
    "num_items_assigned": "multimodal input is not part of the protocol",
    "encoder_urls": "multimodal input is not part of the protocol",
    "multi_item_delimiter_indices": "multi-item scoring is not part of the protocol",
    "http_worker_ipc": "internal to SGLang",
}


def _check_top_level_keys(body: dict[str, Any], rules: ParseRules) -> None:
    """Every top-level key is carried, inert with the right JSON type, refused-but-unset, or (with
    ``UnknownKeys.REFUSE``) known: else ``InvalidRequest`` naming the key."""
    for key, v in body.items():
        if key in _CARRIED:
            continue
        kind = _INERT.get(key)
        if kind is not None:
            _check_inert(key, kind, v)
            continue
        why = _TOP_REFUSED.get(key)
        if why is not None:
            if not _unset(v) and not (key == "routed_experts_start_len" and v == 0):
                raise InvalidRequest(key, why)
            continue
        if rules.unknown_keys is UnknownKeys.REFUSE:
            raise InvalidRequest(key, "unknown field: SGLang's /generate has no such key (a typo?)")


def _prompt_ids(
    body: dict[str, Any], rules: ParseRules, encode: Callable[[str], Sequence[int]] | None
) -> tuple[int, ...]:
    """The prompt's token ids, from ``input_ids`` or (with ``encode``) ``text``: non-empty, within
    the vocabulary and shorter than the context."""
    max_len = rules.max_input_ids if rules.max_context is None else rules.max_context
    ids_value, text = body.get("input_ids"), body.get("text")
    if ids_value is not None and text is not None:
        raise InvalidRequest("text", "send either text or input_ids, not both")
    if ids_value is not None:
        input_ids = _token_ids("input_ids", ids_value, vocab=rules.vocab_size, max_len=max_len)
    elif text is not None:
        if type(text) is list:
            raise InvalidRequest("text", "batches (a list of prompts) are not supported: send one request per prompt")
        prompt = _str("text", text, 1 << 26)
        if encode is None:
            raise InvalidRequest("text", "this server has no tokenizer: send input_ids")
        input_ids = _token_ids("text", list(encode(prompt)), vocab=rules.vocab_size, max_len=max_len)
    else:
        raise InvalidRequest("input_ids", "Either text, input_ids or input_embeds should be provided.")
    if not input_ids:
        raise InvalidRequest("input_ids", "must not be empty")
    if rules.max_context is not None and len(input_ids) >= rules.max_context:
        raise InvalidRequest(
            "input_ids",
            f"The input ({len(input_ids)} tokens) is longer than the model's context length "
            f"({rules.max_context} tokens).",
        )
    return input_ids


def _request_id(body: dict[str, Any], rules: ParseRules, new_rid: Callable[[], str] | None) -> str | None:
    """The body's ``rid`` (one non-empty string), else ``new_rid()`` where given."""
    rid = body.get("rid")
    if type(rid) is list:
        raise InvalidRequest("rid", "a list of rids (a batch) is not supported")
    if rid is None:
        rid = new_rid() if new_rid is not None else None
    elif not _str("rid", rid, rules.max_rid_chars):
        raise InvalidRequest("rid", "must not be empty")
    return rid


def parse_request(
    body: object,
    *,
    rules: ParseRules = ParseRules(),
    encode: Callable[[str], Sequence[int]] | None = None,
    routing_key: str | None = None,
    worker: str | None = None,
    new_rid: Callable[[], str] | None = None,
) -> NativeRequest:
    """A ``/generate`` body -> the protocol's request. Raises ``InvalidRequest`` naming the field as
    the caller spelled it. ``encode`` turns a ``text`` prompt into ids (a server with a tokenizer);
    ``routing_key`` (a header) wins over the body's; ``worker`` pins the request."""
    if type(body) is not dict:
        raise InvalidRequest("body", f"must be a JSON object, got {_type_name(body)}")
    check_depth(body, rules.max_depth)
    _check_top_level_keys(body, rules)
    stream = body.get("stream")
    if stream is not None and _bool("stream", stream) and not rules.allow_stream:
        raise InvalidRequest("stream", "streaming is not supported by this server (send stream=false)")
    start = body.get("logprob_start_len")
    prompt_start = None if start is None or _int("logprob_start_len", start, low=-1) == -1 else start
    top = body.get("top_logprobs_num")
    top_k = 0 if top is None else _int("top_logprobs_num", top, low=0, high=MAX_TOP_LOGPROBS)
    tid_lp = body.get("token_ids_logprob")
    if tid_lp is not None and (type(tid_lp) is not list or tid_lp):
        raise InvalidRequest("token_ids_logprob", "token-id logprobs are not part of the protocol")
    input_ids = _prompt_ids(body, rules, encode)
    sampling, opts = _parse_sampling(
        body.get("sampling_params"), field="sampling_params", rules=rules, prompt_len=len(input_ids)
    )
    prefill_only = sampling.max_new_tokens == 0
    if prefill_only and prompt_start is None:
        # A bare prefill (no prompt logprobs): the server answers it; the protocol's request asks
        # for one token, which the server ignores.
        sampling = SamplingParams(max_new_tokens=1)
    rid = _request_id(body, rules, new_rid)
    ret_lp = body.get("return_logprob")
    ret_lp = False if ret_lp is None else _bool("return_logprob", ret_lp)
    if top_k and not ret_lp:
        raise InvalidRequest("top_logprobs_num", "needs return_logprob=true (SGLang returns top logprobs only then)")
    if top_k:
        sampling = attrs.evolve(sampling, top_logprobs=top_k)
    ret_prompt = body.get("return_prompt_token_ids")
    ret_prompt = False if ret_prompt is None else _bool("return_prompt_token_ids", ret_prompt)
    key = routing_key
    if key is None and body.get("routing_key") is not None:
        key = _str("routing_key", body["routing_key"], rules.max_rid_chars) or None
    extra: dict[str, Any] = {} if rid is None else {"request_id": rid}
    try:
        request = GenerateRequest(
            input_ids=input_ids,
            sampling=sampling,
            return_logprobs=ret_lp,
            worker=worker,
            routing_key=key,
            prompt_logprobs_start=prompt_start,
            **extra,
        )
    except InvalidRequest as exc:
        raise _renamed(exc) from None
    return NativeRequest(
        request=request,
        text_options=opts,
        return_prompt_token_ids=ret_prompt,
        prefill_only=prefill_only,
        stream=bool(stream),
    )


#: Top-level keys a batch body may give per prompt, as a list (SGLang 0.5.16's
#: ``GenerateReqInput._normalize_batch_inputs``: ``rid``, ``sampling_params``, the logprob options,
#: ``extra_key``); as a scalar or object they apply to every prompt.
BATCH_LIST_KEYS = ("rid", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "extra_key")


def split_batch(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """A batched ``/generate`` body -> one single-prompt body per prompt, in order; ``None`` for a
    single prompt. A batch is ``input_ids`` as a list of lists or ``text`` as a list of strings
    (SGLang 0.5.16's ``GenerateReqInput._determine_batch_size``), answered by SGLang as a JSON list
    in the same order. Per prompt: a list value of :data:`BATCH_LIST_KEYS` gives its own item
    (``sampling_params`` a dict is shared); a string ``rid`` becomes ``"{rid}_{i}"``, a list of rids
    must match the batch and hold no duplicates (SGLang's ``_normalize_rid``,
    ``_validate_rid_uniqueness``, its words). Lists of another length are refused (SGLang only checks
    ``rid``, and indexes past the end of the others). Each body is then parsed as one request;
    :func:`batch_field` names an item's refusal as the batch spelled it."""
    ids, text = body.get("input_ids"), body.get("text")
    if type(ids) is list and ids and type(ids[0]) is list:
        key, prompts = "input_ids", ids
    elif type(text) is list:
        key, prompts = "text", text
    else:
        return None
    n = len(prompts)
    if n == 0:
        raise InvalidRequest(key, "an empty batch (a list of no prompts)")
    for name in BATCH_LIST_KEYS:
        v = body.get(name)
        if type(v) is list and len(v) != n:
            if name == "rid":
                raise InvalidRequest(
                    name, "The specified rids length mismatch with the batch_size for batch processing."
                )
            raise InvalidRequest(name, f"has {len(v)} entries for a batch of {n} prompts")
    rid = body.get("rid")
    if type(rid) is list:
        dup = sorted({r for r in rid if type(r) is str and rid.count(r) > 1})
        if dup:
            raise InvalidRequest("rid", f"Duplicate request IDs detected within the request: {dup}")
    items = []
    for i, prompt in enumerate(prompts):
        item = {**body, key: prompt}
        for name in BATCH_LIST_KEYS:
            if type(body.get(name)) is list:
                item[name] = body[name][i]
        if type(rid) is str:
            item["rid"] = f"{rid}_{i}"
        items.append(item)
    return items


def batch_field(field: str, index: int, batch: Mapping[str, Any]) -> str:
    """A batch item's refusal (``input_ids[3]``, ``sampling_params.top_p``) as the batch spelled it
    (``input_ids[1][3]``, ``sampling_params[1].top_p``) where the key was given per prompt."""
    head = re.match(r"[A-Za-z_]+", field)
    name = head.group(0) if head is not None else ""
    if name in ("input_ids", "text") or (name in BATCH_LIST_KEYS and type(batch.get(name)) is list):
        return f"{name}[{index}]{field[len(name) :]}"
    return field


# -- Generation -> answer ------------------------------------------------------------------------


def finish_reason_body(gen: Generation) -> dict[str, Any]:
    """SGLang's ``meta_info.finish_reason`` object."""
    if gen.finish_reason is FinishReason.STOP:
        return {"type": "stop", "matched": gen.matched_stop}
    if gen.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": len(gen.output_ids)}
    return {"type": "abort", "message": ABORT_MESSAGE, "status_code": None, "err_type": None}


def meta_info(
    gen: Generation, *, return_logprob: bool, worker: str | None = None, input_ids: Sequence[int] | None = None
) -> dict[str, Any]:
    """SGLang's ``meta_info`` for one finished generation.

    ``weight_version`` is left out when unknown (a ``null`` would read as a version to Miles).
    ``worker`` is not SGLang's: our Dynamo worker names itself there (the frontend does not).
    ``input_ids`` (the request's) name the prompt tokens of ``gen.prompt_logprobs``.
    """
    meta: dict[str, Any] = {
        "id": gen.request_id,
        "finish_reason": finish_reason_body(gen),
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": len(gen.output_ids),
        "cached_tokens": gen.cached_tokens,
        "e2e_latency": gen.latency_s,
    }
    if gen.weight_version is not None:
        meta["weight_version"] = gen.weight_version
    if worker is not None:
        meta["worker"] = worker
    if return_logprob:
        lps = gen.logprobs if gen.logprobs is not None else (None,) * len(gen.output_ids)
        meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(lps, gen.output_ids, strict=True)]
        if gen.top_logprobs is not None:
            meta["output_top_logprobs"] = [[[lp, tid, None] for tid, lp in top] for top in gen.top_logprobs]
        if gen.prompt_logprobs is not None:
            if input_ids is None:
                raise ValueError("a Generation with prompt_logprobs needs the request's input_ids to answer")
            scored = input_ids[len(input_ids) - len(gen.prompt_logprobs) :]
            pairs = zip(gen.prompt_logprobs, scored, strict=True)
            meta["input_token_logprobs"] = [[lp, tid, None] for lp, tid in pairs]
    return meta


def answer_body(
    gen: Generation,
    *,
    return_logprob: bool,
    text: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    worker: str | None = None,
    input_ids: Sequence[int] | None = None,
    finished: bool = True,
) -> dict[str, Any]:
    """SGLang's ``/generate`` answer for one request; ``text`` is left out without a tokenizer
    (as ``--skip-tokenizer-init`` does). ``input_ids`` are needed with ``gen.prompt_logprobs``.
    ``finished=False``: a streamed event before the last (SGLang 0.5.16 streams the answer so far,
    cumulative, with ``meta_info.finish_reason`` null until the last one)."""
    body: dict[str, Any] = {}
    if text is None:
        text = gen.text
    if text is not None:
        body["text"] = text
    body["output_ids"] = list(gen.output_ids)
    body["meta_info"] = meta_info(gen, return_logprob=return_logprob, worker=worker, input_ids=input_ids)
    if not finished:
        body["meta_info"]["finish_reason"] = None
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = list(prompt_token_ids)
    return body


@attrs.frozen(slots=True, kw_only=True)
class StopStrings:
    """SGLang 0.5.16's stop-string check (``Req._check_str_based_finish``, ``schedule_batch.py``):
    after each output token, the last ``window`` output tokens are decoded on their own (special
    tokens kept: HF's decode default, what SGLang calls) and the first stop string, in the
    request's order, that the tail contains is the match. ``window`` is the longest stop's token
    count + 1 (``SamplingParams.normalize``: ``stop_str_max_len`` from the tokenizer's encoding).

    One rule for every engine that matches stop strings itself: the reference engine and the
    dynamo.sglang shim (whose SGLang runs without a tokenizer and cannot match them)."""

    stops: tuple[str, ...]
    window: int

    @classmethod
    def of(cls, stops: Sequence[str], count_tokens: Callable[[str], int]) -> StopStrings:
        """``count_tokens(s)``: the token count of ``s`` encoded without special tokens."""
        if not stops:
            raise InvalidRequest("sampling.stop", "no stop strings to match")
        return cls(stops=tuple(stops), window=max(count_tokens(st) for st in stops) + 1)

    def match(self, output_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> str | None:
        """The stop string the output (as it stands after its last token) has met, or ``None``."""
        tail = decode(output_ids[-self.window :])
        return next((st for st in self.stops if st in tail), None)


def trim_at_stop(text: str, matched: str, *, no_stop_trim: bool) -> str:
    """SGLang's ``text`` for an output that met the stop string ``matched`` (its detokenizer's
    ``trim_matched_stop``): cut at the string's first occurrence in the whole output's text,
    keeping it with ``no_stop_trim``; what follows is dropped either way. ``text`` unchanged when
    the string is not in it (a tail decode can differ from the whole one at its left edge)."""
    pos = text.find(matched)
    if pos == -1:
        return text
    return text[: pos + len(matched)] if no_stop_trim else text[:pos]


def decode_text(tokenizer: Any, gen: Generation, opts: TextOptions) -> str:
    """The ``text`` SGLang returns: the output decoded, the matched stop token trimmed unless
    ``no_stop_trim`` (``output_ids`` are never trimmed). ``""`` without a tokenizer."""
    if tokenizer is None:
        return ""
    ids = list(gen.output_ids)
    if isinstance(gen.matched_stop, str) and gen.finish_reason is FinishReason.STOP:
        return trim_at_stop(_decode(tokenizer, ids, opts), gen.matched_stop, no_stop_trim=opts.no_stop_trim)
    if (
        not opts.no_stop_trim
        and gen.finish_reason is FinishReason.STOP
        and gen.matched_stop is not None
        and ids
        and ids[-1] == gen.matched_stop
    ):
        ids = ids[:-1]
    return _decode(tokenizer, ids, opts)


def _decode(tokenizer: Any, ids: list[int], opts: TextOptions) -> str:
    try:
        text = tokenizer.decode(
            ids,
            skip_special_tokens=opts.skip_special_tokens,
            spaces_between_special_tokens=opts.spaces_between_special_tokens,
        )
    except TypeError:  # tokenizers without the (slow-tokenizer only) spacing option
        text = tokenizer.decode(ids, skip_special_tokens=opts.skip_special_tokens)
    return str(text)


# -- answer -> Generation ------------------------------------------------------------------------

_FINISH = {r.value: r for r in FinishReason}


def _fast_logprobs(entries: list[Any], out: tuple[int, ...]) -> tuple[float, ...] | None:
    """The common case in a few C-level passes: every entry a ``[float, id, ...]`` list whose ids
    are ``out``, no NaN. ``None`` sends the caller to ``_checked_logprobs`` (which names the fault).

    ``zip(*entries)`` transposes in C: its first two columns are the logprobs and the ids, both
    tuples, so the logprobs column is the result as is (no per-entry Python frame or copy)."""
    n = len(entries)
    if countOf(map(type, entries), list) != n:
        return None
    columns = zip(*entries, strict=False)  # stops at the shortest entry: see ``ids`` below
    lps = next(columns, None)
    ids = next(columns, None)  # None when some entry is shorter than [logprob, id]
    if ids is None or lps is None or ids != out:
        return None
    if countOf(map(type, lps), float) != n or any(map(math.isnan, lps)):
        return None
    return lps


def _checked_logprobs(entries: list[Any], out: Sequence[int], worker: str | None) -> tuple[float, ...]:
    lps = []
    for i, (entry, tid) in enumerate(zip(entries, out, strict=False)):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise ContractViolation(f"output_token_logprobs[{i}] is not [logprob, id, ...]", worker=worker)
        lp, eid = entry[0], entry[1]
        if eid != tid:
            raise ContractViolation(f"output_token_logprobs[{i}] is for token {eid}, output has {tid}", worker=worker)
        if not isinstance(lp, (int, float)) or isinstance(lp, bool) or math.isnan(lp):
            raise ContractViolation(f"output_token_logprobs[{i}] has no logprob ({lp!r})", worker=worker)
        lps.append(float(lp))
    return tuple(lps)


def _top_logprobs(
    entries: object, n: int, k: int, field: str, worker: str | None
) -> tuple[tuple[tuple[int, float], ...], ...]:
    """SGLang's ``output_top_logprobs`` (per token, ``[[logprob, id, text], ...]``) -> per token, the
    ``(id, logprob)`` pairs, most likely first (ties by id). Fewer than ``k`` only past the vocabulary."""
    if type(entries) is not list or len(entries) != n:
        got = len(entries) if type(entries) is list else _type_name(entries)
        raise ContractViolation(f"meta_info.{field} has {got} entries for {n} output tokens", worker=worker)
    out = []
    for i, position in enumerate(entries):
        if type(position) is not list or not position or len(position) > k:
            raise ContractViolation(f"meta_info.{field}[{i}] is not a list of 1..{k} entries", worker=worker)
        pairs = []
        for e in position:
            if type(e) is not list or len(e) < 2 or type(e[1]) is not int:
                raise ContractViolation(f"meta_info.{field}[{i}] has an entry that is not [logprob, id]", worker=worker)
            lp = e[0]
            if (type(lp) is not float and type(lp) is not int) or math.isnan(lp):
                raise ContractViolation(f"meta_info.{field}[{i}] has no logprob ({lp!r})", worker=worker)
            pairs.append((e[1], float(lp)))
        pairs.sort(key=lambda p: (-p[1], p[0]))
        out.append(tuple(pairs))
    return tuple(out)


def _prompt_logprobs(entries: object, scored: Sequence[int], worker: str | None) -> tuple[float | None, ...]:
    """SGLang's ``input_token_logprobs`` for ``scored`` (the prompt from ``logprob_start_len``):
    ``[[logprob, id, text], ...]``, the first logprob ``null``."""
    if type(entries) is not list or len(entries) != len(scored):
        got = len(entries) if type(entries) is list else _type_name(entries)
        raise ContractViolation(
            f"meta_info.input_token_logprobs has {got} entries for {len(scored)} prompt tokens", worker=worker
        )
    # SGLang 0.5.16 names id 0 for a prompt id >= vocab_size - 1 (its scheduler clips "the padded
    # hash values from image tokens" with an off-by-one, so the vocabulary's last id is clipped
    # too; the logprob is still that id's: H200 2026-12-03, docs/sglang.md "Prompt logprobs"). A
    # valid prompt id is < vocab_size, so only the largest id of the prompt can be clipped.
    clipped = max(scored, default=0)
    out: list[float | None] = []
    for i, (e, tid) in enumerate(zip(entries, scored, strict=True)):
        if type(e) is not list or len(e) < 2 or (e[1] != tid and not (e[1] == 0 and tid == clipped)):
            raise ContractViolation(f"meta_info.input_token_logprobs[{i}] is not [logprob, {tid}, ...]", worker=worker)
        lp = e[0]
        if lp is None and i == 0:
            out.append(None)
            continue
        if (type(lp) is not float and type(lp) is not int) or math.isnan(lp):
            raise ContractViolation(f"meta_info.input_token_logprobs[{i}] has no logprob ({lp!r})", worker=worker)
        out.append(float(lp))
    return tuple(out)


def _finish(meta: Mapping[str, Any], worker: str | None) -> tuple[FinishReason, int | str | None]:
    fr = meta.get("finish_reason")
    if fr is None:
        raise ContractViolation("meta_info.finish_reason is missing", worker=worker)
    kind = fr.get("type") if isinstance(fr, dict) else fr
    reason = _FINISH.get(kind) if isinstance(kind, str) else None
    if reason is None:
        raise ContractViolation(f"unknown finish reason {fr!r}", worker=worker)
    matched = fr.get("matched") if isinstance(fr, dict) else None
    return reason, matched if type(matched) is int or type(matched) is str else None


def _count(meta: Mapping[str, Any], key: str, default: int, worker: str | None) -> int:
    v = meta.get(key)
    if v is None:
        return default
    if type(v) is not int or v < 0:
        raise ContractViolation(f"meta_info.{key} is not a count ({v!r})", worker=worker)
    return v


def _answer_parts(data: object, what: str, worker: str | None) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """An answer (or a streamed event), its ``meta_info`` and ``output_ids``, checked for shape."""
    if type(data) is not dict:
        raise ContractViolation(f"{what} is {_type_name(data)}, expected an object", worker=worker)
    meta = data.get("meta_info")
    out = data.get("output_ids")
    if type(meta) is not dict or type(out) is not list:
        raise ContractViolation(f"{what} lacks output_ids or meta_info", worker=worker)
    return data, meta, out


def parse_answer(request: GenerateRequest, data: object, latency_s: float, *, worker: str | None) -> Generation:
    """SGLang's ``/generate`` answer (an object, or a one-element list) -> ``Generation``."""
    if type(data) is list and len(data) == 1:
        data = data[0]
    answer, meta, out = _answer_parts(data, "/generate answer", worker)
    if countOf(map(type, out), int) != len(out):
        raise ContractViolation("output_ids are not all ints", worker=worker)
    output_ids = tuple(out)
    reason, matched = _finish(meta, worker)
    logprobs: tuple[float, ...] | None = None
    if request.return_logprobs:
        entries = meta.get("output_token_logprobs")
        if type(entries) is not list:
            raise ContractViolation("meta_info.output_token_logprobs is missing", worker=worker)
        if len(entries) != len(out):
            raise ContractViolation(
                f"{len(entries)} logprob entries for {len(out)} output tokens (never padded)", worker=worker
            )
        logprobs = _fast_logprobs(entries, output_ids) if entries else ()
        if logprobs is None:
            logprobs = _checked_logprobs(entries, output_ids, worker)
    top: tuple[tuple[tuple[int, float], ...], ...] | None = None
    k = request.sampling.top_logprobs
    if k and request.return_logprobs:
        top = _top_logprobs(meta.get("output_top_logprobs"), len(out), k, "output_top_logprobs", worker)
    prompt_lps: tuple[float | None, ...] | None = None
    if request.prompt_logprobs_start is not None and request.return_logprobs:
        scored = request.input_ids[request.prompt_logprobs_start :]
        prompt_lps = _prompt_logprobs(meta.get("input_token_logprobs"), scored, worker)
    version = meta.get("weight_version")
    rid = meta.get("id")
    return Generation(
        request_id=rid if type(rid) is str and rid else request.request_id,
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=reason,
        weight_version=None if version is None else str(version),
        prompt_tokens=_count(meta, "prompt_tokens", len(request.input_ids), worker),
        cached_tokens=_count(meta, "cached_tokens", 0, worker),
        worker=worker,
        latency_s=latency_s,
        matched_stop=matched if reason is FinishReason.STOP else None,
        top_logprobs=top,
        prompt_logprobs=prompt_lps,
        text=answer["text"] if type(answer.get("text")) is str else None,
    )


def parse_stream_event(
    request: GenerateRequest, data: object, sent: Sequence[int], latency_s: float, *, worker: str | None
) -> TokenChunk:
    """One event of SGLang's streamed ``/generate`` answer -> the chunk of tokens it adds.

    SGLang 0.5.16 (without ``--incremental-streaming-output``) sends the answer so far in every
    event: ``output_ids`` and ``meta_info.output_token_logprobs`` (and ``output_top_logprobs``) are
    cumulative, ``meta_info.finish_reason`` is null until the last event (measured on the H200,
    bench/rb_bench/capture.py). ``sent`` are the ids delivered so far: they must be the
    event's prefix (else ``ContractViolation``: tokens are never repeated or dropped), and the chunk
    holds what follows. The last event is parsed whole by ``parse_answer``: the final
    ``Generation`` is the non-streamed answer's, parsed in one place.
    """
    _, meta, out = _answer_parts(data, "streamed /generate event", worker)
    n = len(sent)
    if len(out) < n or tuple(out[:n]) != tuple(sent):
        raise ContractViolation(
            f"a streamed event's {len(out)} output_ids do not extend the {n} already streamed "
            "(SGLang streams them cumulative; --incremental-streaming-output is not supported)",
            worker=worker,
        )
    if meta.get("finish_reason") is not None:
        return TokenChunk.closing(parse_answer(request, data, latency_s, worker=worker), n)
    new = out[n:]
    if countOf(map(type, new), int) != len(new):
        raise ContractViolation("output_ids are not all ints", worker=worker)
    ids = tuple(new)
    logprobs: tuple[float, ...] | None = None
    top: tuple[tuple[tuple[int, float], ...], ...] | None = None
    if request.return_logprobs:
        entries = meta.get("output_token_logprobs")
        if type(entries) is not list or len(entries) != len(out):
            got = len(entries) if type(entries) is list else _type_name(entries)
            raise ContractViolation(f"{got} streamed logprob entries for {len(out)} output tokens", worker=worker)
        delta = entries[n:]
        logprobs = (_fast_logprobs(delta, ids) if delta else ()) or _checked_logprobs(delta, ids, worker)
        k = request.sampling.top_logprobs
        if k:
            tops = meta.get("output_top_logprobs")
            tops = tops[n:] if type(tops) is list and len(tops) == len(out) else tops
            top = _top_logprobs(tops, len(ids), k, "output_top_logprobs", worker)
    version = meta.get("weight_version")
    return TokenChunk(
        request_id=request.request_id,
        index=n,
        output_ids=ids,
        logprobs=logprobs,
        top_logprobs=top,
        weight_version=None if version is None else str(version),
    )


# -- errors --------------------------------------------------------------------------------------


def error_body(exc: InvalidRequest) -> dict[str, Any]:
    """What our servers answer with HTTP 400: SGLang's ``{"error": {"message"}}`` plus the
    OpenAI-style ``type`` and ``param`` (the field, as the caller spelled it), which smg keeps."""
    return {"error": {"message": str(exc), "type": "invalid_request_error", "param": exc.field, "code": 400}}


def error_message(data: object, text: str) -> str:
    """The message of an error answer (``data`` its parsed JSON, or ``None``; ``text`` the raw body)."""
    if isinstance(data, dict):
        err = data.get("error", data.get("message", data.get("detail")))
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return text[:500]


_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")


def named_field(message: str) -> str | None:
    """The field a refusal's message names at its head (``sampling_params.sampling_seed: ...``, the
    form ``str(InvalidRequest)`` takes, for a channel that carries only a message), in our spelling
    (``sampling.seed``), wherever the message sits in a longer one (a frontend's prefix); ``None``
    where it names none."""
    m = _REFUSAL.search(message)
    return None if m is None else our_field(m.group(1))


_NAMED_FIELD = re.compile(r"\bsampling(?:_params)?\.(\w+)")
_OUR_SAMPLING = tuple(a.name for a in attrs.fields(SamplingParams))
#: ``<native field>: `` at the head of a message or after a prefix's ``: ``.
_REFUSAL = re.compile(
    r"(?:^|: )((?:sampling_params\.(?:" + "|".join(SAMPLING_PARAM_KEYS) + r")|input_ids|text|rid|return_logprob"
    r"|stream|body)(?:\[\d+\])*): "
)


def error_field(data: object, message: str) -> str:
    """The field an SGLang (or smg, or our servers') refusal names, in our spelling
    (``sampling.seed``, ``request_id``); ``"request"`` where it names none."""
    err = data.get("error") if isinstance(data, dict) else None
    param = err.get("param") if isinstance(err, dict) else None
    if isinstance(param, str) and param:
        return our_field(param)
    named = named_field(message)
    if named is not None:
        return named
    m = _UNKNOWN_FIELD.search(message)
    if m:  # SGLang 0.5.23's schema gate: unknown sampling keys
        return f"sampling.{_NATIVE_TO_OURS.get(m.group(1), m.group(1))}"
    low = message.lower()
    if "requested token count exceeds" in low or "max_new_tokens" in low:
        return "sampling.max_new_tokens"
    if "longer than the model's context length" in low:
        return "input_ids"
    if "duplicate request id" in low or ("rid" in low and "duplicate" in low):
        return "request_id"
    m = _NAMED_FIELD.search(message)
    if m:
        name = _NATIVE_TO_OURS.get(m.group(1), m.group(1))
        return f"sampling.{name}"
    for name in (*_OURS_TO_NATIVE.values(), *_OUR_SAMPLING):
        if name in low:
            return f"sampling.{_NATIVE_TO_OURS.get(name, name)}"
    if "input_ids" in low or "vocabulary" in low:
        return "input_ids"
    return "request"


# -- control bodies (the SGLang wire's admin routes; the Dynamo wire's dynamo.sglang engine routes) --


def init_group_body(g: WeightGroup, rank_offset: int) -> dict[str, Any]:
    return {
        "master_address": g.master_address,
        "master_port": g.master_port,
        "rank_offset": rank_offset,
        "world_size": g.world_size,
        "group_name": g.group_name,
        "backend": g.backend,
    }


def distributed_body(op: UpdateFromDistributed) -> dict[str, Any]:
    b = op.bucket
    body: dict[str, Any] = {
        "names": b.names,
        "dtypes": b.dtypes,
        "shapes": b.shapes,
        "group_name": op.group_name,
        "flush_cache": op.flush_cache,
        "abort_all_requests": False,
    }
    if op.version is not None:
        body["weight_version"] = op.version
    return body


def tensors_body(op: UpdateFromTensors, ranks: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        # One entry per TP rank of the worker, each its own dump (a reference for each process).
        "serialized_named_tensors": [op.tensors.payload() for _ in range(ranks)],
        "load_format": op.load_format,
        "flush_cache": op.flush_cache,
        "abort_all_requests": False,
    }
    if op.version is not None:
        body["weight_version"] = op.version
    return body


def disk_body(op: UpdateFromDisk) -> dict[str, Any]:
    body: dict[str, Any] = {"model_path": op.path, "abort_all_requests": False, "flush_cache": op.flush_cache}
    if op.load_format is not None:
        body["load_format"] = op.load_format
    if op.version is not None:
        body["weight_version"] = op.version
    return body


def set_version_body(version: str) -> dict[str, Any]:
    # abort_all_requests defaults to true upstream and kills in-flight rollouts (miles#2372).
    return {"new_version": version, "abort_all_requests": False}


def memory_body(tags: tuple[MemoryTag, ...] | None) -> dict[str, Any]:
    return {"tags": None if tags is None else [t.value for t in tags]}


# -- control bodies -> values (the servers' side: the facade) -------------------------------------
#
# Each is the inverse of the builder above (hypothesis round trips in tests/test_sglang_native.py):
# every field's JSON type checked (``"false"`` is not a boolean), a refusal naming the key as the
# caller wrote it, SGLang's defaults where a key is absent.


def _opt(body: Mapping[str, Any], key: str, check: Callable[[str, object], Any], default: Any) -> Any:
    v = body.get(key)
    return default if v is None else check(key, v)


def _opt_str(key: str, v: object) -> str:
    return _str(key, v, 1 << 16)


def _control_body(body: object) -> Mapping[str, Any]:
    if body is None:
        return {}
    if type(body) is not dict:
        raise InvalidRequest("body", f"must be a JSON object, got {_type_name(body)}")
    check_depth(body, 8)
    return body


def _abort_flag(body: Mapping[str, Any], default: bool) -> bool:
    flag: bool = _opt(body, "abort_all_requests", _bool, default)
    return flag


def parse_disk_body(body: object) -> tuple[UpdateFromDisk, bool]:
    """``/update_weights_from_disk`` -> the update and ``abort_all_requests`` (SGLang's default false)."""
    b = _control_body(body)
    path = b.get("model_path")
    if path is None or (type(path) is str and not path):
        raise InvalidRequest("model_path", "is required")
    op = UpdateFromDisk(
        path=_opt_str("model_path", path),
        version=_opt(b, "weight_version", _opt_str, None),
        load_format=_opt(b, "load_format", _opt_str, None),
        flush_cache=_opt(b, "flush_cache", _bool, True),
    )
    return op, _abort_flag(b, False)


def parse_distributed_body(body: object) -> tuple[UpdateFromDistributed, bool]:
    """``/update_weights_from_distributed`` -> the update and ``abort_all_requests``."""
    b = _control_body(body)
    names, dtypes, shapes = b.get("names"), b.get("dtypes"), b.get("shapes")
    for key, v in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if type(v) is not list:
            raise InvalidRequest(key, f"must be a list, got {_type_name(v)}")
    assert isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
    if not len(names) == len(dtypes) == len(shapes):
        raise InvalidRequest("names", "names, dtypes and shapes differ in length")
    if b.get("load_format") is not None:
        raise InvalidRequest("load_format", "only plain tensor broadcasts are supported (null)")
    specs = []
    for i, (n, d, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if type(shape) is not list:
            raise InvalidRequest(f"shapes[{i}]", f"must be a list of ints, got {_type_name(shape)}")
        dims = tuple(_int(f"shapes[{i}][{j}]", x, low=0) for j, x in enumerate(shape))
        specs.append(TensorSpec(_opt_str(f"names[{i}]", n), _opt_str(f"dtypes[{i}]", d), dims))
    try:
        bucket = WeightBucket(tuple(specs))
    except InvalidRequest as exc:
        raise InvalidRequest("names", exc.reason) from None
    op = UpdateFromDistributed(
        bucket=bucket,
        group_name=_opt(b, "group_name", _opt_str, "weight_update_group"),
        version=_opt(b, "weight_version", _opt_str, None),
        flush_cache=_opt(b, "flush_cache", _bool, True),
    )
    return op, _abort_flag(b, False)


def parse_init_group_body(body: object) -> InitWeightGroup:
    """``/init_weights_update_group`` -> the group (its fields named as SGLang's keys)."""
    b = _control_body(body)
    for key in ("master_address", "master_port", "world_size"):
        if b.get(key) is None:
            raise InvalidRequest(key, "is required")
    rank_offset: int = _opt(b, "rank_offset", _int, 1)
    try:
        group = WeightGroup(
            master_address=_opt_str("master_address", b["master_address"]),
            master_port=_int("master_port", b["master_port"]),
            world_size=_int("world_size", b["world_size"]),
            rank_offset=rank_offset,
            group_name=_opt(b, "group_name", _opt_str, "weight_update_group"),
            backend=_opt(b, "backend", _opt_str, "nccl"),
        )
    except InvalidRequest as exc:
        raise InvalidRequest(exc.field.removeprefix("group."), exc.reason) from None
    return InitWeightGroup(group=group, rank_offset=rank_offset)


def parse_set_version_body(body: object) -> tuple[SetVersion, bool]:
    """``/update_weight_version`` -> the label and ``abort_all_requests`` (SGLang's default true)."""
    b = _control_body(body)
    version = b.get("new_version")
    if version is None or (type(version) is str and not version):
        raise InvalidRequest("new_version", "must be a non-empty string")
    return SetVersion(version=_opt_str("new_version", version)), _abort_flag(b, True)


def parse_memory_body(body: object) -> tuple[MemoryTag, ...] | None:
    """``/release_memory_occupation`` and ``/resume_memory_occupation`` -> the tags (``None``: all)."""
    tags = _control_body(body).get("tags")
    if tags is None:
        return None
    if type(tags) is not list:
        raise InvalidRequest("tags", f"must be a list of memory tags or null, got {_type_name(tags)}")
    out = []
    for i, t in enumerate(tags):
        try:
            out.append(MemoryTag(_opt_str(f"tags[{i}]", t)))
        except ValueError:
            known = [m.value for m in MemoryTag]
            raise InvalidRequest(f"tags[{i}]", f"unknown memory tag {t!r} (known: {known})") from None
    return tuple(out)


def parse_pause_body(body: object) -> Pause:
    """``/pause_generation`` -> the pause (SGLang's default mode is ``abort``)."""
    mode = _opt(_control_body(body), "mode", _opt_str, "abort")
    try:
        return Pause(mode=PauseMode(mode))
    except ValueError:
        raise InvalidRequest("mode", f"unknown pause mode {mode!r} (known: {[m.value for m in PauseMode]})") from None


def parse_abort_body(body: object) -> AbortAll | AbortRequest | None:
    """``/abort_request`` -> abort all, one request by ``rid``, or nothing (neither set)."""
    b = _control_body(body)
    if _opt(b, "abort_all", _bool, False):
        return AbortAll()
    rid = _opt(b, "rid", _opt_str, "")
    return AbortRequest(request_id=rid) if rid else None


def parse_destroy_group_body(body: object) -> DestroyWeightGroup:
    """``/destroy_weights_update_group`` -> the group name."""
    return DestroyWeightGroup(group_name=_opt(_control_body(body), "group_name", _opt_str, "weight_update_group"))


@attrs.frozen(slots=True, kw_only=True)
class TensorsBody:
    """``/update_weights_from_tensor``'s body: ``payloads`` are SGLang's serialized named tensors
    (one per TP rank; the server decodes them), the rest as in :func:`tensors_body`."""

    payloads: tuple[str, ...]
    load_format: str | None
    version: str | None
    flush_cache: bool
    abort_all_requests: bool


def parse_tensors_body(body: object) -> TensorsBody:
    """``/update_weights_from_tensor`` -> its fields, typed (the payloads left encoded)."""
    b = _control_body(body)
    payloads = b.get("serialized_named_tensors")
    if type(payloads) is not list or not payloads:
        raise InvalidRequest("serialized_named_tensors", "must be a non-empty list (one entry per TP rank)")
    return TensorsBody(
        payloads=tuple(_str(f"serialized_named_tensors[{i}]", p, 1 << 40) for i, p in enumerate(payloads)),
        load_format=_opt(b, "load_format", _opt_str, None),
        version=_opt(b, "weight_version", _opt_str, None),
        flush_cache=_opt(b, "flush_cache", _bool, True),
        abort_all_requests=_abort_flag(b, False),
    )
