"""A Python Dynamo worker around any engine with the reference engine's interface (Dynamo 1.4.2).

The process registers with Dynamo's discovery exactly like ``dynamo.sglang`` does: a
``DistributedRuntime``, an endpoint ``{namespace}.{component}.generate`` served by a Python async
generator, and a model card registered with ``register_model(ModelInput.Tokens, ...)``. The
frontend (``python -m dynamo.frontend``) tokenizes, routes and detokenizes; this worker receives
the *preprocessed* request (``token_ids``, ``stop_conditions``, ``sampling_options``,
``output_options``, ``eos_token_ids``, ...) and yields ``LLMEngineOutput``-shaped chunks
(``token_ids``, ``log_probs``, ``finish_reason``, ``completion_usage``, ``index``).

One chunk is yielded per generated token, with that token's logprob, so per-token logprobs are
exact whatever the frontend does with chunk boundaries.

**Native ``/generate`` (ai-dynamo 1.6.x).** The worker also publishes the ``sglang_generate``
capability on its model card, like ``dynamo.sglang`` 1.6.x. A 1.6.x frontend started with
``DYN_SGLANG_ENABLE_GENERATE=1`` then routes ``POST /generate`` (SGLang's native body) here: the
request carries SGLang's body under ``extra_args.sglang_tito`` and the worker answers with native
SGLang response objects under ``engine_data.sglang_response``, which the frontend forwards
verbatim as SSE events. Nothing on that path is f32 (values stay JSON numbers end to end), and
``meta_info`` carries the served ``weight_version``, the raw finish reason (``abort`` included) and
this worker's name. A 1.4.x frontend ignores the capability.

Control goes through *engine routes* on the worker's system port (``DYN_SYSTEM_PORT``):
``POST http://127.0.0.1:$DYN_SYSTEM_PORT/engine/<route>``. The paths and bodies are the ones
``dynamo.sglang`` 1.4.2 registers (``control/update_weights_from_disk``, ...,
``call_tokenizer_manager`` with SGLang ``TokenizerManager`` method names), so one adapter drives
both this worker and a real ``dynamo.sglang`` worker. Two additions that ``dynamo.sglang`` lacks
are under ``rollout/`` (``rollout/weight_version``, ``rollout/abort``).

Usage (the adapter's launcher does this)::

    DYN_SYSTEM_PORT=18081 DYN_SYSTEM_HOST=127.0.0.1 DYN_TCP_RPC_HOST=127.0.0.1 \
    DYN_TCP_RESPONSE_STREAM_HOST=lo DYN_FILE_KV=/run/kv \
    python -m rollout_backends.adapters.dynamo._worker --engine pkg.mod:factory \
        --model-path /m/tiny --served-model-name tiny --namespace ns1

``factory`` is called with the parsed args' ``engine_arg`` (a JSON string, may be empty) and must
return the engine object (or an awaitable of it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import math
import os
import signal
import struct
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import attrs

from rollout_backends import FinishReason, GenerateRequest, Generation, InvalidRequest, MemoryTag, PauseMode
from rollout_backends.sglang_native import (
    NativeRequest,
    ParseRules,
    error_body,
    meta_info,
    native_field,
    parse_disk_body,
    parse_memory_body,
    parse_request,
    parse_set_version_body,
    parse_tensors_body,
)

from ._detok import IncrementalDetokenizer, TextDecoder, load_text_decoder, worker_text_enabled
from ._wire import CHUNK_VERSION_KEY, rid_from_annotations

__all__ = [
    "DynamoWorker",
    "build_generate_request",
    "build_native_request",
    "main",
    "native_chunk",
    "native_payload",
    "preprocessed_body",
    "refusal",
    "refusal_chunk",
    "run_worker",
    "token_versions",
]

logger = logging.getLogger("rollout_backends.dynamo_worker")
_LOG_REQUESTS = os.environ.get("ROLLOUT_DYN_LOG_REQUESTS", "") not in ("", "0")

#: Model-card key (``runtime_config`` engine-specific) a 1.6.x frontend routes ``/generate`` by.
SGLANG_GENERATE_CAPABILITY = "sglang_generate"
#: ``extra_args`` key under which a 1.6.x frontend passes the native ``/generate`` body.
NATIVE_PAYLOAD_KEY = "sglang_tito"

#: Dynamo's finish-reason strings (``FinishReason`` in dynamo-llm). ``dynamo.sglang`` maps SGLang's
#: ``abort`` to ``cancelled``; the frontend then reports it to the client.
_FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "cancelled",
}


def _resolve_io_struct(arg: Any) -> Any:
    """``{"io_struct.Cls": {...}}`` (dynamo.sglang's typed-argument encoding) -> ``(Cls, {...})``."""
    if isinstance(arg, dict) and len(arg) == 1:
        key = next(iter(arg))
        if isinstance(key, str) and key.startswith("io_struct."):
            return key[len("io_struct.") :], dict(arg[key] or {})
    return None


def f32_to_decimal(value: float) -> float:
    """The shortest decimal that rounds to the same float32 as ``value``.

    The frontend parses sampling floats as f32 (``temperature: 0.7`` arrives as
    ``0.699999988079071``); the client's value was a short decimal, so this recovers it exactly and
    the engine samples with what the client sent (the in-process backend's value).
    """
    if not math.isfinite(value):
        return value
    target = struct.unpack("<f", struct.pack("<f", value))[0]
    for digits in range(1, 10):
        candidate = float(f"{target:.{digits}g}")
        if struct.unpack("<f", struct.pack("<f", candidate))[0] == target:
            return candidate
    return value


_DEFAULT_RULES = ParseRules()


def preprocessed_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """Dynamo's preprocessed request as SGLang's native ``/generate`` body, so the codec's one rule
    checks it (:func:`build_generate_request`).

    Dynamo 1.4.2 puts the user's integer ``stop`` list into ``stop_conditions.stop_token_ids`` and
    the model's EOS ids into both ``stop_token_ids_hidden`` and ``eos_token_ids``; all become
    ``stop_token_ids``. With ``ignore_eos`` the frontend already sends none of them.
    """
    stop = request.get("stop_conditions") or {}
    samp = request.get("sampling_options") or {}
    stop_ids: list[Any] = []
    for t in (*(stop.get("stop_token_ids") or ()), *(stop.get("stop_token_ids_hidden") or ()),
              *(request.get("eos_token_ids") or ())):  # fmt: skip
        if t not in stop_ids:
            stop_ids.append(t)
    sp: dict[str, Any] = {"stop_token_ids": stop_ids, "ignore_eos": bool(stop.get("ignore_eos") or False)}
    if stop.get("max_tokens") is not None:
        sp["max_new_tokens"] = stop["max_tokens"]
    if stop.get("min_tokens") is not None:
        sp["min_new_tokens"] = stop["min_tokens"]
    if stop.get("stop"):
        # Text stop sequences: the frontend matches them too, but the engine stops on the same token
        # (SGLang's rule), so the stream ends with this worker's last chunk and its engine_data.
        sp["stop"] = stop["stop"]
    for key in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        v = samp.get(key)
        if v is not None:
            sp[key] = f32_to_decimal(float(v)) if type(v) is float else v
    k = samp.get("top_k")
    if k is not None:
        sp["top_k"] = -1 if type(k) is int and k <= 0 else k
    if samp.get("seed") is not None:
        sp["sampling_seed"] = samp["seed"]
    # Always computed: the chunk carries them and the frontend drops them unless asked.
    body: dict[str, Any] = {"input_ids": request.get("token_ids"), "sampling_params": sp, "return_logprob": True}
    # ``logprobs: k`` of /v1/completions: k alternatives per token (0: the chosen token's only).
    top = (request.get("output_options") or {}).get("logprobs")
    if top:
        body["top_logprobs_num"] = top
    # ``prompt_logprobs: k`` (the Dynamo wire sends 0): the whole prompt's, from position 0.
    if (request.get("output_options") or {}).get("prompt_logprobs") is not None:
        body["logprob_start_len"] = 0
    return body


def build_generate_request(
    request: Mapping[str, Any], request_id: str, *, rules: ParseRules = _DEFAULT_RULES
) -> GenerateRequest:
    """Map Dynamo's preprocessed request onto ``GenerateRequest`` through the codec; an
    ``InvalidRequest`` names the field natively (``sampling_params.max_new_tokens``)."""
    body = preprocessed_body(request)
    body["rid"] = request_id
    return parse_request(body, rules=rules).request


def native_payload(request: Mapping[str, Any]) -> dict[str, Any] | None:
    """The native SGLang ``/generate`` body a 1.6.x frontend forwarded (``extra_args.sglang_tito``), if any."""
    extra = request.get("extra_args")
    payload = extra.get(NATIVE_PAYLOAD_KEY) if isinstance(extra, dict) else None
    return payload if isinstance(payload, dict) else None


def build_native_request(
    request: Mapping[str, Any], payload: Mapping[str, Any], request_id: str, *, rules: ParseRules = _DEFAULT_RULES
) -> NativeRequest:
    """A native ``/generate`` body (SGLang's, as the client sent it) -> the request, by the codec's
    one strictness rule (the SGLang wire's and the reference server's: floats as sent, no f32).

    The engine applies the model's EOS itself (as SGLang does); the frontend sends none on this path.
    ``stream: true`` is accepted (the 1.6 frontend always streams); the prompt is the body's
    ``input_ids``, else the frontend's ``token_ids``."""
    body = dict(payload)
    if body.get("input_ids") is None and body.get("text") is None:
        body["input_ids"] = request.get("token_ids")
    if body.get("rid") is None:  # the caller's own rid is checked as sent (the frontend keeps it)
        body["rid"] = request_id
    return parse_request(body, rules=attrs.evolve(rules, allow_stream=True))


def native_chunk(
    gen: Generation, return_logprob: bool, worker_name: str | None, input_ids: Sequence[int] | None = None
) -> dict[str, Any]:
    """The whole generation as one SGLang incremental response (the codec's ``meta_info``), wrapped
    the way ``dynamo.sglang`` 1.6.x wraps it (``engine_data.sglang_response``; the frontend forwards
    it as one SSE event).

    ``output_ids`` holds every new token (SGLang's incremental mode allows several per event; the
    engine produced them all before the first chunk anyway). ``meta_info.worker`` is not SGLang's:
    it names this worker, which the frontend does not report on this path.
    """
    meta = meta_info(
        gen, return_logprob=return_logprob and gen.logprobs is not None, worker=worker_name, input_ids=input_ids
    )
    response = {"output_ids": list(gen.output_ids), "meta_info": meta}
    return {"token_ids": [], "index": 0, "engine_data": {"sglang_response": response}}


def refusal_chunk(exc: InvalidRequest, request: Mapping[str, Any], *, native: bool) -> dict[str, Any]:
    """The caller's mistake as the stream's one chunk, for a caller that reads it: the frontend
    forwards ``engine_data`` verbatim, while any error raised in a worker reaches the client as
    HTTP 500 "Failed to fold completions stream" (Dynamo 1.4.2, measured), which reads as the
    fleet's failure and is retried.

    ``exc`` names the field natively (the codec's spelling). Native path: SGLang's error object as
    the SSE event (the codec's :func:`error_body`); else a finished empty chunk whose
    ``engine_data.refused`` names the field. The Dynamo wire reads both back as ``InvalidRequest``."""
    if native:
        return {"token_ids": [], "index": 0, "engine_data": {"sglang_response": error_body(exc)}}
    prompt = len(request.get("token_ids") or ())
    return {
        "token_ids": [],
        "index": 0,
        "finish_reason": _FINISH[FinishReason.ABORT],
        "completion_usage": {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt},
        "engine_data": {"refused": {"param": exc.field, "message": str(exc)}},
    }


def token_versions(gen: Generation) -> list[str | None]:
    """The version each output token was generated under: from the engine's ``version_spans``
    (the reference engine records the version at every step, so a generation that crossed an
    update says which tokens are whose), else the version at the finish for all."""
    versions: list[str | None] = [gen.weight_version] * len(gen.output_ids)
    spans = gen.version_spans or ()
    for k, (at, version) in enumerate(spans):
        end = spans[k + 1][0] if k + 1 < len(spans) else len(versions)
        versions[at:end] = [version] * (end - at)
    return versions


def refusal(exc: InvalidRequest) -> Exception:
    """The caller's mistake as Dynamo's ``HttpError(400)``, which the frontend answers as HTTP 400
    with its message (as ``dynamo.sglang`` does for out-of-vocabulary ids); the message names the
    field natively (``exc``'s, the codec's spelling), which the wire reads back
    (:func:`~rollout_backends.sglang_native.named_field`). Without Dynamo (unit tests), ``exc``."""
    try:
        from dynamo.llm.exceptions import HttpError
    except ImportError:
        return exc
    return HttpError(400, str(exc))


class DynamoWorker:
    """Serves one engine as a Dynamo worker. ``engine`` has the reference engine's interface."""

    def __init__(
        self,
        engine: Any,
        *,
        namespace: str,
        model_path: str,
        served_model_name: str,
        component: str = "backend",
        endpoint: str = "generate",
        discovery_backend: str = "file",
        request_plane: str = "tcp",
        event_plane: str | None = "zmq",
        kv_cache_block_size: int = 16,
        context_length: int | None = None,
        worker_name: str | None = None,
        detokenize: bool | None = None,
    ) -> None:
        self.engine = engine
        #: Our own char-safe detokenizer (``_detok``): chunks that carry ``text`` skip the 1.4.2
        #: frontend's decoder, which panics on some UTF-8 splits. None: the frontend detokenizes.
        if detokenize is None:
            detokenize = worker_text_enabled()
        self.text_decoder: TextDecoder | None = load_text_decoder(model_path) if detokenize else None
        #: Stamped into each response's engine_data; defaults to the system port's URL.
        self.worker_name = worker_name or (
            f"http://{os.environ.get('DYN_SYSTEM_HOST', '127.0.0.1')}:{os.environ['DYN_SYSTEM_PORT']}"
            if os.environ.get("DYN_SYSTEM_PORT")
            else None
        )
        self.namespace = namespace
        self.component = component
        self.endpoint_name = endpoint
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.discovery_backend = discovery_backend
        self.request_plane = request_plane
        self.event_plane = event_plane
        self.kv_cache_block_size = kv_cache_block_size
        self.context_length = context_length
        self.runtime: Any = None
        self.generate_endpoint: Any = None
        self._inflight: dict[str, asyncio.Task[Generation]] = {}
        self._parse_rules: ParseRules | None = None
        self.paused: PauseMode | None = None

    # -- data plane ----------------------------------------------------------------------------

    async def generate(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        """Dynamo generate handler: one chunk per token, the last one with finish reason and usage."""
        # Our request id: the client's ``nvext.annotations: ["rid:<id>"]`` (any string), else the
        # frontend's context id (header ``x-dynamo-request-id`` when it is a UUID, else random).
        rid = rid_from_annotations(request) or (context.id() if context is not None else os.urandom(8).hex())
        if _LOG_REQUESTS:
            logger.info("generate rid=%s trace_id=%s request=%s", rid, getattr(context, "trace_id", None), request)
        native = native_payload(request)
        # Our wire names the request in an annotation and reads engine_data: it gets the refusal
        # as a chunk it parses; other clients get Dynamo's HttpError(400).
        ours = native is not None or rid_from_annotations(request) is not None
        try:
            if native is None:
                greq = build_generate_request(request, rid, rules=self._rules())
                return_logprob = True
            else:
                parsed = build_native_request(request, native, rid, rules=self._rules())
                greq, return_logprob = parsed.request, parsed.request.return_logprobs
            rid = greq.request_id
            if rid in self._inflight:
                # SGLang's words. Refused, not merged: an abort by this id would stop both.
                raise InvalidRequest("rid", f"Duplicate request ID detected: {rid}")
        except InvalidRequest as exc:
            if not ours:
                raise refusal(exc) from None
            yield refusal_chunk(exc, request, native=native is not None)
            return
        task = asyncio.ensure_future(self.engine.generate(greq))
        self._inflight[rid] = task
        stopped = asyncio.ensure_future(context.async_killed_or_stopped()) if context is not None else None
        try:
            if stopped is not None:
                done, _ = await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if task not in done:
                    logger.info("request %s stopped by the frontend (client gone): aborting", rid)
                    # Client went away (or the frontend stopped the stream): abort in the engine and
                    # still finish the stream cleanly with the partial result.
                    with contextlib.suppress(Exception):
                        await _maybe_await(self.engine.abort(rid))
            gen = await task
        except InvalidRequest as exc:  # the engine's own checks, in our field names
            refused: InvalidRequest | None = InvalidRequest(native_field(exc.field), exc.reason)
        else:
            refused = None
        finally:
            self._inflight.pop(rid, None)
            if stopped is not None and not stopped.done():
                stopped.cancel()
        if refused is not None:
            if not ours:
                raise refusal(refused) from None
            yield refusal_chunk(refused, request, native=native is not None)
            return
        if native is not None:
            yield native_chunk(gen, return_logprob, self.worker_name, input_ids=greq.input_ids)
            return
        for chunk in self._chunks(gen, request):
            yield chunk

    def _rules(self) -> ParseRules:
        """What this worker's engine can take: its vocabulary, and SGLang's context rule (refused,
        never clamped; the 1.4.2 frontend sends no ``max_tokens`` it was not given, measured)."""
        if self._parse_rules is None:
            vocab = getattr(self.engine, "vocab_size", None)
            ctx = self.context_length or getattr(self.engine, "max_context", None)
            self._parse_rules = ParseRules(
                vocab_size=int(vocab) if vocab is not None else None,
                max_context=int(ctx) if ctx is not None else None,
                # The engine matches stop strings itself (SGLang's rule) when it has a tokenizer.
                stop_strings=bool(getattr(self.engine, "has_tokenizer", False)),
            )
        return self._parse_rules

    def _chunks(self, gen: Generation, request: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        ids = list(gen.output_ids)
        lps = list(gen.logprobs) if gen.logprobs is not None else None
        tops = gen.top_logprobs
        versions = token_versions(gen)
        chunks: list[dict[str, Any]] = []
        for i, t in enumerate(ids):
            c: dict[str, Any] = {"token_ids": [t], "index": 0}
            if versions[i] is not None:
                # The version this token was generated under; the frontend forwards a non-final
                # chunk's engine_data as that SSE chunk's nvext.engine_data (1.4.2 and 1.6.1,
                # measured), and the wire reads a chunk whose engine_data holds only this key as
                # not the last.
                c["engine_data"] = {CHUNK_VERSION_KEY: versions[i]}
            if lps is not None:
                c["log_probs"] = [float(lps[i])]
            if tops is not None:
                # Dynamo's chunk shape (dynamo.common.backend.logprobs): per token, ranked entries.
                # The token is named by id: the frontend keys its OpenAI top_logprobs by this string,
                # and two ids can decode to the same text.
                c["top_logprobs"] = [
                    [
                        {"rank": r + 1, "token_id": tid, "token": f"token_id:{tid}", "logprob": float(lp)}
                        for r, (tid, lp) in enumerate(tops[i])
                    ]
                ]
            chunks.append(c)
        if not chunks:
            chunks.append({"token_ids": [], "index": 0})
        self._add_text(chunks, request or {})
        last = chunks[-1]
        last["finish_reason"] = _FINISH[gen.finish_reason]
        if gen.finish_reason is FinishReason.STOP and isinstance(gen.matched_stop, int):
            last["stop_reason"] = gen.matched_stop
        usage: dict[str, Any] = {
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": len(ids),
            "total_tokens": gen.prompt_tokens + len(ids),
        }
        if gen.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": gen.cached_tokens}
        last["completion_usage"] = usage
        # Dynamo 1.4.2 forwards the final chunk's engine_data verbatim as nvext.engine_data (when the
        # client asks for extra_fields ["engine_data"]). It carries what the OpenAI shape loses: the
        # served weight version, and ABORT (the frontend reports "cancelled" as "stop").
        last["engine_data"] = {
            **(last.get("engine_data") or {}),
            "weight_version": gen.weight_version,
            "finish_reason": gen.finish_reason.value,
            "worker": self.worker_name,
        }
        if gen.prompt_logprobs is not None:
            # The 1.4.2 frontend renders no prompt logprobs in /v1/completions (echo and
            # prompt_logprobs reach the worker, nothing comes back; measured): engine_data carries
            # them, from prompt position 0 (the first None), unrounded.
            last["engine_data"]["prompt_logprobs"] = list(gen.prompt_logprobs)
        return chunks

    def _add_text(self, chunks: list[dict[str, Any]], request: Mapping[str, Any]) -> None:
        """Give every chunk ``text`` and ``tokens`` so the frontend does not detokenize (``_detok``).

        Not when the request has text stop sequences: only the frontend's decoder matches those (the
        engine sees token ids), so it must keep decoding.
        """
        if self.text_decoder is None or (request.get("stop_conditions") or {}).get("stop"):
            return
        skip = bool((request.get("output_options") or {}).get("skip_special_tokens") or False)
        detok = IncrementalDetokenizer(self.text_decoder, request.get("token_ids") or (), skip_special_tokens=skip)
        for i, c in enumerate(chunks):
            c["tokens"], c["text"] = detok.chunk(c["token_ids"], last=i == len(chunks) - 1)

    # -- engine routes (dynamo.sglang 1.4.2 paths and bodies) --------------------------------------

    # Bodies are parsed by the codec (the inverses of the builders the wire sends): a wrong value is
    # ``success: false`` naming its key (``_json_safe``), never read by truthiness.

    async def _update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        op, abort_all = parse_disk_body(body)
        if abort_all:
            await self._abort_all()
        try:
            await _maybe_await(
                self.engine.update_weights_from_disk(
                    op.path, load_format=op.load_format, version=op.version, flush_cache=op.flush_cache
                )
            )
        except Exception as e:  # SGLang answers 200 + success false
            return {"success": False, "message": f"{type(e).__name__}: {e}", "num_paused_requests": 0}
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    async def _update_weights_from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        # SGLang's body: serialized_named_tensors = one base64 string per TP rank, each a
        # ForkingPickler dump of [(name, tensor), ...]. TP = 1 here.
        tb = parse_tensors_body(body)
        try:
            from rollout_backends.kit import decode_tensor_payload

            named = decode_tensor_payload(tb.payloads[0], tb.load_format)
            await _maybe_await(
                self.engine.update_weights_from_tensors(
                    named, version=tb.version, flush_cache=tb.flush_cache, load_format=tb.load_format
                )
            )
        except Exception as e:
            return {"success": False, "message": f"{type(e).__name__}: {e}"}
        return {"success": True, "message": "Succeeded to update model weights."}

    async def _update_weights_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            await _maybe_await(
                self.engine.update_weights_from_distributed(
                    list(body["names"]),
                    list(body["dtypes"]),
                    [list(x) for x in body["shapes"]],
                    group_name=body.get("group_name", "weight_update_group"),
                    version=body.get("weight_version"),
                    flush_cache=bool(body.get("flush_cache", True)),
                    load_format=body.get("load_format"),
                )
            )
        except Exception as e:
            return {"success": False, "message": f"{type(e).__name__}: {e}"}
        return {"success": True, "message": "Succeeded to update parameter online."}

    async def _update_weights_from_ipc(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"success": False, "message": "update_weights_from_ipc is not supported by this worker"}

    async def _update_weight_version(self, body: dict[str, Any]) -> dict[str, Any]:
        # Same as dynamo.sglang: abort_all_requests defaults to True in SGLang's struct.
        op, abort_all = parse_set_version_body(body)
        if abort_all:
            await self._abort_all()
        await _maybe_await(self.engine.set_weight_version(op.version))
        return {"success": True, "message": f"Weight version updated to {op.version}", "new_version": op.version}

    async def _release_memory(self, body: dict[str, Any]) -> dict[str, Any]:
        tags = _tag_values(parse_memory_body(body))
        try:
            await _maybe_await(self.engine.release_memory(tags))
        except Exception as e:
            return {"status": "error", "message": str(e)}
        return {"status": "ok", "message": "Memory released"}

    async def _resume_memory(self, body: dict[str, Any]) -> dict[str, Any]:
        tags = _tag_values(parse_memory_body(body))
        try:
            await _maybe_await(self.engine.resume_memory(tags))
        except Exception as e:
            return {"status": "error", "message": str(e)}
        return {"status": "ok", "message": "Memory resumed"}

    async def _start_profile(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"status": "ok", "message": "Profiling started"}

    async def _stop_profile(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"status": "ok", "message": "Profiling stopped"}

    async def _abort_all(self) -> None:
        abort_all = getattr(self.engine, "abort_all", None)
        if abort_all is not None:
            await _maybe_await(abort_all())
            return
        for rid in list(self._inflight):
            with contextlib.suppress(Exception):
                await _maybe_await(self.engine.abort(rid))

    async def _call_tokenizer_manager(self, body: dict[str, Any]) -> dict[str, Any]:
        """``{"method", "args", "kwargs"}`` like dynamo.sglang's RLMixin, for the TM methods RL needs.

        Results are normalized the way dynamo.sglang does: ``None`` -> ``{"status": "ok"}``,
        ``(ok, msg)`` -> ``{"success", "message"}``, a dataclass -> its fields.
        """
        method = body["method"]
        args = list(body.get("args") or [])
        kwargs = dict(body.get("kwargs") or {})

        def typed(i: int, key: str) -> dict[str, Any]:
            """The i-th positional arg or kwarg ``key``, as a plain dict of the io_struct's fields."""
            v = args[i] if i < len(args) else kwargs.get(key, kwargs.get("obj", {}))
            r = _resolve_io_struct(v)
            return r[1] if r else dict(v or {})

        if method == "pause_generation":
            mode = typed(0, "obj").get("mode", "abort")
            await _maybe_await(self.engine.pause(PauseMode(mode)))
            self.paused = PauseMode(mode)
            return {"status": "ok"}
        if method == "continue_generation":
            await _maybe_await(self.engine.resume())
            self.paused = None
            return {"status": "ok"}
        if method == "flush_cache":
            try:
                wait_s = float(kwargs.get("timeout_s") or 0.0)  # TokenizerManager.flush_cache(timeout_s=)
                await _maybe_await(self.engine.flush_cache(wait_s=wait_s))
            except Exception as e:
                return {"success": False, "message": str(e)}
            return {"success": True, "message": ""}
        if method == "init_weights_update_group":
            f = typed(0, "obj")
            try:
                await _maybe_await(
                    self.engine.init_weight_group(
                        str(f["master_address"]),
                        int(f["master_port"]),
                        int(f["rank_offset"]),
                        int(f["world_size"]),
                        str(f.get("group_name", "weight_update_group")),
                        str(f.get("backend", "nccl")),
                    )
                )
            except Exception as e:
                return {"success": False, "message": f"{type(e).__name__}: {e}"}
            return {"success": True, "message": "Succeeded to initialize custom process group."}
        if method == "destroy_weights_update_group":
            f = typed(0, "obj")
            try:
                await _maybe_await(self.engine.destroy_weight_group(f.get("group_name", "weight_update_group")))
            except Exception as e:
                return {"success": False, "message": str(e)}
            return {"success": True, "message": "Succeeded to destroy custom process group."}
        if method == "get_internal_state":
            # SGLang 0.5.16: one state per DP rank, each vars(ServerArgs) and load figures
            # (Scheduler.get_internal_state); dynamo.sglang 1.4.2 answers the list as {"result": [...]}
            # (RLMixin._normalize_result). connect() reads enable_memory_saver from it (_memory_saver.py).
            return {"result": [{**await self._server_args({}), "last_gen_throughput": 0.0}]}
        if method == "abort_request":
            rid = args[0] if args else kwargs.get("rid", "")
            if kwargs.get("abort_all") or (len(args) > 1 and args[1]):
                await self._abort_all()
            elif rid:
                await _maybe_await(self.engine.abort(str(rid)))
            return {"status": "ok"}
        raise ValueError(f"call_tokenizer_manager: method {method!r} is not supported by this worker")

    async def _weight_version(self, body: dict[str, Any]) -> dict[str, Any]:
        v = self.engine.weight_version
        v = v() if callable(v) else v
        v = await _maybe_await(v)
        return {"weight_version": v}

    async def _info(self, body: dict[str, Any]) -> dict[str, Any]:
        v = self.engine.weight_version
        v = await _maybe_await(v() if callable(v) else v)
        return {
            "instance_id": self.generate_endpoint.connection_id() if self.generate_endpoint is not None else None,
            "worker": self.worker_name,
            "weight_version": v,
            "inflight": sorted(self._inflight),
            "paused": None if self.paused is None else self.paused.value,
            "vocab_size": getattr(self.engine, "vocab_size", None),
            "max_context": getattr(self.engine, "max_context", None),
            "eos_token_ids": list(getattr(self.engine, "eos_token_ids", ()) or ()),
            "served_model_name": self.served_model_name,
            "native_generate": True,  # the model card advertises sglang_generate (see run())
        }

    async def _server_args(self, body: dict[str, Any]) -> dict[str, Any]:
        """The engine settings a benchmark compares across fleets (the shim's route of the same
        name answers SGLang's resolved ``ServerArgs``); ``enable_memory_saver`` where the engine says
        it (the reference engine: what its SGLang-shaped server reports, ``ENABLE_MEMORY_SAVER`` of
        ``adapters/reference/_engine.py``)."""
        args: dict[str, Any] = {
            "page_size": self.kv_cache_block_size,
            "context_length": self.context_length or getattr(self.engine, "max_context", None),
            "skip_tokenizer_init": True,
            "tp_size": 1,
            "dp_size": 1,
        }
        saver = getattr(self.engine, "enable_memory_saver", None)
        if isinstance(saver, bool):
            args["enable_memory_saver"] = saver
        return args

    async def _abort(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("abort_all"):
            await self._abort_all()
        else:
            found = await _maybe_await(self.engine.abort(str(body["rid"])))
            return {"status": "ok", "found": bool(found) if found is not None else None}
        return {"status": "ok"}

    def routes(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        return {
            "control/start_profile": self._start_profile,
            "control/stop_profile": self._stop_profile,
            "control/release_memory_occupation": self._release_memory,
            "control/resume_memory_occupation": self._resume_memory,
            "control/update_weights_from_disk": self._update_weights_from_disk,
            "control/update_weights_from_tensor": self._update_weights_from_tensor,
            "control/update_weights_from_distributed": self._update_weights_from_distributed,
            "control/update_weights_from_ipc": self._update_weights_from_ipc,
            "control/update_weight_version": self._update_weight_version,
            "call_tokenizer_manager": self._call_tokenizer_manager,
            # Not in dynamo.sglang: read the served version, abort by request id.
            "rollout/weight_version": self._weight_version,
            "rollout/info": self._info,
            "rollout/server_args": self._server_args,
            "rollout/abort": self._abort,
        }

    # -- lifecycle ---------------------------------------------------------------------------------

    async def run(self) -> None:
        from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model
        from dynamo.runtime import DistributedRuntime

        loop = asyncio.get_running_loop()
        self.runtime = DistributedRuntime(
            loop, self.discovery_backend, self.request_plane, event_plane=self.event_plane
        )
        for path, fn in self.routes().items():
            self.runtime.register_engine_route(path, _json_safe(fn))
        self.generate_endpoint = self.runtime.endpoint(f"{self.namespace}.{self.component}.{self.endpoint_name}")

        def _stop() -> None:
            logger.info("signal: shutting down")
            self.runtime.shutdown()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _stop)

        rc = ModelRuntimeConfig()
        if self.context_length is not None:
            rc.context_length = self.context_length
        # Native /generate on 1.6.x frontends (DYN_SGLANG_ENABLE_GENERATE=1); older ones ignore the key.
        rc.set_engine_specific(SGLANG_GENERATE_CAPABILITY, json.dumps(True))

        async def _register() -> None:
            await register_model(
                ModelInput.Tokens,
                ModelType.Completions | ModelType.Chat,
                self.generate_endpoint,
                self.model_path,
                self.served_model_name,
                worker_type=WorkerType.Aggregated,
                kv_cache_block_size=self.kv_cache_block_size,
                runtime_config=rc,
            )
            logger.info("registered model %s", self.served_model_name)

        await asyncio.gather(
            self.generate_endpoint.serve_endpoint(self.generate, graceful_shutdown=True),
            _register(),
        )


def reference_engine(arg: str) -> Any:
    """``--engine rollout_backends.adapters.dynamo._worker:reference_engine``: a ``ReferenceEngine``.

    ``arg`` is a JSON object: ``model_path`` (required) and any ``ReferenceEngine`` keyword
    (``worker_id``, ``weight_version``, ``page_size``, ``num_threads``).
    """
    from ..reference import ReferenceEngine

    kw = dict(json.loads(arg)) if arg else {}
    path = kw.pop("model_path")
    return ReferenceEngine(path, **kw)


def _tag_values(tags: tuple[MemoryTag, ...] | None) -> list[str] | None:
    return None if tags is None else [t.value for t in tags]


def _json_safe(fn: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    async def wrapper(body: dict[str, Any]) -> dict[str, Any]:
        try:
            result = await fn(body or {})
        except InvalidRequest as exc:  # a body the codec refused: SGLang's failed-control shape
            result = {"success": False, "status": "error", "message": str(exc), "param": exc.field}
        safe: dict[str, Any] = json.loads(json.dumps(result, default=str))
        return safe

    wrapper.__name__ = getattr(fn, "__name__", "route")
    return wrapper


async def _maybe_await(v: Any) -> Any:
    if inspect.isawaitable(v):
        return await v
    return v


def _load_factory(spec: str) -> Callable[..., Any]:
    mod, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


async def run_worker(args: argparse.Namespace) -> None:
    engine = await _maybe_await(_load_factory(args.engine)(args.engine_arg))
    w = DynamoWorker(
        engine,
        namespace=args.namespace,
        component=args.component,
        endpoint=args.endpoint,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        discovery_backend=args.discovery_backend,
        request_plane=args.request_plane,
        event_plane=args.event_plane,
        kv_cache_block_size=args.kv_cache_block_size,
        context_length=args.context_length,
        worker_name=args.worker_name,
    )
    t0 = time.monotonic()
    logger.info("starting worker (engine ready)")
    try:
        await w.run()
    finally:
        logger.info("worker stopped after %.1fs", time.monotonic() - t0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="rollout-backends Python Dynamo worker")
    p.add_argument("--engine", required=True, help="module:factory returning the engine")
    p.add_argument("--engine-arg", default="", help="string passed to the factory")
    p.add_argument("--model-path", required=True, help="HF model dir (tokenizer + config for the frontend)")
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--namespace", default=os.environ.get("DYN_NAMESPACE", "dynamo"))
    p.add_argument("--component", default="backend")
    p.add_argument("--endpoint", default="generate")
    p.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "file"))
    p.add_argument("--request-plane", default=os.environ.get("DYN_REQUEST_PLANE", "tcp"))
    p.add_argument("--event-plane", default=os.environ.get("DYN_EVENT_PLANE", "zmq"))
    p.add_argument("--kv-cache-block-size", type=int, default=16)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--worker-name", default=None, help="stamped into engine_data (default: system URL)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(run_worker(args))


if __name__ == "__main__":
    main()
