"""vLLM 0.26's token-in/token-out protocol both ways: ``POST /inference/v1/generate`` bodies built from
a ``GenerateRequest``, and its answers (whole, or streamed) read back into a ``Generation``.

Read from the ``vllm==0.26.0`` wheel: ``vllm/entrypoints/scale_out/token_in_token_out/{protocol,
serving,api_router}.py`` (the request and answer models, ``ServingTokens``), ``vllm/sampling_params.py``
(``SamplingParams`` and its checks), ``vllm/entrypoints/serve/utils/server_utils.py`` (error bodies).
What the code relies on, with the line of reasoning, is in ``docs/vllm.md``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from operator import countOf
from typing import Any

from rollout_backends import (
    BackendUnavailable,
    ContractViolation,
    FinishReason,
    GenerateRequest,
    Generation,
    InvalidRequest,
    Overloaded,
    RolloutBackendError,
)
from rollout_backends.kit import HttpResponse, json_loads

__all__ = [
    "REQUEST_ID_PREFIX",
    "assemble",
    "choice_tokens",
    "control_message",
    "engine_request_id",
    "error_of",
    "field_of",
    "finish_of",
    "generate_body",
    "parse_generate_answer",
    "parse_logprobs",
    "parse_prompt_logprobs",
    "usage_of",
]

#: ``ServingTokens.serve_tokens`` names every request ``generate-tokens-<body request_id>`` (or the
#: ``X-Request-Id`` header, which the adapter never sends): the id ``/abort_requests`` takes.
REQUEST_ID_PREFIX = "generate-tokens-"

#: vLLM's names (a ``param`` or a pydantic ``loc`` under ``sampling_params``) -> ours.
_SAMPLING_TO_OURS: Mapping[str, str] = {
    "max_tokens": "sampling.max_new_tokens",
    "min_tokens": "sampling.min_new_tokens",
    "logprobs": "sampling.top_logprobs",
    "prompt_logprobs": "prompt_logprobs_start",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "seed": "sampling.seed",
    "stop": "sampling.stop",
    "stop_token_ids": "sampling.stop_token_ids",
    "ignore_eos": "sampling.ignore_eos",
    "repetition_penalty": "sampling.repetition_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "presence_penalty": "sampling.presence_penalty",
}
_PROMPT_PARAMS = frozenset({"token_ids", "input_tokens", "input_text", "prompt"})


def engine_request_id(request_id: str) -> str:
    """The id vLLM holds a request by (what ``/abort_requests`` takes)."""
    return REQUEST_ID_PREFIX + request_id


def generate_body(request: GenerateRequest, *, top_logprobs_asked: int, stream: bool = False) -> dict[str, Any]:
    """The ``/inference/v1/generate`` body: every sampling value explicit (vLLM's defaults differ
    from ours: ``max_tokens`` 16, ``top_k`` 0), no detokenising (the answer carries ids only).

    ``top_logprobs_asked``: the ``logprobs`` value to send for ``sampling.top_logprobs`` (the wire
    asks one more than wanted; see ``VllmWire``)."""
    s = request.sampling
    sp: dict[str, Any] = {
        # vLLM refuses max_tokens 0: a re-scoring request generates one token, dropped when read.
        "max_tokens": max(s.max_new_tokens, 1),
        "min_tokens": s.min_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "repetition_penalty": s.repetition_penalty,
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        "ignore_eos": s.ignore_eos,
        "detokenize": False,
    }
    if s.top_k != -1:
        sp["top_k"] = s.top_k
    if s.stop_token_ids and not s.ignore_eos:
        # SGLang's rule (ours): ignore_eos also disables the stop ids; vLLM's ignore_eos does not.
        sp["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        sp["seed"] = s.seed
    if request.return_logprobs:
        sp["logprobs"] = top_logprobs_asked if s.top_logprobs else 0
    if request.prompt_logprobs_start is not None:
        sp["prompt_logprobs"] = 0  # each prompt token's own logprob (vLLM returns the whole prompt's)
    body: dict[str, Any] = {"request_id": request.request_id, "token_ids": list(request.input_ids)}
    body["sampling_params"] = sp
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # the closing chunk carries the usage
    return body


# -- errors ----------------------------------------------------------------------------------------


def field_of(param: object, message: str) -> str:
    """The field a vLLM refusal names (its ``error.param``: a ``VLLMValidationError`` parameter, or a
    pydantic ``loc`` such as ``body.sampling_params.max_tokens`` / ``body.token_ids.3``), in ours."""
    if isinstance(param, str) and param:
        parts = param.split(".")
        if parts[0] == "body":
            parts = parts[1:]
        if parts and parts[0] == "sampling_params":
            parts = parts[1:]
        if parts and parts[0] in _PROMPT_PARAMS:
            index = next((p for p in parts[1:] if p.isdigit()), None)
            return "input_ids" if index is None else f"input_ids[{index}]"
        if parts and parts[0] in _SAMPLING_TO_OURS:
            index = next((p for p in parts[1:] if p.isdigit()), None)
            return _SAMPLING_TO_OURS[parts[0]] + ("" if index is None else f"[{index}]")
    low = message.lower()
    if "token id" in low or "context length" in low or "token_ids" in low:
        return "input_ids"
    for key, ours in _SAMPLING_TO_OURS.items():
        if key in low:
            return ours
    return "request"


def _error_body(response: HttpResponse) -> tuple[object, str]:
    """``(param, message)`` of an error answer: vLLM's ``ErrorResponse`` (``{"error": {"message",
    "type", "param", "code"}}``), the RL routes' ``{"error": "..."}``, or plain text."""
    try:
        data = json_loads(response.body) if response.body else None
    except ValueError:
        return None, response.text[:500]
    err = data.get("error", data.get("detail")) if isinstance(data, dict) else None
    if isinstance(err, dict):
        return err.get("param"), str(err.get("message", err))
    if err is not None:
        return None, str(err)
    return None, response.text[:500]


def error_of(response: HttpResponse, *, what: str, worker: str | None = None) -> RolloutBackendError:
    """The error for a generation answer that is not HTTP 200."""
    status = response.status
    param, message = _error_body(response)
    if status in (400, 422):
        return InvalidRequest(field_of(param, message), message)
    if status in (429, 503):
        return Overloaded(f"{what}: HTTP {status}: {message}", worker=worker)
    if status == 404:
        return BackendUnavailable(f"{what}: HTTP 404: {message} (no such route or model)", worker=worker)
    if status >= 500:
        return BackendUnavailable(f"{what}: HTTP {status}: {message}", worker=worker)
    return ContractViolation(f"{what} answered HTTP {status}: {message}", worker=worker)


def control_message(response: HttpResponse) -> str:
    """What a refused control call said."""
    return _error_body(response)[1]


# -- answers ---------------------------------------------------------------------------------------

_TOKEN_ID = re.compile(r"token_id:(\d+)")


def _number(value: object, where: str, worker: str | None) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ContractViolation(f"{where} is not a number ({value!r})", worker=worker)
    return float(value)


def _int_list(value: object) -> bool:
    if not isinstance(value, list):
        return False
    return countOf(map(type, value), int) == len(value)


def _top_entries(entries: object, k: int, where: str, worker: str | None) -> tuple[tuple[int, float], ...]:
    """One token's ``top_logprobs`` (``[{"token": "token_id:<id>", "logprob"}]``, the sampled token
    first, then the best, as vLLM orders its dict; ``k + 1`` asked) -> the ``k`` best, best first."""
    if not isinstance(entries, list) or not entries:
        raise ContractViolation(f"{where} has no top logprobs", worker=worker)
    pairs: dict[int, float] = {}
    for e in entries:
        m = _TOKEN_ID.fullmatch(str(e.get("token"))) if isinstance(e, dict) else None
        if m is None:
            raise ContractViolation(f"{where}: an entry is not named token_id:<id> ({e!r})", worker=worker)
        pairs[int(m.group(1))] = _number(e.get("logprob"), where, worker)
    best = sorted(pairs.items(), key=lambda p: (-p[1], p[0]))
    if len(best) < k:
        raise ContractViolation(f"{where}: {len(best)} top logprobs for {k} asked", worker=worker)
    return tuple(best[:k])


def parse_logprobs(
    request: GenerateRequest, choice: Mapping[str, Any], ids: Sequence[int], worker: str | None
) -> tuple[tuple[float, ...] | None, tuple[tuple[tuple[int, float], ...], ...] | None]:
    """``choice.logprobs.content``: one entry per output token, aligned with ``ids`` (never padded)."""
    if not request.return_logprobs:
        return None, None
    lp_obj = choice.get("logprobs")
    content = lp_obj.get("content") if isinstance(lp_obj, dict) else None
    if content is None and not ids:
        content = []
    if not isinstance(content, list) or len(content) != len(ids):
        got = len(content) if isinstance(content, list) else type(content).__name__
        raise ContractViolation(f"{got} logprob entries for {len(ids)} output tokens (never padded)", worker=worker)
    k = request.sampling.top_logprobs
    lps: list[float] = []
    tops: list[tuple[tuple[int, float], ...]] = []
    for i, (entry, tok) in enumerate(zip(content, ids, strict=True)):
        where = f"logprobs.content[{i}]"
        if not isinstance(entry, dict) or entry.get("token") != f"token_id:{tok}":
            raise ContractViolation(f"{where} is not token {tok}'s ({entry!r:.120})", worker=worker)
        lps.append(_number(entry.get("logprob"), where, worker))
        if k:
            tops.append(_top_entries(entry.get("top_logprobs"), k, where, worker))
    return tuple(lps), (tuple(tops) if k else None)


def parse_prompt_logprobs(
    request: GenerateRequest, value: object, worker: str | None
) -> tuple[float | None, ...] | None:
    """``prompt_logprobs`` (the whole prompt's: ``[null, {"<id>": {"logprob", "rank",
    "decoded_token"}}, ...]``) -> from ``prompt_logprobs_start`` on, its first entry ``None``
    (SGLang's shape, ours: ``Generation.prompt_logprobs``)."""
    start = request.prompt_logprobs_start
    if start is None or not request.return_logprobs:
        return None
    ids = request.input_ids
    if not isinstance(value, list) or len(value) != len(ids):
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise ContractViolation(f"prompt_logprobs has {got} entries for {len(ids)} prompt tokens", worker=worker)
    out: list[float | None] = [None]
    for i in range(start + 1, len(ids)):
        entry = value[i]
        own = entry.get(str(ids[i])) if isinstance(entry, dict) else None
        if not isinstance(own, dict):
            raise ContractViolation(f"prompt_logprobs[{i}] has no entry for token {ids[i]}", worker=worker)
        out.append(_number(own.get("logprob"), f"prompt_logprobs[{i}]", worker))
    return tuple(out)


def finish_of(
    request: GenerateRequest, raw: object, ids: Sequence[int], worker: str | None
) -> tuple[FinishReason, int | None]:
    """vLLM's ``finish_reason`` (``FINISH_REASON_STRINGS``: stop, length, abort, error, repetition)."""
    if raw == "length":
        return FinishReason.LENGTH, None
    if raw == "abort":
        return FinishReason.ABORT, None
    if raw == "stop":
        # The EOS or stop token ends the output (vLLM keeps it in token_ids, as SGLang does).
        return FinishReason.STOP, (ids[-1] if ids else None)
    if raw == "error":
        raise BackendUnavailable("the engine failed the request (finish_reason 'error')", worker=worker)
    raise ContractViolation(f"unknown finish reason {raw!r}", worker=worker)


def assemble(
    request: GenerateRequest,
    ids: Sequence[int],
    logprobs: tuple[float, ...] | None,
    top: tuple[tuple[tuple[int, float], ...], ...] | None,
    *,
    finish: object,
    prompt_tokens: int,
    cached_tokens: int,
    prompt_logprobs: tuple[float | None, ...] | None,
    latency_s: float,
    worker: str | None,
) -> Generation:
    """The ``Generation`` of a whole output (its ids and their parsed logprobs) and its finish."""
    reason, matched = finish_of(request, finish, ids, worker)
    if request.sampling.max_new_tokens == 0:  # re-scoring: the one token generated is not the caller's
        ids, top, reason, matched = [], None, FinishReason.LENGTH, None
        logprobs = () if logprobs is not None else None
    return Generation(
        request_id=request.request_id,
        output_ids=tuple(ids),
        logprobs=logprobs,
        finish_reason=reason,
        weight_version=None,  # vLLM 0.26 reports none: the fleet stamps it
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        worker=worker,
        latency_s=latency_s,
        matched_stop=matched,
        top_logprobs=top,
        prompt_logprobs=prompt_logprobs,
    )


def choice_tokens(choice: Mapping[str, Any], worker: str | None) -> list[int]:
    """A choice's ``token_ids`` (``null`` read as none)."""
    ids = choice.get("token_ids")
    if ids is None:
        return []
    if not _int_list(ids):
        raise ContractViolation("choices[0].token_ids are not integers", worker=worker)
    assert isinstance(ids, list)
    return ids


def usage_of(data: Mapping[str, Any], request: GenerateRequest) -> tuple[int, int]:
    """``(prompt_tokens, cached_tokens)`` of an answer's ``usage`` (``cached_tokens`` only where the
    server runs with ``--enable-prompt-tokens-details``; else 0)."""
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    assert isinstance(usage, dict)
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (
        prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else len(request.input_ids),
        cached if isinstance(cached, int) and not isinstance(cached, bool) else 0,
    )


def parse_generate_answer(
    request: GenerateRequest, data: object, latency_s: float, *, worker: str | None
) -> Generation:
    """A whole ``GenerateResponse`` (``stream: false``)."""
    if not isinstance(data, dict):
        raise ContractViolation(f"/inference/v1/generate answered {type(data).__name__}, expected an object")
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise ContractViolation("/inference/v1/generate answered no single choice", worker=worker)
    prompt_tokens, cached = usage_of(data, request)
    choice = choices[0]
    ids = choice_tokens(choice, worker)
    logprobs, top = parse_logprobs(request, choice, ids, worker)
    return assemble(
        request,
        ids,
        logprobs,
        top,
        finish=choice.get("finish_reason"),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        prompt_logprobs=parse_prompt_logprobs(request, data.get("prompt_logprobs"), worker),
        latency_s=latency_s,
        worker=worker,
    )
