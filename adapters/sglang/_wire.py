"""SGLang's native HTTP API as a ``Wire``: request builders and response parsers only.

Endpoints and bodies follow SGLang 0.5.16 (and 0.5.23 where they differ: begin/end weight-update
sessions are sent only when the server lists them). Control calls go to each worker's own URL;
routers (smg, sglang-router) forward none of them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from operator import countOf
from typing import Any

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
    RolloutBackendError,
    RoutingKind,
    SamplingParams,
    VersionSource,
    WeightTransport,
    WorkerFailure,
)
from rollout_backends.kit import HttpRequest, HttpResponse, Op, Worker

__all__ = ["SGLangWire", "sampling_params_body"]

#: Header smg's consistent-hashing policy routes on; harmless for other policies.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


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
        "no_stop_trim": True,
    }
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.min_new_tokens:
        body["min_new_tokens"] = s.min_new_tokens
    if s.seed is not None:
        body["sampling_seed"] = s.seed
    return body


_FIELD_RE = re.compile(r"unknown field `([^`]+)`")
#: smg error codes that guarantee the request never reached an engine (smg 1.13: the connection to
#: the worker failed). ``call_upstream_request_error`` (the worker died mid-request) is not one.
_NOT_STARTED_CODES = frozenset({"call_upstream_connection_failed"})


def _error_code(resp: HttpResponse) -> str | None:
    """smg's ``{"error": {"code": ...}}``, if the body has one."""
    try:
        data = resp.json()
    except ContractViolation:
        return None
    err = data.get("error") if isinstance(data, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


def _error_message(resp: HttpResponse) -> str:
    try:
        data = resp.json()
    except ContractViolation:
        return resp.text[:500]
    if isinstance(data, dict):
        err = data.get("error", data.get("message", data.get("detail")))
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return resp.text[:500]


def _field_of(message: str) -> str:
    """Best-effort mapping of an SGLang 400 message to our field name."""
    m = _FIELD_RE.search(message)
    if m:
        return f"sampling.{m.group(1)}"
    low = message.lower()
    if "sampling_params" in low or "sampling param" in low:
        return "sampling"
    if "rid" in low and "duplicate" in low:
        return "request_id"
    return "input_ids"


def _generation_error(response: HttpResponse) -> RolloutBackendError:
    """The error for a ``/generate`` answer that is not HTTP 200 (off the hot path: one compare there)."""
    status = response.status
    if status == 400 or status == 422:
        msg = _error_message(response)
        return InvalidRequest(_field_of(msg), msg)
    if status in (401, 403):
        return InvalidRequest("api_key", f"HTTP {status}: the server refused the API key (missing or wrong)")
    if status in (429, 503):
        return Overloaded(f"HTTP {status}: {_error_message(response)}")
    if status >= 500:
        code = _error_code(response)
        if code in _NOT_STARTED_CODES:
            # The router could not connect to any worker: no engine saw the request.
            return ConnectionFailed(
                f"router: HTTP {status} {code}: {_error_message(response)} (no token was generated)",
                nothing_generated=True,
            )
        return BackendUnavailable(f"HTTP {status}: {_error_message(response)}")
    if status == 404 and _error_code(response) == "model_not_found":
        return BackendUnavailable(f"router: {_error_message(response)}")
    return ContractViolation(f"/generate answered HTTP {status}: {_error_message(response)}")


@attrs.frozen(slots=True, kw_only=True)
class SGLangWire:
    """Configuration of one SGLang fleet's wire format.

    ``entry_url`` is the router (or the single server) that takes generation.
    """

    entry_url: str
    routing: RoutingKind = RoutingKind.SINGLE
    has_begin_end: bool = False
    has_ready_route: bool = False
    memory_saver: bool = False
    deterministic: bool = False
    max_context: int | None = None
    vocab_size: int | None = None
    probe_timeout: float = 20.0

    def capabilities(self) -> Capabilities:
        return Capabilities(
            pause_modes=set(PauseMode),
            weight_transports=set(WeightTransport),
            memory_release=self.memory_saver,
            logprobs=True,
            streaming=False,
            routing=self.routing,
            abort=True,
            seeded_sampling=self.deterministic,
            begin_end_update=self.has_begin_end,
            version_source=VersionSource.RESPONSE,
            cached_tokens=True,
            worker_pinning=True,
            batch_invariant=self.deterministic,
            max_context=self.max_context,
            vocab_size=self.vocab_size,
        )

    # -- generation -------------------------------------------------------------------------

    def generate(self, request: GenerateRequest, worker: Worker | None) -> HttpRequest:
        base = (worker.generate_url or worker.control_url) if worker is not None else self.entry_url
        body: dict[str, Any] = {
            # The validated tuple itself: JSON encodes it as the same array, and a list copy
            # (one 1 KB allocation per 128 tokens, freed cold after the answer) was measurable.
            "input_ids": request.input_ids,
            "sampling_params": sampling_params_body(request.sampling),
            "return_logprob": request.return_logprobs,
            "rid": request.request_id,
        }
        headers = {ROUTING_KEY_HEADER: request.routing_key} if request.routing_key else {}
        return HttpRequest("POST", f"{base}/generate", json=body, headers=headers)

    def parse_generation(
        self, request: GenerateRequest, response: HttpResponse, latency_s: float, *, worker: str | None = None
    ) -> Generation:
        if response.status != 200:
            raise _generation_error(response)
        data = response.json()
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        if not isinstance(data, dict):
            raise ContractViolation(f"/generate answered {type(data).__name__}, expected an object")
        return parse_native_generation(request, data, latency_s, worker=worker)

    # -- control ----------------------------------------------------------------------------

    def control(self, op: Op, worker: Worker, **args: Any) -> HttpRequest | None:
        url = worker.control_url

        def post(path: str, body: dict[str, Any] | None = None) -> HttpRequest:
            # Every POST control route is one of SGLang's admin routes (ADMIN_OPTIONAL): the
            # client sends its admin key (``HttpClient(admin_api_key=...)``) on them.
            return HttpRequest("POST", f"{url}{path}", json=body if body is not None else {}, admin=True)

        if op is Op.ABORT:
            return post("/abort_request", {"rid": args["request_id"], "abort_all": False})
        if op is Op.ABORT_ALL:
            return post("/abort_request", {"rid": "", "abort_all": True})
        if op is Op.PAUSE:
            return post("/pause_generation", {"mode": PauseMode(args["mode"]).value})
        if op is Op.RESUME:
            return post("/continue_generation", {})
        if op is Op.FLUSH_CACHE:
            return post("/flush_cache", None)
        if op is Op.INIT_GROUP:
            g = args["group"]
            return post(
                "/init_weights_update_group",
                {
                    "master_address": g.master_address,
                    "master_port": g.master_port,
                    "rank_offset": args["rank_offset"],
                    "world_size": g.world_size,
                    "group_name": g.group_name,
                    "backend": g.backend,
                },
            )
        if op is Op.UPDATE_DISTRIBUTED:
            b = args["bucket"]
            body = {
                "names": b.names,
                "dtypes": b.dtypes,
                "shapes": b.shapes,
                "group_name": args["group_name"],
                "flush_cache": args["flush_cache"],
                "abort_all_requests": False,
            }
            if args.get("version") is not None:
                body["weight_version"] = args["version"]
            return post("/update_weights_from_distributed", body)
        if op is Op.UPDATE_TENSORS:
            body = {
                "serialized_named_tensors": [args["payload"]] * worker.ranks,
                "load_format": args.get("load_format"),
                "flush_cache": args["flush_cache"],
                "abort_all_requests": False,
            }
            if args.get("version") is not None:
                body["weight_version"] = args["version"]
            return post("/update_weights_from_tensor", body)
        if op is Op.UPDATE_DISK:
            body = {"model_path": args["path"], "abort_all_requests": False, "flush_cache": args["flush_cache"]}
            if args.get("load_format") is not None:
                body["load_format"] = args["load_format"]
            if args.get("version") is not None:
                body["weight_version"] = args["version"]
            return post("/update_weights_from_disk", body)
        if op is Op.DESTROY_GROUP:
            return post("/destroy_weights_update_group", {"group_name": args["group_name"]})
        if op is Op.BEGIN:
            return post("/begin_weight_update", {"selector": args["selector"]}) if self.has_begin_end else None
        if op is Op.END:
            return post("/end_weight_update", {}) if self.has_begin_end else None
        if op is Op.SET_VERSION:
            # abort_all_requests defaults to true upstream and kills in-flight rollouts (miles#2372).
            return post("/update_weight_version", {"new_version": args["version"], "abort_all_requests": False})
        if op is Op.RELEASE_MEMORY or op is Op.RESUME_MEMORY:
            tags = args.get("tags")
            path = "/release_memory_occupation" if op is Op.RELEASE_MEMORY else "/resume_memory_occupation"
            return post(path, {"tags": None if tags is None else [t.value for t in tags]})
        if op is Op.GET_VERSION:
            return HttpRequest("GET", f"{url}/model_info", idempotent=True)
        if op is Op.LIVE:
            return HttpRequest("GET", f"{url}/health", timeout=self.probe_timeout, idempotent=True)
        if op is Op.READY:
            return HttpRequest("GET", f"{url}/ready", timeout=5.0, idempotent=True) if self.has_ready_route else None
        if op is Op.PROBE:
            return HttpRequest("GET", f"{url}/health_generate", timeout=self.probe_timeout, idempotent=True)
        raise ValueError(f"unknown op {op}")  # pragma: no cover

    def parse_control(self, op: Op, worker: Worker, response: HttpResponse) -> Any:
        if op in (Op.LIVE, Op.READY, Op.PROBE):
            return response.ok
        if not response.ok:
            raise ControlFailed(
                op.value, [WorkerFailure(worker.id, op.value, f"HTTP {response.status}: {_error_message(response)}")]
            )
        if op is Op.FLUSH_CACHE:
            return None  # plain text on success
        data = response.json()
        if isinstance(data, dict) and data.get("success") is False:
            raise ControlFailed(op.value, [WorkerFailure(worker.id, op.value, str(data.get("message", data)))])
        if op is Op.GET_VERSION:
            if not isinstance(data, dict) or "weight_version" not in data:
                raise ContractViolation("/model_info has no weight_version", worker=worker.id)
            v = data["weight_version"]
            return None if v is None else str(v)
        return data

    def router_health(self) -> HttpRequest | None:
        if self.routing is RoutingKind.SINGLE:
            return None
        return HttpRequest("GET", f"{self.entry_url}/health", timeout=5.0, idempotent=True)


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


def _finish(meta: dict[str, Any], n_out: int) -> tuple[FinishReason, int | None]:
    fr = meta.get("finish_reason")
    if fr is None:
        raise ContractViolation("meta_info.finish_reason is missing")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    reason = _FINISH.get(kind) if isinstance(kind, str) else None
    if reason is None:
        try:
            reason = FinishReason(kind)
        except ValueError:
            raise ContractViolation(f"unknown finish reason {fr!r}") from None
    matched = fr.get("matched") if isinstance(fr, dict) else None
    return reason, matched if isinstance(matched, int) and not isinstance(matched, bool) else None


def parse_native_generation(
    request: GenerateRequest, data: dict[str, Any], latency_s: float, *, worker: str | None
) -> Generation:
    """Parse SGLang's native ``/generate`` body (shared with the facade and the Dynamo native path)."""
    meta = data.get("meta_info")
    out = data.get("output_ids")
    if not isinstance(meta, dict) or not isinstance(out, list):
        raise ContractViolation("/generate answer lacks output_ids or meta_info", worker=worker)
    # One C-level pass for the common case; the generator names nothing but keeps the exact rule.
    if countOf(map(type, out), int) != len(out) and not all(
        isinstance(t, int) and not isinstance(t, bool) for t in out
    ):
        raise ContractViolation("output_ids are not all ints", worker=worker)
    output_ids = tuple(out)
    reason, matched = _finish(meta, len(out))
    logprobs: tuple[float, ...] | None = None
    if request.return_logprobs:
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list):
            raise ContractViolation("meta_info.output_token_logprobs is missing", worker=worker)
        if len(entries) != len(out):
            raise ContractViolation(
                f"{len(entries)} logprob entries for {len(out)} output tokens (never padded)", worker=worker
            )
        logprobs = _fast_logprobs(entries, output_ids) if entries else ()
        if logprobs is None:
            logprobs = _checked_logprobs(entries, output_ids, worker)
    version = meta.get("weight_version")
    return Generation(
        request_id=str(meta.get("id") or request.request_id),
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=reason,
        weight_version=None if version is None else str(version),
        prompt_tokens=int(meta.get("prompt_tokens", len(request.input_ids))),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        worker=worker,
        latency_s=latency_s,
        matched_stop=matched if reason is FinishReason.STOP else None,
    )
