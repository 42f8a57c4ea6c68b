"""Dynamo as a ``Wire``: the frontend's ``/v1/completions`` for generation, each worker's system
port (``/engine/<route>``) for control. Request builders and response parsers only.

Shapes are Dynamo 1.4.2's (``docs/dynamo.md``, "Dynamo as observed"); engine routes follow the
flavor detected once at connect time:

* ``rollout``: our Python worker (``_worker.py``): the ``dynamo.sglang`` 1.4.2 routes plus
  ``rollout/{weight_version,info,abort}`` (abort by request id, served version).
* ``sglang14`` / ``sglang14-shim``: ``dynamo.sglang`` 1.4.x: ``control/*`` and
  ``call_tokenizer_manager`` (needs ``--enable-rl``); the shim adds ``engine_data`` and
  ``rollout/weight_version``.
* ``sglang16``: ``dynamo.sglang`` 1.6.x: native unprefixed routes (``pause_generation``, ...);
  ``flush_cache``, ``init/destroy_weights_update_group`` and ``abort_request`` need the worker's
  ``--engine-route`` allowlist. ``sglang16-shim``: the same through the shim, which adds
  ``rollout/{weight_version,abort}`` (abort by request id with partial tokens, abort all).
* ``mocker``: ``dynamo.mocker``: no engine routes, no logprobs.
* ``vllm``: ``dynamo.vllm`` 1.4.x (vLLM 0.26): its RL engine routes (``pause_generation``,
  ``resume_generation``, ``flush_cache``, ``abort_request``, the weight routes driving vLLM's
  ``collective_rpc``, ``control/sleep`` / ``control/wake_up``): ``_vllm_routes.py``.

Generation path, also detected once (``native_generate``): a 1.6.x frontend started with
``DYN_SGLANG_ENABLE_GENERATE=1`` serves SGLang's native ``POST /generate`` (SSE); the adapter uses
it for unpinned requests to our worker, whose answers name the worker and the served version and
carry every float unrounded. Pinned requests stay on ``/v1/completions``: 1.6.1's ``/generate``
ignores ``x-dynamo-worker-instance-id`` (measured: ``docs/dynamo.md``, "Dynamo as observed"); so do
requests with stop strings, whose text ``/generate`` does not return.
"""

from __future__ import annotations

import enum
import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from operator import countOf
from typing import Any, TypeGuard

import attrs

from rollout_backends import (
    BackendUnavailable,
    Capabilities,
    ConnectionFailed,
    ContractViolation,
    ControlFailed,
    FinishReason,
    GenerateRequest,
    Generation,
    InvalidRequest,
    Overloaded,
    PauseMode,
    RoutingKind,
    TokenChunk,
    Unsupported,
    VersionSource,
    WeightTransport,
    WorkerFailure,
)
from rollout_backends.kit import (
    AbortAll,
    AbortRequest,
    BeginWeightUpdate,
    Command,
    DestroyWeightGroup,
    EndWeightUpdate,
    FlushCache,
    GetVersion,
    HttpRequest,
    HttpResponse,
    InitWeightGroup,
    Live,
    Operation,
    Pause,
    Probe,
    Progress,
    Ready,
    ReleaseMemory,
    Resume,
    ResumeMemory,
    SetVersion,
    SseDecoder,
    StreamParser,
    UpdateFromDisk,
    UpdateFromDistributed,
    UpdateFromTensors,
    Worker,
    sse_json,
    unhandled,
)
from rollout_backends.sglang_native import (
    disk_body,
    distributed_body,
    init_group_body,
    memory_body,
    named_field,
    our_field,
    parse_answer,
    request_body,
    set_version_body,
    tensors_body,
    trim_at_stop,
)

from ..vllm import DEFAULT_LOGPROBS_MODE, filtered_logprobs
from ._vllm_routes import CONTEXT_ID_HEADER, VLLM_PAUSE_MODES, context_id, vllm_control

__all__ = [
    "CHUNK_VERSION_KEY",
    "FLAVORS",
    "ROUTES",
    "DynamoFlavor",
    "DynamoWire",
    "FlavorRoutes",
    "MATCHED_STOP_KEY",
    "SESSION_HEADER",
    "STOP_ANNOTATION",
    "completion_body",
    "generate_instances",
    "is_uuid",
    "native_body",
    "sse_events",
]


class DynamoFlavor(str, enum.Enum):
    """Which engine routes a Dynamo worker serves (detected once at connect time)."""

    ROLLOUT = "rollout"
    SGLANG14 = "sglang14"
    SGLANG14_SHIM = "sglang14-shim"
    SGLANG16 = "sglang16"
    SGLANG16_SHIM = "sglang16-shim"
    MOCKER = "mocker"
    VLLM = "vllm"
    NONE = "none"


@attrs.frozen(slots=True, kw_only=True)
class FlavorRoutes:
    """What one flavor's workers serve: the control half of the wire reads this table, not names."""

    #: SGLang's engine control routes at all (the mocker and bare instances have none).
    sglang: bool
    #: dynamo.sglang 1.6.x native unprefixed routes; else 1.4.x ``call_tokenizer_manager``.
    native: bool = False
    #: ``rollout/abort`` (by request id) and ``rollout/weight_version`` (our worker, the shim).
    rollout_routes: bool = False
    #: ``rollout/abort`` also aborts all (our worker); else SGLang's own abort route.
    rollout_abort_all: bool = False
    #: ``control/update_weights_from_tensor``: our worker, and dynamo.sglang 1.4.2, which registers it
    #: (``handler_base.register_engine_routes``) and hands the body to SGLang's tokenizer manager
    #: as ``UpdateWeightsFromTensorReqInput`` (``load_format`` included: flat buckets pass through).
    tensors: bool = False
    #: Logprobs and cached-token counts in answers (not the mocker).
    logprobs: bool = True
    #: Seeded sampling and batch-invariant numerics (our reference worker; SGLang is not by default).
    deterministic: bool = False
    #: The most top logprobs per token (the frontend takes ``logprobs`` <= 5; stock dynamo.sglang
    #: refuses >= 1 unless its workers run with ``DYN_SGL_ALLOW_TOP_LOGPROBS=1``).
    top_logprobs: int = 0
    #: Prompt logprobs and zero-budget re-scoring (our worker: ``engine_data.prompt_logprobs``).
    prompt_logprobs: bool = False
    #: ``SamplingParams.stop``. Sent as ``stop``, the frontend matches stop strings on its own text
    #: and ends the stream there; our worker stops on the same token, so its last chunk (served
    #: version, worker) still arrives. Behind stock dynamo.sglang it does not (SGLang there has no
    #: tokenizer and never sees the strings): on the H200 tier (2026-12-02, 1.4.2, shim) a
    #: stop-string answer came back without a weight version. Not declared there.
    stop_strings: bool = False
    #: Stop strings go to the workers only, as a ``STOP_ANNOTATION`` (the frontend forwards
    #: ``nvext.annotations`` untouched and never matches them), and the worker matches them with
    #: SGLang's rule (``sglang_native.StopStrings``), ends the request there (aborting it inside
    #: SGLang) and sends its last chunk with ``engine_data[MATCHED_STOP_KEY]``; ``text`` is the whole
    #: output's, cut here (``trim_at_stop``). The shim (``_sglang_shim`` patch 8).
    worker_stop_strings: bool = False
    #: Every chunk carries the version its tokens were generated under, as
    #: ``engine_data[CHUNK_VERSION_KEY]`` (our worker; the shim, from each SGLang output's
    #: ``meta_info.weight_version``), so a stream's ``version_spans`` hold across an update
    #: (``Capabilities.stream_version_spans``). The frontend forwards a non-final chunk's
    #: ``engine_data`` verbatim as that SSE chunk's ``nvext.engine_data`` (measured 2026-12-03 on CPU,
    #: ai-dynamo 1.4.2 and 1.6.1: each of 4 chunks came back with its own engine_data); stock
    #: dynamo.sglang puts ``engine_data`` on no chunk, so not declared there; behind the shim
    #: (which stamps them) not declared either (see ``SGLANG14_SHIM``).
    chunk_versions: bool = False
    #: A RETRACT update completes with requests parked (``Capabilities.update_while_parked``): our
    #: reference worker; SGLang 0.5.16 workers refuse the flush it takes.
    update_while_parked: bool = False
    #: dynamo.sglang 1.4.x awaits the synchronous ``TokenizerManager.abort_request``: the abort is
    #: dispatched, then the route fails with "object NoneType can't be used in 'await' expression".
    abort_all_await_bug: bool = False
    #: ``abort(id)`` keeps the partial tokens and ``abort_all()`` works (``Capabilities.abort``).
    #: Not the mocker (no abort route), nor stock dynamo.sglang 1.6.1 over SGLang 0.5.16: it has no
    #: route that aborts one request inside SGLang (cancelling the call loses the tokens), and its
    #: ``abort_request`` route runs SGLang 0.5.16's synchronous ``abort_request`` in a thread with
    #: no event loop (``dynamo/sglang/engine_routes.py`` ``_run_in_thread``): HTTP 500 "There is no
    #: current event loop in thread 'dynamo-sglang-engine-route'" (H200 tier, 2026-12-06).
    abort: bool = True
    #: dynamo.vllm's engine routes (``_vllm_routes.vllm_control``); a request's id travels as the
    #: frontend's context id (``CONTEXT_ID_HEADER``), which ``abort_request`` takes.
    vllm: bool = False
    #: ``SamplingParams.min_new_tokens`` reaches the engine (sent as ``min_tokens``). dynamo.sglang
    #: 1.4.2 builds SGLang's sampling params without it (``request_handlers/llm/decode_handler.py``
    #: ``_build_sampling_params``): where it does not arrive it is refused, never dropped.
    min_new_tokens: bool = True


ROUTES: Mapping[DynamoFlavor, FlavorRoutes] = {
    DynamoFlavor.ROLLOUT: FlavorRoutes(
        sglang=True,
        rollout_routes=True,
        rollout_abort_all=True,
        tensors=True,
        deterministic=True,
        top_logprobs=5,
        prompt_logprobs=True,
        stop_strings=True,
        chunk_versions=True,
        update_while_parked=True,
    ),
    DynamoFlavor.SGLANG14: FlavorRoutes(sglang=True, tensors=True, abort_all_await_bug=True, min_new_tokens=False),
    # The shim lets 1.4.2 pass top logprobs and returns prompt logprobs (_sglang_shim patch 6). It
    # stamps every chunk with SGLang's version (patch 3), but spans are not declared from them, as on
    # SGLang direct (its wire): across an IN_PLACE update the first chunk stamped new held the old
    # weights' token (H200 tier 2026-12-03 18:25, at token 1), and a RETRACT update with the
    # stream parked is refused (update_while_parked).
    # Stop strings are matched in the shim (patch 8), so its last chunk (version, worker) arrives.
    DynamoFlavor.SGLANG14_SHIM: FlavorRoutes(
        sglang=True,
        rollout_routes=True,
        tensors=True,
        abort_all_await_bug=True,
        min_new_tokens=False,
        top_logprobs=5,
        prompt_logprobs=True,
        stop_strings=True,
        worker_stop_strings=True,
    ),
    DynamoFlavor.SGLANG16: FlavorRoutes(sglang=True, native=True, abort=False),
    # 1.6.x through the shim: its rollout/abort (patch 5) aborts one request by our id inside SGLang
    # (partial tokens kept) and all of them from the worker's own event loop; the served version is
    # read and stamped as on 1.4.2 (patch 3, rollout/weight_version).
    DynamoFlavor.SGLANG16_SHIM: FlavorRoutes(sglang=True, native=True, rollout_routes=True, rollout_abort_all=True),
    DynamoFlavor.MOCKER: FlavorRoutes(sglang=False, logprobs=False, abort=False),
    # Top and prompt logprobs, stop strings: not declared until the GPU capture shows what the 1.4.2
    # frontend makes of dynamo.vllm's answers (docs/vllm.md). RETRACT preempts the paused requests
    # (vLLM's keep + clear_cache), so a load completes with them parked.
    DynamoFlavor.VLLM: FlavorRoutes(sglang=False, vllm=True, update_while_parked=True),
    DynamoFlavor.NONE: FlavorRoutes(sglang=False, min_new_tokens=False),
}
FLAVORS = tuple(f.value for f in DynamoFlavor)


def to_flavor(value: DynamoFlavor | str) -> DynamoFlavor:
    """A flavor from its name (``InvalidRequest`` naming ``flavor`` for an unknown one)."""
    try:
        return DynamoFlavor(value)
    except ValueError:
        raise InvalidRequest("flavor", f"must be one of {FLAVORS}, got {value!r}") from None


#: The header the frontend's session affinity keys on (``--router-session-affinity-ttl-secs``; 1.4.2
#: and 1.6.1, every router mode): requests with one key stay on the worker the first was routed to,
#: until the key idles past the TTL (measured on CPU, ``docs/miles.md``, "Session affinity").
#: ``GenerateRequest.routing_key`` travels in it, as SGLang's wire sends it in ``X-SMG-Routing-Key``.
SESSION_HEADER = "x-dynamo-session-id"
#: Router modes that honour ``nvext.backend_instance_id`` (measured on 1.4.2: round-robin ignores it).
PINNING_MODES = ("kv", "direct")
EXTRA_FIELDS = ("completion_token_ids", "worker_id", "timing", "engine_data", "stop_reason")
RID_ANNOTATION = "rid:"
#: ``nvext.annotations`` entry carrying the stop strings to workers that match them
#: (``FlavorRoutes.worker_stop_strings``): this prefix, then the strings as a JSON list.
STOP_ANNOTATION = "stop-strings:"
#: The ``engine_data`` key of the stop string a worker matched (``FlavorRoutes.worker_stop_strings``).
MATCHED_STOP_KEY = "matched_stop"
#: The ``engine_data`` key of the version a chunk's tokens were generated under (our worker, the
#: shim). A chunk whose ``engine_data`` holds only this key is not the final one.
CHUNK_VERSION_KEY = "chunk_weight_version"


#: ``repr`` of a msgspec struct result: ``FlushCacheReqOutput(rid=None, ..., success=False, message='')``.
_STRUCT_REPR = re.compile(r"^[A-Za-z_]\w*\((?P<fields>.*)\)$", re.S)
_SUCCESS_FIELD = re.compile(r"(?:^|, )success=(True|False)(?:,|$)")
_MESSAGE_FIELD = re.compile(r"(?:^|, )message=(?P<q>['\"])(?P<m>.*?)(?P=q)(?:,|$)", re.S)


def _struct_result(data: Any) -> Any:
    """``{"success", "message"}`` out of a ``call_tokenizer_manager`` result dynamo.sglang stringified.

    ai-dynamo 1.4.2's ``RLMixin._normalize_result`` knows tuples and dataclasses; SGLang 0.5.16
    returns msgspec structs for some methods (``flush_cache`` → ``FlushCacheReqOutput``), which it
    turns into ``{"result": str(struct)}`` with HTTP 200 — a refused flush would read as success.
    Our shim returns the struct's fields; for stock ``dynamo.sglang`` this parses the repr.
    """
    if not (isinstance(data, dict) and set(data) == {"result"} and isinstance(data["result"], str)):
        return data
    m = _STRUCT_REPR.match(data["result"])
    ok = _SUCCESS_FIELD.search(m.group("fields")) if m else None
    if m is None or ok is None:
        return data
    msg = _MESSAGE_FIELD.search(m.group("fields"))
    return {**data, "success": ok.group(1) == "True", "message": (msg.group("m") if msg else "") or data["result"]}


def _flush_refused_busy(data: Any) -> bool:
    """Whether a 1.6.x ``flush_cache`` answer is SGLang refusing because requests are pending.

    ai-dynamo 1.6.1's route (``--engine-route flush_cache``, target ``engine``;
    ``dynamo/sglang/engine_routes.py``) calls ``Engine.flush_cache()``, which asks the scheduler
    with no ``timeout_s``; SGLang 0.5.16 then flushes at once or answers
    ``FlushCacheReqOutput(success=False)`` with an empty message, only when it is not idle
    (``scheduler_components/flush_wrapper.py``, ``Scheduler.flush_cache``: "Cache not flushed
    because there are pending requests"); the route answers its fields as JSON. A request that has
    just answered still counts as running for a scheduler step (H100, 2026-12-05, issue 30)."""
    return isinstance(data, dict) and data.get("success") is False and not data.get("message")


def stop_strings_from_annotations(request: Mapping[str, Any]) -> tuple[str, ...]:
    """The stop strings a preprocessed request's ``annotations`` carry (``STOP_ANNOTATION``; ``()``
    without); ``InvalidRequest`` naming ``sampling.stop`` for a malformed one."""
    for a in request.get("annotations") or ():
        if isinstance(a, str) and a.startswith(STOP_ANNOTATION):
            try:
                stops = json.loads(a[len(STOP_ANNOTATION) :])
            except ValueError:
                raise InvalidRequest("sampling.stop", "the stop-strings annotation is not JSON") from None
            if not isinstance(stops, list) or not stops or not all(isinstance(st, str) and st for st in stops):
                raise InvalidRequest("sampling.stop", "the stop-strings annotation is not a list of non-empty strings")
            return tuple(stops)
    return ()


def rid_from_annotations(request: Mapping[str, Any]) -> str | None:
    """Our request id from a preprocessed request's ``annotations`` (what the frontend forwards)."""
    for a in request.get("annotations") or ():
        if isinstance(a, str) and a.startswith(RID_ANNOTATION):
            return a[len(RID_ANNOTATION) :] or None
    return None


_UUID_RE = re.compile(
    r"^(?:[0-9a-fA-F]{32}|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})$"
)
_ROUTING = {
    "round-robin": RoutingKind.ROUND_ROBIN,
    "random": RoutingKind.RANDOM,
    "kv": RoutingKind.KV,
}


def generate_instances(health: Any, namespace: str | None = None) -> list[dict[str, Any]]:
    """The ``generate`` instances a frontend's ``GET /health`` lists (optionally of one namespace)."""
    if not isinstance(health, dict):
        return []
    out = []
    for inst in health.get("instances") or []:
        ok = isinstance(inst, dict) and inst.get("endpoint") == "generate"
        if ok and (namespace is None or inst.get("namespace") == namespace):
            out.append(inst)
    return out


def is_uuid(value: str) -> bool:
    """Whether the 1.4.2 frontend keeps ``value`` as ``x-dynamo-request-id`` (UUID forms only)."""
    return bool(_UUID_RE.match(value))


def completion_body(
    request: GenerateRequest, model: str, *, logprobs: bool, instance_id: Any = None, worker_stops: bool = False
) -> dict[str, Any]:
    """The ``/v1/completions`` body for one token-in/token-out request (every sampling value explicit);
    ``worker_stops``: stop strings for the workers only (``FlavorRoutes.worker_stop_strings``)."""
    s = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.input_ids),
        # The frontend refuses max_tokens 0: a re-scoring request generates one token, dropped.
        "max_tokens": max(s.max_new_tokens, 1),
        "temperature": s.temperature,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "repetition_penalty": s.repetition_penalty,
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        "ignore_eos": s.ignore_eos,  # top level: nvext.ignore_eos is rejected by 1.4.2
        "stream": False,
        "n": 1,
    }
    if s.top_k != -1:
        body["top_k"] = s.top_k
    if s.min_new_tokens:
        body["min_tokens"] = s.min_new_tokens
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.stop and not worker_stops:
        body["stop"] = list(s.stop)  # matched by the frontend on the decoded text
    if s.seed is not None:
        body["seed"] = s.seed
    if logprobs:
        # k alternatives per token (0: the chosen token's only; >= 1 is refused by stock SGLang workers);
        # named by id, not by text (two ids can decode to the same string).
        body["logprobs"] = s.top_logprobs
        if s.top_logprobs:
            body["return_tokens_as_token_ids"] = True
    if request.prompt_logprobs_start is not None:
        body["prompt_logprobs"] = 0  # output_options.prompt_logprobs: the worker scores the prompt from 0
    nvext: dict[str, Any] = {
        "extra_fields": list(EXTRA_FIELDS),
        # The request id reaches the worker whatever its form (x-dynamo-request-id takes UUIDs only).
        "annotations": [f"{RID_ANNOTATION}{request.request_id}"],
    }
    if s.stop and worker_stops:
        nvext["annotations"].append(STOP_ANNOTATION + json.dumps(list(s.stop)))
    if instance_id is not None:
        nvext["backend_instance_id"] = instance_id
    body["nvext"] = nvext
    return body


def _session(request: GenerateRequest) -> dict[str, str]:
    """The routing key as the frontend's session id (a pinned request's worker wins over it)."""
    return {SESSION_HEADER: request.routing_key} if request.routing_key else {}


def native_body(request: GenerateRequest) -> dict[str, Any]:
    """The 1.6.x frontend's native ``/generate`` body: SGLang's own (``sampling_params`` as the SGLang
    adapter sends them); ``stream`` must be true (the frontend answers 501 otherwise)."""
    return request_body(request, stream=True)


def is_sse(body: bytes) -> bool:
    """Whether an answer is an SSE stream (``/generate``) rather than one JSON object."""
    head = body[:16].lstrip()
    return head.startswith((b"data:", b":"))


def sse_events(body: bytes) -> list[Any]:
    """The JSON payloads of an SSE body's ``data:`` events, up to ``[DONE]``."""
    decoder = SseDecoder()
    events: list[Any] = []
    for data in [*decoder.feed(body), *decoder.close()]:
        event = sse_json(data, "/generate", worker=None)
        if event is None:
            break
        events.append(event)
    return events


#: What ai-dynamo 1.6.x's ``dynamo.sglang`` answers when an engine route called while SGLang is
#: paused re-syncs discovery and unregisters the worker a second time (``handler_base.py``
#: ``_invoke_engine_route`` → ``_sync_discovery_with_sglang_pause_state``); file discovery refuses
#: it ("Could not find key"; etcd takes it: both measured on CPU, 2026-12-06, ai-dynamo 1.4.2 and
#: 1.6.1 runtimes). The route itself has run; its answer is lost.
_DISCOVERY_REUNREGISTER = "Unable to unregister endpoint instance from discovery"
_DISCOVERY_HINT = (
    " (stock dynamo.sglang 1.6.x unregisters a paused worker again after every engine route, and file "
    "discovery refuses the second unregister: run the workers through the shim, which unregisters "
    "once, or with etcd discovery; docs/versions.md)"
)


def _error_message(resp: HttpResponse) -> str:
    message = _raw_error_message(resp)
    return message + _DISCOVERY_HINT if _DISCOVERY_REUNREGISTER in message else message


def _raw_error_message(resp: HttpResponse) -> str:
    try:
        data = resp.json()
    except ContractViolation:
        return resp.text[:500]
    if isinstance(data, dict):
        err = data.get("message", data.get("error", data.get("detail")))
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            extra = data.get("error") if data.get("message") is not None else None
            return f"{extra}: {err}" if isinstance(extra, str) and extra != err else str(err)
    return resp.text[:500]


#: A frontend's words for the output budget (``max_tokens``, "max tokens", "completion tokens", ...).
_BUDGET = re.compile(r"max[_ ](?:new[_ ])?(?:completion[_ ])?tokens|completion[_ ]tokens|output[_ ]tokens")


def _field_of(message: str) -> str:
    """The field a frontend's refusal names, in our spelling: our worker's (``<native field>: ...``)
    exactly; else by the words Dynamo uses."""
    named = named_field(message)
    if named is not None:
        return named
    low = message.lower()
    if _BUDGET.search(low):
        return "sampling.max_new_tokens"
    for key in ("stop_token_ids", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "stop"):
        if key in low:
            return f"sampling.{ {'min_tokens': 'min_new_tokens'}.get(key, key) }"
    if "model" in low and "not found" in low:
        return "model"
    return "input_ids"


def _refused(err: object) -> InvalidRequest | None:
    """Our worker's refusal (``engine_data.refused``, or SGLang's error object on the native path) as
    the ``InvalidRequest`` it names; ``None`` for any other error."""
    if not isinstance(err, dict):
        return None
    param, message = err.get("param"), str(err.get("message", err))
    if isinstance(param, str) and param:
        return InvalidRequest(our_field(param), message.removeprefix(f"{param}: "))
    named = named_field(message)
    return None if named is None else InvalidRequest(named, message)


def _f32(value: float) -> float:
    """The float32 the frontend serialised (it keeps logprobs as f32 and prints the shortest
    decimal): its exact value, i.e. what the engine's float32 tensor held."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def _engine_prompt_logprobs(request: GenerateRequest, value: object, worker: str | None) -> tuple[float | None, ...]:
    """Our worker's ``engine_data.prompt_logprobs`` (the whole prompt's, the first ``None``) -> from
    ``prompt_logprobs_start`` on, the first ``None`` (SGLang's shape)."""
    n = len(request.input_ids)
    if not isinstance(value, list) or len(value) != n:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise ContractViolation(f"engine_data.prompt_logprobs has {got} entries for {n} prompt tokens", worker=worker)
    start = request.prompt_logprobs_start or 0
    out: list[float | None] = [None]
    for i, lp in enumerate(value[start + 1 :], start + 1):
        if not isinstance(lp, (int, float)) or isinstance(lp, bool) or math.isnan(lp):
            raise ContractViolation(f"engine_data.prompt_logprobs[{i}] is not a number ({lp!r})", worker=worker)
        out.append(float(lp))
    return tuple(out)


def _token_logprobs(lps: list[Any], first: int, worker: str | None) -> tuple[float, ...]:
    """``token_logprobs`` (output positions ``first`` on) as float32 values; a non-number (or NaN)
    is a ``ContractViolation`` naming its position."""
    out = []
    for i, lp in enumerate(lps):
        if not isinstance(lp, (int, float)) or isinstance(lp, bool) or math.isnan(lp):
            raise ContractViolation(f"token_logprobs[{first + i}] is not a number ({lp!r})", worker=worker)
        out.append(_f32(float(lp)))
    return tuple(out)


_TOKEN_ID = re.compile(r"token_id:(\d+)")


def _completion_top_logprobs(
    lp_obj: object, ids: Sequence[int], k: int, worker: str | None
) -> tuple[tuple[tuple[int, float], ...], ...]:
    """``choices[0].logprobs.top_logprobs`` (``return_tokens_as_token_ids`` names tokens by id) -> per
    token, the ``(id, logprob)`` pairs, most likely first (ties by id). Per token, 1.4.2 sends a list
    ``[{"token": "token_id:<id>", "logprob", "bytes"}]``, 1.6.1 OpenAI's legacy completions object
    ``{"token_id:<id>": logprob}`` (both measured on CPU).

    A sampled token outside the worker's top ``k`` comes last as a ``k + 1``-th entry: the frontend's
    ``convert_backend_top_logprobs`` (``lib/llm/src/protocols/openai.rs`` in ai-dynamo/dynamo)
    "ensures the selected token is present in the list", OpenAI's convention. It is the chosen token,
    not an alternative, so it is dropped here; at temperature > 0 nearly every request had such a
    position and failed as a ContractViolation (``docs/miles.md``, "Top logprobs through Dynamo")."""
    tops = lp_obj.get("top_logprobs") if isinstance(lp_obj, dict) else None
    n = len(ids)
    if not isinstance(tops, list) or len(tops) != n:
        got = len(tops) if isinstance(tops, list) else type(tops).__name__
        raise ContractViolation(f"choices[0].logprobs.top_logprobs has {got} entries for {n} tokens", worker=worker)
    out = []
    for i, position in enumerate(tops):
        pairs = _top_pairs(position, i, worker)
        if not 0 < len(pairs) <= k + 1:
            raise ContractViolation(
                f"top_logprobs[{i}] has {len(pairs)} entries, not 1..{k} (+ the chosen token)", worker=worker
            )
        if len(pairs) == k + 1:
            # Only the frontend's appended chosen token may make it k + 1, and only where the worker's k lack it.
            if pairs[-1][0] != ids[i] or any(t == ids[i] for t, _ in pairs[:-1]):
                why = f"has {k + 1} entries, the last not the chosen token {ids[i]} alone"
                raise ContractViolation(f"top_logprobs[{i}] {why}", worker=worker)
            pairs.pop()
        pairs.sort(key=lambda p: (-p[1], p[0]))
        out.append(tuple(pairs))
    return tuple(out)


def _top_pairs(position: object, i: int, worker: str | None) -> list[tuple[int, float]]:
    """One position's top logprobs, in the order sent: a list of ``{"token", "logprob"}`` (1.4.2) or
    an object ``{token: logprob}`` (1.6.1); each token named ``token_id:<id>``."""
    if isinstance(position, dict):
        named: list[tuple[object, object]] = list(position.items())
    elif isinstance(position, list):
        named = [(e.get("token"), e.get("logprob")) if isinstance(e, dict) else (None, None) for e in position]
    else:
        raise ContractViolation(f"top_logprobs[{i}] is a {type(position).__name__}, not a list", worker=worker)
    pairs = []
    for token, lp in named:
        m = _TOKEN_ID.fullmatch(str(token))
        if m is None or not isinstance(lp, (int, float)) or isinstance(lp, bool) or math.isnan(lp):
            raise ContractViolation(f"top_logprobs[{i}] has an entry that is not a token id and logprob", worker=worker)
        pairs.append((int(m.group(1)), _f32(float(lp))))
    return pairs


def _chunk_version(engine_data: object, worker: str | None) -> str | None:
    """A chunk's ``engine_data[CHUNK_VERSION_KEY]`` (the version its tokens were generated under),
    ``None`` where the worker sent none; anything but a string is the worker's breach."""
    if not isinstance(engine_data, dict) or engine_data.get(CHUNK_VERSION_KEY) is None:
        return None
    version = engine_data[CHUNK_VERSION_KEY]
    if not isinstance(version, str):
        raise ContractViolation(f"engine_data.{CHUNK_VERSION_KEY} is not a string ({version!r})", worker=worker)
    return version


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(value: object) -> TypeGuard[list[int]]:
    """Whether ``value`` is a list of ints (not bools). JSON ints are exact ``int``: one C-level
    pass decides (a Python frame per item was measurable per answer: ``docs/benchmarks.md``,
    "Figures behind the hot path"); anything else (int subclasses, bools, other types) gets the
    per-item rule."""
    if not isinstance(value, list):
        return False
    return countOf(map(type, value), int) == len(value) or all(_is_int(t) for t in value)


def _rpc_port_of(instance: Mapping[str, Any]) -> int | None:
    """The request-plane port of a frontend ``/health`` instance (``transport.tcp`` = ``host:port/...``)."""
    transport = instance.get("transport")
    tcp = transport.get("tcp") if isinstance(transport, dict) else None
    if not isinstance(tcp, str) or ":" not in tcp:
        return None
    try:
        return int(tcp.split("/", 1)[0].rsplit(":", 1)[1])
    except ValueError:
        return None


@attrs.frozen(slots=True, kw_only=True)
class DynamoWire:
    """One Dynamo fleet's wire format.

    ``instance_workers`` maps the frontend's 64-bit instance ids to our worker ids;
    ``url_workers`` maps a worker's system URL (what our worker stamps in ``engine_data.worker``)
    to its id.
    """

    frontend_url: str
    model: str
    flavor: DynamoFlavor = attrs.field(default=DynamoFlavor.ROLLOUT, converter=to_flavor)
    router_mode: str = "round-robin"
    instance_workers: Mapping[int, str] = attrs.field(factory=dict)
    url_workers: Mapping[str, str] = attrs.field(factory=dict)
    #: Worker id -> its request-plane port (``DYN_TCP_RPC_PORT``): a restarted worker registers a new
    #: instance id on the same port, so readiness also matches by port.
    worker_rpc_ports: Mapping[str, int] = attrs.field(factory=dict)
    version_source: VersionSource = VersionSource.RESPONSE
    #: The workers' SGLang runs with ``--enable-memory-saver`` (``vllm``: ``--enable-sleep-mode``):
    #: without it a release frees nothing, so ``memory_release`` is not declared.
    memory_saver: bool = True
    #: How ``memory_saver`` was decided (``connect``): ``"caller"`` (said), ``"workers"`` (read from
    #: them, ``_memory_saver.py``) or ``"default"`` (assumed); ``memory_saver_note`` says what was
    #: read, or why nothing was.
    memory_saver_source: str = "caller"
    memory_saver_note: str = ""
    max_context: int | None = None
    vocab_size: int | None = None
    #: The checkpoint the workers loaded (the launcher's connect URL names it).
    model_path: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    namespace: str | None = None
    probe_timeout: float = 20.0
    #: Unpinned requests go to the frontend's native ``/generate`` (detected at connect: the frontend
    #: serves the route and the workers advertise ``sglang_generate`` and name themselves in it).
    native_generate: bool = False
    #: ``vllm`` workers: their ``--weight-transfer-config`` backend (``nccl``: distributed loads;
    #: ``ipc``: tensor loads), which Dynamo does not show: the launcher says it.
    transfer_backend: str | None = None
    #: ``vllm`` workers: their ``--logprobs-mode`` (``filtered_logprobs``), which Dynamo does not show
    #: either: the launcher says it (our workers run ``VllmServerCommand``'s ``processed_logprobs``);
    #: ``None``: vLLM's default, ``raw_logprobs``. A worker that differs fails the filter checks with
    #: the cause named (``conformance_tests/_sampling.py``), never passes them.
    logprobs_mode: str | None = None

    @property
    def pinning(self) -> bool:
        return self.router_mode in PINNING_MODES

    @property
    def routes(self) -> FlavorRoutes:
        return ROUTES[self.flavor]

    @property
    def aborts_by_id(self) -> bool:
        """Our worker and the shim abort one request by id inside the engine (the request still
        answers with its partial tokens); stock dynamo.sglang has no route for it, so the fleet
        cancels the client's HTTP call instead (the tokens are lost with it). dynamo.vllm aborts
        by the frontend's context id (``abort_request``)."""
        return self.routes.rollout_routes or self.routes.vllm

    def _control_surface(self) -> tuple[set[PauseMode], set[WeightTransport]]:
        """The pause modes and weight transports the workers' engine routes serve."""
        routes = self.routes
        if routes.vllm:
            transports = {WeightTransport.DISK}
            transports |= {t for b, t in (("nccl", WeightTransport.DISTRIBUTED), ("ipc", WeightTransport.TENSOR))
                           if self.transfer_backend == b}  # fmt: skip
            return set(VLLM_PAUSE_MODES), transports
        if not routes.sglang:
            return set(), set()
        transports = {WeightTransport.DISK, WeightTransport.DISTRIBUTED}
        if routes.tensors:
            transports.add(WeightTransport.TENSOR)
        return set(PauseMode), transports

    def capabilities(self) -> Capabilities:
        routes = self.routes
        pause_modes, transports = self._control_surface()
        mocker = self.flavor is DynamoFlavor.MOCKER
        return Capabilities(
            pause_modes=pause_modes,
            weight_transports=transports,
            memory_release=(routes.sglang or routes.vllm) and self.memory_saver,
            logprobs=routes.logprobs,
            top_logprobs=routes.top_logprobs,
            filtered_logprobs=routes.vllm and filtered_logprobs(self.logprobs_mode or DEFAULT_LOGPROBS_MODE),
            prompt_logprobs=routes.prompt_logprobs,
            stop_strings=routes.stop_strings,
            streaming=True,  # /v1/completions SSE (_CompletionStream)
            routing=_ROUTING.get(self.router_mode, RoutingKind.OTHER),
            # Where not (FlavorRoutes.abort): abort(id) cancels the client's call (no partial tokens
            # come back) and abort_all() is Unsupported (control()).
            abort=routes.abort,
            seeded_sampling=routes.deterministic,
            begin_end_update=False,
            # Every flavor with the tensor route loads SGLang's flat buckets (our worker unflattens).
            flattened_buckets=WeightTransport.TENSOR in transports,
            version_source=self.version_source,
            cached_tokens=routes.logprobs,
            worker_pinning=self.pinning,
            # The fleet routes by its labels; without pinning it refuses while the workers disagree.
            version_constraints=True,
            # No answer reports per-token versions: the fleet gives spans where no update overlapped.
            version_spans=VersionSource.NONE if self.version_source is VersionSource.NONE else VersionSource.STAMPED,
            # A stream's chunks do, where the workers stamp each (FlavorRoutes.chunk_versions).
            stream_version_spans=routes.chunk_versions,
            update_while_parked=routes.update_while_parked,
            # dynamo.vllm's weight routes refuse a load unless pause_generation came first
            # (1.4.2 handlers.py update_weights_from_disk / update_weights_from_distributed).
            load_needs_pause=routes.vllm,
            survives_failed_load=not routes.vllm,  # dynamo.vllm: HTTP 500 after a failed load (H100, 2026-12-06)
            # The probe is a 1-token generation pinned to the worker: only where pinning works.
            progress_probe=self.pinning,
            batch_invariant=routes.deterministic,
            # The mocker's tokens are random: ids in [1000, 2000) whatever the model's vocabulary
            # (ai-dynamo 1.4.2 and 1.6.1), greedy requests do not repeat; its prompts are the
            # model's (1.6.1's frontend refuses ids outside the tokenizer's; measured 2026-12-05).
            greedy_decoding=not mocker,
            max_context=self.max_context,
            vocab_size=self.vocab_size,
            model_path=self.model_path,
        )

    # -- generation -------------------------------------------------------------------------

    def _refuse_unservable(self, request: GenerateRequest) -> None:
        """What this fleet cannot serve exactly, refused before anything is sent."""
        k = request.sampling.top_logprobs
        if k > self.routes.top_logprobs:
            raise InvalidRequest(
                "sampling.top_logprobs",
                f"{k} > {self.routes.top_logprobs}, the most this Dynamo fleet ({self.flavor.value} workers) returns",
            )
        if request.sampling.stop and request.sampling.ignore_eos and not self.routes.worker_stop_strings:
            # SGLang keeps stop strings under ignore_eos; the 1.4.2 frontend drops them (measured).
            raise InvalidRequest("sampling.stop", "Dynamo's frontend ignores stop strings with ignore_eos=True")
        if request.sampling.min_new_tokens and not self.routes.min_new_tokens:
            raise Unsupported(
                "sampling.min_new_tokens", f"{self.flavor.value} workers do not pass min_tokens on to the engine"
            )
        if request.sampling.stop and self.flavor is DynamoFlavor.MOCKER:
            raise InvalidRequest("sampling.stop", "the mocker generates no text: stop strings cannot match")
        if request.prompt_logprobs_start is not None and not self.routes.prompt_logprobs:
            raise InvalidRequest(
                "prompt_logprobs_start", f"this Dynamo fleet ({self.flavor.value} workers) returns no prompt logprobs"
            )

    def generate(self, request: GenerateRequest, worker: Worker | None) -> HttpRequest:
        self._refuse_unservable(request)
        # Stop strings go by /v1/completions: the native answer carries no text (ai-dynamo 1.6.1,
        # our worker; the suite's stop_strings failed on the kv fleet, CPU 2026-12-05).
        if (
            self.native_generate
            and worker is None
            and request.prompt_logprobs_start is None
            and not request.sampling.stop
        ):
            return HttpRequest(
                "POST", f"{self.frontend_url}/generate", json=native_body(request), headers=_session(request)
            )
        return self._completion_request(request, worker, stream=False)

    def _completion_request(self, request: GenerateRequest, worker: Worker | None, *, stream: bool) -> HttpRequest:
        body = completion_body(
            request,
            self.model,
            logprobs=request.return_logprobs and self.flavor != "mocker",
            instance_id=worker.instance_id if worker is not None else None,
            worker_stops=self.routes.worker_stop_strings,
        )
        if stream:
            body["stream"] = True
        # The request id travels in nvext.annotations (x-dynamo-request-id is deprecated on 1.4.2
        # and takes UUIDs only); dynamo.vllm aborts by the context id, ours made a UUID.
        headers = _session(request)
        if self.routes.vllm:
            headers = {**headers, CONTEXT_ID_HEADER: context_id(request.request_id)}
        return HttpRequest("POST", f"{self.frontend_url}/v1/completions", json=body, headers=headers)

    def stream(self, request: GenerateRequest, worker: Worker | None) -> HttpRequest:
        # Always /v1/completions: the native /generate route (1.6) is not used for streams.
        self._refuse_unservable(request)
        return self._completion_request(request, worker, stream=True)

    def stream_parser(self, request: GenerateRequest, head: HttpResponse, *, worker: str | None) -> StreamParser:
        if head.status != 200:
            self.parse_generation(request, head, 0.0, worker=worker)  # raises for every refusal
            raise ContractViolation(f"frontend answered HTTP {head.status} to a stream")  # pragma: no cover
        return _CompletionStream(self, request, worker)

    def parse_generation(
        self, request: GenerateRequest, response: HttpResponse, latency_s: float, *, worker: str | None = None
    ) -> Generation:
        if response.status in (400, 422):
            msg = _error_message(response)
            raise InvalidRequest(_field_of(msg), msg)
        if response.status == 404:
            raise BackendUnavailable(
                f"frontend: HTTP 404 ({_error_message(response)}): no worker serves {self.model!r}"
            )
        if response.status in (429, 503, 529):
            # Not flagged nothing_generated: 1.6.1 answers 503 "Service temporarily unavailable"
            # also for /v1/completions requests that were running on a worker when it died.
            raise Overloaded(f"frontend: HTTP {response.status}: {_error_message(response)}")
        if response.status >= 500:
            msg = _error_message(response)
            if response.status == 500 and self.native_generate and request.worker is None:
                # Native /generate (1.6.1) answers HTTP 200 as soon as a worker's stream exists and
                # reports later failures inside it (a request running on a worker that dies: an
                # error event); a 500 means dispatch failed before any stream, like 1.4.2's "Failed
                # to generate completions": the routed worker is dead (the frontend logs "SGLang
                # engine generate call failed ... Connection refused", answers "internal server error").
                raise ConnectionFailed(
                    f"frontend /generate: HTTP 500 before the stream began ({msg}): no token was generated",
                    nothing_generated=True,
                )
            if "Failed to generate completions" in msg:
                # The frontend could not start the stream (e.g. the routed worker is gone but still
                # in discovery for up to its ~10 s lease): nothing was generated, resending is safe.
                raise ConnectionFailed(
                    f"frontend: HTTP {response.status}: {msg} (no token was generated)", nothing_generated=True
                )
            raise BackendUnavailable(f"frontend: HTTP {response.status}: {msg}")
        if response.status != 200:
            raise ContractViolation(f"frontend answered HTTP {response.status}: {_error_message(response)}")
        if is_sse(response.body):
            return self.parse_native(request, response.body, latency_s)
        data = response.json()
        if not isinstance(data, dict):
            raise ContractViolation(f"/v1/completions answered {type(data).__name__}, expected an object")
        return self.parse_completion(request, data, latency_s)

    def parse_native(self, request: GenerateRequest, body: bytes, latency_s: float) -> Generation:
        """A native ``/generate`` SSE answer: incremental SGLang objects (each with its *new*
        ``output_ids`` and aligned ``meta_info.output_token_logprobs``), the last one finished.
        An error after the stream started comes as an event ``{"error": {"message"}}`` (HTTP 200)."""
        ids: list[Any] = []
        entries: list[Any] = []
        tops: list[Any] = []
        meta: dict[str, Any] | None = None
        for ev in sse_events(body):
            if not isinstance(ev, dict):
                raise ContractViolation(f"/generate sent a {type(ev).__name__} event, expected an object")
            if "error" in ev:
                err = ev["error"]
                refused = _refused(err)
                if refused is not None:  # the worker refused the request before generating
                    raise refused
                msg = str(err.get("message", err)) if isinstance(err, dict) else str(err)
                raise BackendUnavailable(f"frontend /generate failed mid-stream: {msg}")
            out, m = ev.get("output_ids"), ev.get("meta_info")
            if not isinstance(out, list) or not isinstance(m, dict):
                raise ContractViolation("/generate event lacks output_ids or meta_info")
            ids.extend(out)
            lps = m.get("output_token_logprobs")
            if isinstance(lps, list):
                entries.extend(lps)
            top = m.get("output_top_logprobs")
            if isinstance(top, list):
                tops.extend(top)
            meta = m
        if meta is None or meta.get("finish_reason") is None:
            raise ContractViolation("/generate stream ended without a finished event")
        worker = self.url_workers.get(str(meta.get("worker") or "").rstrip("/"))
        total = meta.get("completion_tokens")
        if _is_int(total) and total != len(ids):
            raise ContractViolation(f"/generate sent {len(ids)} output ids, completion_tokens={total}", worker=worker)
        merged_meta = {**meta, "output_token_logprobs": entries}
        if tops:
            merged_meta["output_top_logprobs"] = tops
        merged = {"output_ids": ids, "meta_info": merged_meta}
        gen = parse_answer(request, merged, latency_s, worker=worker)
        # meta_info.id is whatever id the frontend settled on; the caller's request id is the one we sent.
        return attrs.evolve(gen, request_id=request.request_id)

    def worker_of(self, nvext: Mapping[str, Any]) -> str | None:
        ed = nvext.get("engine_data")
        if isinstance(ed, dict) and isinstance(ed.get("worker"), str):
            w = self.url_workers.get(ed["worker"].rstrip("/"))
            if w is not None:
                return w
        wid = nvext.get("worker_id")
        if isinstance(wid, dict):
            inst = wid.get("decode_worker_id", wid.get("prefill_worker_id"))
            if isinstance(inst, int):
                return self.instance_workers.get(inst)
        return None

    def parse_completion(self, request: GenerateRequest, data: Mapping[str, Any], latency_s: float) -> Generation:
        choices = data.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise ContractViolation("/v1/completions answer has no single choice")
        choice = choices[0]
        nvext = data.get("nvext") if isinstance(data.get("nvext"), dict) else {}
        assert isinstance(nvext, dict)
        engine_data = nvext.get("engine_data") if isinstance(nvext.get("engine_data"), dict) else {}
        assert isinstance(engine_data, dict)
        if "refused" in engine_data:  # our worker refused the request (see ``_worker.refusal_chunk``)
            refused = _refused(engine_data["refused"])
            if refused is None:
                raise ContractViolation(f"the worker refused the request unreadably: {engine_data['refused']!r}")
            raise refused
        worker = self.worker_of(nvext)
        # Token ids: nvext.completion_token_ids (1.4.2); DYN_ENABLE_RL shaping may move them to the choice.
        ids = nvext.get("completion_token_ids")
        if ids is None:
            ids = choice.get("token_ids")
        if not _int_list(ids):
            raise ContractViolation("no integer completion_token_ids in the answer", worker=worker)
        reason, matched = self._finish(request, choice, nvext, engine_data, ids, worker)
        logprobs, top = self._completion_logprobs(request, choice, ids, worker)
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        assert isinstance(usage, dict)
        details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
        assert isinstance(details, dict)
        version = engine_data.get("weight_version")
        prompt_tokens = usage.get("prompt_tokens")
        prompt_lps = None
        if request.prompt_logprobs_start is not None and request.return_logprobs:
            prompt_lps = _engine_prompt_logprobs(request, engine_data.get("prompt_logprobs"), worker)
        if request.sampling.max_new_tokens == 0:  # re-scoring: the one token generated is not the caller's
            ids, top, reason, matched = [], None, FinishReason.LENGTH, None
            logprobs = () if logprobs is not None else None
        text = self._completion_text(request, choice, reason, matched)
        return Generation(
            request_id=request.request_id,
            output_ids=tuple(ids),
            logprobs=logprobs,
            finish_reason=reason,
            weight_version=None if version is None else str(version),
            prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else len(request.input_ids),
            cached_tokens=int(details.get("cached_tokens") or 0),
            worker=worker,
            latency_s=latency_s,
            matched_stop=matched,
            top_logprobs=top,
            prompt_logprobs=prompt_lps,
            text=text,
        )

    def _completion_logprobs(
        self, request: GenerateRequest, choice: Mapping[str, Any], ids: list[int], worker: str | None
    ) -> tuple[tuple[float, ...] | None, tuple[tuple[tuple[int, float], ...], ...] | None]:
        """The output tokens' logprobs and top logprobs of a ``/v1/completions`` choice (``None``
        where not asked for, or from the mocker): one per token, never padded."""
        if not request.return_logprobs or self.flavor == "mocker":
            return None, None
        lp_obj = choice.get("logprobs")
        lps = lp_obj.get("token_logprobs") if isinstance(lp_obj, dict) else None
        if not isinstance(lps, list):
            if ids:
                raise ContractViolation("choices[0].logprobs.token_logprobs is missing", worker=worker)
            lps = []
        if len(lps) != len(ids):
            raise ContractViolation(f"{len(lps)} logprobs for {len(ids)} output tokens (never padded)", worker=worker)
        logprobs = _token_logprobs(lps, 0, worker)
        top = None
        if request.sampling.top_logprobs:
            top = _completion_top_logprobs(lp_obj, ids, request.sampling.top_logprobs, worker)
        return logprobs, top

    def _completion_text(
        self, request: GenerateRequest, choice: Mapping[str, Any], reason: FinishReason, matched: int | str | None
    ) -> str | None:
        """The choice's text where the request has stop strings, trimmed at a matched one as SGLang
        does (``no_stop_trim`` keeps it)."""
        if not (request.sampling.stop and isinstance(choice.get("text"), str)):
            return None
        text: str = choice["text"]
        stopped_at = matched if isinstance(matched, str) and reason is FinishReason.STOP else None
        if self.routes.worker_stop_strings:
            # The worker matched: the text is the whole output's, cut here as SGLang does.
            if stopped_at is not None:
                text = trim_at_stop(text, stopped_at, no_stop_trim=request.sampling.no_stop_trim)
        elif request.sampling.no_stop_trim and stopped_at is not None:
            # The frontend hides a matched stop string (SGLang's default trim); no_stop_trim keeps it.
            text += stopped_at
        return text

    def _finish(
        self,
        request: GenerateRequest,
        choice: Mapping[str, Any],
        nvext: Mapping[str, Any],
        engine_data: Mapping[str, Any],
        ids: list[int],
        worker: str | None,
    ) -> tuple[FinishReason, int | str | None]:
        raw = engine_data.get("finish_reason")
        if raw is None:
            raw = choice.get("finish_reason")
        if raw in ("abort", "cancelled"):
            return FinishReason.ABORT, None
        if raw == "length":
            return FinishReason.LENGTH, None
        if raw in ("stop", "eos"):
            worker_matched = engine_data.get(MATCHED_STOP_KEY)
            if isinstance(worker_matched, str) and worker_matched in request.sampling.stop:
                return FinishReason.STOP, worker_matched  # the worker matched it (worker_stop_strings)
            stop_reason = nvext.get("stop_reason")
            if isinstance(stop_reason, str) and stop_reason in request.sampling.stop:
                # The frontend matched a stop string (it does; the worker sees token ids): the token
                # completing it is the last one, as in SGLang. Its engine_data never comes.
                return FinishReason.STOP, stop_reason
            last = ids[-1] if ids else None
            matched = stop_reason if _is_int(stop_reason) else last
            if "finish_reason" not in engine_data:
                # 1.4.2 reports an aborted request as "stop": a stop whose last token ends nothing
                # the request could stop on is an abort.
                stops = set(request.sampling.stop_token_ids) | set(self.eos_token_ids)
                if last is None or request.sampling.ignore_eos or (stops and last not in stops):
                    return FinishReason.ABORT, None
            return FinishReason.STOP, matched if _is_int(matched) else None
        raise ContractViolation(f"unknown finish reason {raw!r}", worker=worker)

    # -- control ----------------------------------------------------------------------------

    def _tm(
        self, worker: Worker, method: str, arg: Mapping[str, Any] | None = None, cls: str | None = None
    ) -> HttpRequest:
        """``call_tokenizer_manager`` (1.4.x with ``--enable-rl``); an io_struct arg is typed by ``cls``."""
        args: list[Any] = [] if arg is None else [{f"io_struct.{cls}": dict(arg)} if cls else dict(arg)]
        body = {"method": method, "args": args, "kwargs": {}}
        return HttpRequest("POST", f"{worker.control_url}/engine/call_tokenizer_manager", json=body)

    def _engine(self, worker: Worker, route: str, body: Mapping[str, Any] | None = None) -> HttpRequest:
        return HttpRequest("POST", f"{worker.control_url}/engine/{route}", json=dict(body or {}))

    def control(self, op: Operation, worker: Worker) -> HttpRequest | tuple[HttpRequest, ...] | None:
        match op:
            case Live():
                return HttpRequest("GET", f"{worker.control_url}/live", timeout=5.0, idempotent=True)
            case Ready():
                if worker.instance_id is None:
                    return None
                return HttpRequest("GET", f"{self.frontend_url}/health", timeout=5.0, idempotent=True)
            case Progress():
                if not self.pinning or worker.instance_id is None:
                    return None
                probe = GenerateRequest(input_ids=(1,), return_logprobs=False)
                body = completion_body(probe, self.model, logprobs=False, instance_id=worker.instance_id)
                body.update(max_tokens=1, temperature=0.0, ignore_eos=True)
                return HttpRequest("POST", f"{self.frontend_url}/v1/completions", json=body, timeout=self.probe_timeout)
            case BeginWeightUpdate() | EndWeightUpdate():
                return None
            case AbortRequest(request_id=rid) if self.routes.rollout_routes:
                return self._engine(worker, "rollout/abort", {"rid": rid})
            case GetVersion():
                if not self.routes.rollout_routes:
                    return None
                return HttpRequest(
                    "POST", f"{worker.control_url}/engine/rollout/weight_version", json={}, idempotent=True
                )
        if self.routes.vllm:
            return vllm_control(op, worker)
        if isinstance(op, AbortRequest):
            return None  # no route aborts one request: the fleet cancels its own call
        if not self.routes.sglang:
            if isinstance(op, SetVersion) and self.version_source is VersionSource.STAMPED:
                return None  # no engine holds a label: the version is the fleet's (stamped on answers)
            # The mocker (and a bare instance) has no engine routes: 404 for every one of them.
            raise Unsupported(op.name, f"{self.flavor.value} workers have no engine control routes")
        return self._sglang_control(op, worker)

    def _sglang_control(self, op: Command, worker: Worker) -> HttpRequest | None:
        """dynamo.sglang's engine routes: native (1.6.x) or through the tokenizer manager (1.4.x)."""
        native = self.routes.native

        def native_or_tm(route: str, body: Mapping[str, Any] | None, cls: str | None) -> HttpRequest:
            if native:
                return self._engine(worker, route, body)
            return self._tm(worker, route, body, cls)

        match op:
            case AbortAll():
                if not self.routes.abort:
                    raise Unsupported(
                        op.name,
                        f"{self.flavor.value} workers serve no abort-all route that works over SGLang 0.5.16/0.5.17 "
                        "(stock dynamo.sglang 1.6.x; its workers through the shim serve one: sglang16-shim)",
                    )
                if self.routes.rollout_abort_all:
                    return self._engine(worker, "rollout/abort", {"abort_all": True})
                if native:
                    return self._engine(worker, "abort_request", {"abort_all": True})
                # Plain kwargs: a typed io_struct arg would become `rid`.
                body = {"method": "abort_request", "args": [], "kwargs": {"abort_all": True}}
                return HttpRequest("POST", f"{worker.control_url}/engine/call_tokenizer_manager", json=body)
            case Pause(mode=mode):
                return native_or_tm("pause_generation", {"mode": mode.value}, "PauseGenerationReqInput")
            case Resume():
                return native_or_tm("continue_generation", {}, "ContinueGenerationReqInput")
            case FlushCache(wait_s=wait_s):
                if native:  # 1.6.x: Engine.flush_cache() takes no wait; refused while busy, resent
                    return self._engine(worker, "flush_cache")
                # TokenizerManager.flush_cache(timeout_s=): SGLang defers the flush until idle.
                body = {"method": "flush_cache", "args": [], "kwargs": {"timeout_s": wait_s}}
                return HttpRequest("POST", f"{worker.control_url}/engine/call_tokenizer_manager", json=body)
            case InitWeightGroup(group=g, rank_offset=rank_offset):
                body = init_group_body(g, rank_offset)
                return native_or_tm("init_weights_update_group", body, "InitWeightsUpdateGroupReqInput")
            case DestroyWeightGroup(group_name=group_name):
                body = {"group_name": group_name}
                return native_or_tm("destroy_weights_update_group", body, "DestroyWeightsUpdateGroupReqInput")
            case UpdateFromDistributed():
                return self._engine(worker, "control/update_weights_from_distributed", distributed_body(op))
            case UpdateFromTensors():
                return self._engine(worker, "control/update_weights_from_tensor", tensors_body(op, worker.ranks))
            case UpdateFromDisk():
                return self._engine(worker, "control/update_weights_from_disk", disk_body(op))
            case SetVersion(version=version):
                return self._engine(worker, "control/update_weight_version", set_version_body(version))
            case ReleaseMemory(tags=tags):
                route = "release_memory_occupation"
                return self._engine(worker, route if native else f"control/{route}", memory_body(tags))
            case ResumeMemory(tags=tags):
                route = "resume_memory_occupation"
                return self._engine(worker, route if native else f"control/{route}", memory_body(tags))
            case AbortRequest() | BeginWeightUpdate() | EndWeightUpdate():
                return None  # answered by ``control`` before it comes here
        unhandled(op)

    def parse_control(self, op: Command, worker: Worker, response: HttpResponse) -> None:
        failed = not response.ok
        if failed and isinstance(op, AbortAll) and self.routes.abort_all_await_bug and "await" in response.text:
            return  # dispatched: see ``FlavorRoutes.abort_all_await_bug``
        if isinstance(op, FlushCache) and self.routes.native and response.ok:
            data = response.json()
            if _flush_refused_busy(data):  # the driver resends it while the flush may wait
                said = json.dumps(data)[:200]
                raise Overloaded(f"refused while requests are pending (SGLang answered {said})", worker=worker.id)
        self._checked(op.name, worker, response)

    def _checked(self, name: str, worker: Worker, response: HttpResponse) -> Any:
        if not response.ok:
            raise ControlFailed(
                name, [WorkerFailure(worker.id, name, f"HTTP {response.status}: {_error_message(response)}")]
            )
        data = _struct_result(response.json())
        if isinstance(data, dict) and set(data) == {"result"}:
            # ``RLMixin._normalize_result``'s fallback for a value it does not know: whether the
            # engine did it is unknown, and a refused flush must never read as done.
            raise ContractViolation(f"{name}: unreadable engine result {str(data['result'])[:120]!r}", worker=worker.id)
        if isinstance(data, dict) and (data.get("success") is False or data.get("status") == "error"):
            said = data.get("message") or json.dumps(data)[:200]  # never an empty reason
            raise ControlFailed(name, [WorkerFailure(worker.id, name, str(said))])
        return data

    def parse_version(self, worker: Worker, response: HttpResponse) -> str | None:
        data = self._checked(GetVersion.name, worker, response)
        if not isinstance(data, dict) or "weight_version" not in data:
            raise ContractViolation("rollout/weight_version has no weight_version", worker=worker.id)
        v = data["weight_version"]
        return None if v is None else str(v)

    def parse_probe(self, probe: Probe, worker: Worker, response: HttpResponse) -> bool:
        match probe:
            case Live():
                # The process answers (the mocker's system port always answers 503 "notready").
                return response.status in (200, 503)
            case Ready():
                if not response.ok:
                    return False
                instances = generate_instances(response.json(), self.namespace)
                if worker.instance_id in {i.get("instance_id") for i in instances}:
                    return True
                port = self.worker_rpc_ports.get(worker.id)
                return port is not None and port in {_rpc_port_of(i) for i in instances}
            case Progress():
                return response.ok
        unhandled(probe)

    def router_health(self) -> HttpRequest | None:
        return HttpRequest("GET", f"{self.frontend_url}/live", timeout=5.0, idempotent=True)


class _CompletionStream:
    """The frontend's ``/v1/completions`` SSE answer (1.4.2, measured on the H200: bench/rb_bench/
    capture.py): each chunk holds its *new* tokens (``nvext.completion_token_ids``,
    ``choices[0].logprobs``), the last one also ``finish_reason`` and ``nvext.engine_data``;
    ``data: [DONE]`` at the end. The final ``Generation`` is the non-streamed answer's parse
    (``parse_completion``) of the chunks put together. Where the workers stamp every chunk
    (``FlavorRoutes.chunk_versions``), a chunk before the last has ``nvext.engine_data`` holding
    only ``CHUNK_VERSION_KEY``: its tokens' version (``TokenChunk.weight_version``), not the end."""

    __slots__ = ("ids", "lps", "request", "text", "tokens", "tops", "wire", "worker")

    def __init__(self, wire: DynamoWire, request: GenerateRequest, worker: str | None) -> None:
        self.wire, self.request, self.worker = wire, request, worker
        self.ids: list[int] = []
        self.lps: list[object] = []
        self.tokens: list[object] = []
        self.tops: list[object] = []
        self.text = ""

    def event(self, data: bytes, latency_s: float) -> TokenChunk | None:
        event = sse_json(data, "streamed /v1/completions", worker=self.worker)
        if event is None:
            return None
        if not isinstance(event, dict):
            raise ContractViolation(f"a /v1/completions chunk is {type(event).__name__}, expected an object")
        if "error" in event:
            refused = _refused(event["error"]) if not self.ids else None
            if refused is not None:
                raise refused
            raise BackendUnavailable(
                f"frontend: the stream failed after {len(self.ids)} tokens: {event['error']!r}", worker=self.worker
            )
        choices = event.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise ContractViolation("a /v1/completions chunk has no single choice", worker=self.worker)
        choice = choices[0]
        nvext = event.get("nvext") if isinstance(event.get("nvext"), dict) else {}
        assert isinstance(nvext, dict)
        if self.worker is None:
            self.worker = self.wire.worker_of(nvext)
        ids = nvext.get("completion_token_ids", choice.get("token_ids", []))
        if not _int_list(ids):
            raise ContractViolation("a chunk's completion_token_ids are not integers", worker=self.worker)
        lp_obj = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else {}
        assert isinstance(lp_obj, dict)
        n = len(self.ids)
        engine_data = nvext.get("engine_data")
        version = _chunk_version(engine_data, self.worker)
        version_only = isinstance(engine_data, dict) and set(engine_data) == {CHUNK_VERSION_KEY}
        if choice.get("finish_reason") is not None or ("engine_data" in nvext and not version_only):
            merged_lp = {
                **lp_obj,
                "tokens": [*self.tokens, *(lp_obj.get("tokens") or ())],
                "token_logprobs": [*self.lps, *(lp_obj.get("token_logprobs") or ())],
                "top_logprobs": [*self.tops, *(lp_obj.get("top_logprobs") or ())],
            }
            text = choice.get("text")
            merged_choice = {**choice, "text": self.text + text if isinstance(text, str) else self.text}
            if lp_obj or self.lps:
                merged_choice["logprobs"] = merged_lp
            merged = {
                **event,
                "choices": [merged_choice],
                "nvext": {**nvext, "completion_token_ids": [*self.ids, *ids]},
            }
            gen = self.wire.parse_completion(self.request, merged, latency_s)
            closing = TokenChunk.closing(gen, min(n, len(gen.output_ids)))
            # The last tokens' own version where the worker sent it (closing() takes the finish's).
            return closing if version is None else attrs.evolve(closing, weight_version=version)
        chunk = self._delta(ids, lp_obj, n, version)
        self.ids.extend(ids)
        if isinstance(choice.get("text"), str):
            self.text += choice["text"]
        return chunk

    def _delta(self, ids: list[int], lp_obj: Mapping[str, Any], n: int, version: str | None) -> TokenChunk:
        """A chunk before the last: its tokens (and logprobs, kept for the final parse)."""
        request = self.request
        logprobs = top = None
        if request.return_logprobs and self.wire.flavor != "mocker":
            lps = lp_obj.get("token_logprobs")
            if not isinstance(lps, list) or len(lps) != len(ids):
                got = len(lps) if isinstance(lps, list) else type(lps).__name__
                raise ContractViolation(f"a chunk has {got} logprobs for {len(ids)} tokens", worker=self.worker)
            logprobs = _token_logprobs(lps, n, self.worker)
            self.lps.extend(lps)
            self.tokens.extend(lp_obj.get("tokens") or ())
            if request.sampling.top_logprobs:
                top = _completion_top_logprobs(lp_obj, ids, request.sampling.top_logprobs, self.worker)
                self.tops.extend(lp_obj.get("top_logprobs") or ())
        if request.sampling.max_new_tokens == 0:  # re-scoring: the one token generated is not the caller's
            return TokenChunk(request_id=request.request_id, index=0, output_ids=())
        return TokenChunk(
            request_id=request.request_id,
            index=n,
            output_ids=tuple(ids),
            logprobs=logprobs,
            top_logprobs=top,
            weight_version=version,
        )
