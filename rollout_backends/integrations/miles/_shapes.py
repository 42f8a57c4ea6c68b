"""SGLang's native shapes, as Miles sends and reads them, mapped to and from the protocol's values.

Shared by the custom generate function, the facade server and the engine actor class. The request
side is strict: a key SGLang knows but the protocol cannot honour (stop strings, LoRA, routed
experts, ...) is an ``InvalidRequest`` naming it, never silently dropped, because Miles would then
train on samples that lack what it asked for.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rollout_backends import FinishReason, Generation, InvalidRequest, SamplingParams

__all__ = [
    "TextOptions",
    "decode_tensor_payload",
    "decode_text",
    "finish_reason_body",
    "generation_body",
    "meta_info",
    "sampling_from_sglang",
]

#: SGLang ``sampling_params`` keys the protocol carries, with SGLang's name → ours.
_MAPPED = {
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "min_new_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "sampling_seed": "seed",
}
#: Keys that only shape the decoded text (handled here, not by the engine).
_TEXT_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
#: Keys the protocol cannot honour: accepted only when unset (None, empty, False, or 1 for ``n``).
_UNSUPPORTED_UNLESS_UNSET = {
    "stop": "stop strings are not part of the protocol; use stop_token_ids",
    "stop_regex": "stop regexes are not part of the protocol; use stop_token_ids",
    "logit_bias": "logit_bias is not part of the protocol",
    "json_schema": "constrained decoding is not part of the protocol",
    "regex": "constrained decoding is not part of the protocol",
    "ebnf": "constrained decoding is not part of the protocol",
    "structural_tag": "constrained decoding is not part of the protocol",
    "choice": "constrained decoding is not part of the protocol",
    "custom_params": "custom logit processors are not part of the protocol",
    "stream_interval": "set the stream interval on the engine (Dynamo: --dynamo-stream-interval), not per request",
    "beam_width": "beam search is not part of the protocol",
    "watermark": "watermarking is not part of the protocol",
}


@attrs.frozen(slots=True, kw_only=True)
class TextOptions:
    """SGLang's detokenisation options (defaults are SGLang's)."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False


def _unset(key: str, value: Any) -> bool:
    if key == "n":
        return value in (None, 1)
    return value is None or value is False or (isinstance(value, (str, list, tuple, dict)) and not value)


def _bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(field, f"must be a bool, got {type(value).__name__}")
    return value


def sampling_from_sglang(
    params: Mapping[str, Any] | None,
    *,
    field: str = "sampling_params",
    default_max_new_tokens: int = 128,
) -> tuple[SamplingParams, TextOptions]:
    """SGLang's ``sampling_params`` dict → ``SamplingParams`` plus the text options.

    ``None`` values mean "SGLang's default" (Miles sends ``stop_token_ids: None``). An unknown key
    is an ``InvalidRequest`` (SGLang's schema gate rejects unknown sampling keys too).
    """
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise InvalidRequest(field, f"must be an object, got {type(params).__name__}")
    ours: dict[str, Any] = {"max_new_tokens": default_max_new_tokens}
    text: dict[str, bool] = {}
    for key, value in params.items():
        if key in _MAPPED:
            if value is not None:
                ours[_MAPPED[key]] = value
        elif key == "stop_token_ids":
            if value is not None:
                if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                    raise InvalidRequest(f"{field}.stop_token_ids", "must be a list of token ids")
                ours["stop_token_ids"] = tuple(value)
        elif key in _TEXT_KEYS:
            if value is not None:
                text[key] = _bool(f"{field}.{key}", value)
        elif key in _UNSUPPORTED_UNLESS_UNSET or key == "n":
            if not _unset(key, value):
                why = _UNSUPPORTED_UNLESS_UNSET.get(key, "n > 1 is not supported: send n requests (one per sample)")
                raise InvalidRequest(f"{field}.{key}", why)
        else:
            raise InvalidRequest(f"{field}.{key}", "unknown sampling parameter")
    if ours.get("max_new_tokens") == 0:
        raise InvalidRequest(f"{field}.max_new_tokens", "0 (prefill-only logprob recompute) is not supported")
    try:
        sampling = SamplingParams(**ours)
    except InvalidRequest as exc:
        raise InvalidRequest(exc.field.replace("sampling.", f"{field}.", 1), exc.reason) from None
    return sampling, TextOptions(**text)


# -- responses -------------------------------------------------------------------------------


def finish_reason_body(gen: Generation) -> dict[str, Any]:
    """SGLang's ``meta_info.finish_reason`` object."""
    if gen.finish_reason is FinishReason.STOP:
        body: dict[str, Any] = {"type": "stop"}
        if gen.matched_stop is not None:
            body["matched"] = gen.matched_stop
        return body
    if gen.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": len(gen.output_ids)}
    return {"type": "abort", "message": "Aborted.", "status_code": None, "err_type": None}


def meta_info(gen: Generation, *, return_logprob: bool) -> dict[str, Any]:
    """SGLang's ``meta_info`` for one finished generation.

    ``weight_version`` is left out when the backend does not know it (Miles then records none,
    rather than a ``None`` that would read as a version).
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
    if return_logprob:
        lps = gen.logprobs if gen.logprobs is not None else (None,) * len(gen.output_ids)
        meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(lps, gen.output_ids, strict=True)]
    return meta


def generation_body(gen: Generation, *, text: str, return_logprob: bool) -> dict[str, Any]:
    """SGLang's native ``/generate`` response body for one request."""
    meta = meta_info(gen, return_logprob=return_logprob)
    return {"text": text, "output_ids": list(gen.output_ids), "meta_info": meta}


def decode_text(tokenizer: Any, gen: Generation, opts: TextOptions) -> str:
    """The ``text`` SGLang would return: the output decoded, the matched stop token trimmed unless
    ``no_stop_trim`` (``output_ids`` are never trimmed). ``""`` without a tokenizer."""
    if tokenizer is None:
        return ""
    ids = list(gen.output_ids)
    if (
        not opts.no_stop_trim
        and gen.finish_reason is FinishReason.STOP
        and gen.matched_stop is not None
        and ids
        and ids[-1] == gen.matched_stop
    ):
        ids = ids[:-1]
    try:
        text = tokenizer.decode(
            ids,
            skip_special_tokens=opts.skip_special_tokens,
            spaces_between_special_tokens=opts.spaces_between_special_tokens,
        )
    except TypeError:  # tokenizers without the (slow-tokenizer only) spacing option
        text = tokenizer.decode(ids, skip_special_tokens=opts.skip_special_tokens)
    return str(text)


# -- update_weights_from_tensor payloads ---------------------------------------------------------


class _FlattenedTensorMetadata:
    """Stands in for ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` when unpickling
    (a dataclass: name, shape, dtype, start_idx, end_idx, numel)."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


_SGLANG_CLASSES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): _FlattenedTensorMetadata,
}
_ALLOWED_BUILTINS = {"list", "tuple", "dict", "int", "float", "str", "bytes", "bool", "slice", "getattr"}
_ALLOWED_PREFIXES = ("torch.", "torch", "multiprocessing.", "collections")


class _PayloadUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        stand_in = _SGLANG_CLASSES.get((module, name))
        if stand_in is not None:
            return stand_in
        if (module == "builtins" and name in _ALLOWED_BUILTINS) or module.startswith(_ALLOWED_PREFIXES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a tensor payload")


def _unflatten(bucket: Mapping[str, Any]) -> list[tuple[str, Any]]:
    flat = bucket.get("flattened_tensor")
    metadata = bucket.get("metadata")
    if flat is None or not isinstance(metadata, list):
        raise InvalidRequest("serialized_named_tensors", "flattened_bucket payload lacks flattened_tensor/metadata")
    out: list[tuple[str, Any]] = []
    for m in metadata:
        piece = flat[m.start_idx : m.end_idx]
        if piece.dtype != m.dtype:  # multi-dtype buckets are flattened as bytes
            piece = piece.view(m.dtype)
        out.append((str(m.name), piece.reshape(m.shape)))
    return out


def decode_tensor_payload(payload: str, load_format: str | None) -> list[tuple[str, Any]]:
    """One TP rank's ``serialized_named_tensors`` entry (SGLang's ``MultiprocessingSerializer``
    string) → ``[(name, tensor), ...]``. ``load_format`` ``None``/``"direct"`` is a list of pairs;
    ``"flattened_bucket"`` is Miles' colocated bucket (unflattened here, so the backend gets plain
    named tensors). Any other load format is an ``InvalidRequest``."""
    import base64

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions for unpickling)

    if load_format not in (None, "direct", "flattened_bucket"):
        known = "null, 'direct' or 'flattened_bucket'"
        raise InvalidRequest("load_format", f"{load_format!r} is not supported (use {known})")
    if not isinstance(payload, str):
        raise InvalidRequest("serialized_named_tensors", f"entries must be strings, got {type(payload).__name__}")
    try:
        obj = _PayloadUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    except Exception as exc:
        raise InvalidRequest("serialized_named_tensors", f"not a valid tensor payload: {exc}") from exc
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict):
            raise InvalidRequest("serialized_named_tensors", "flattened_bucket payload is not a dict")
        return _unflatten(obj)
    if not isinstance(obj, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in obj):
        raise InvalidRequest("serialized_named_tensors", "payload is not a list of (name, tensor)")
    return [(str(n), t) for n, t in obj]
