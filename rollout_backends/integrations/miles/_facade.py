"""An SGLang-compatible facade over any ``RolloutBackend``, served where Miles expects its router.

Miles is given the facade's address as ``--sglang-router-ip/--sglang-router-port``. It then finds,
with no change to Miles:

* the data plane: ``POST /generate`` (Miles' exact payload, ``X-SMG-Routing-Key`` header) and
  ``POST /v1/chat/completions`` with SGLang's extensions (``input_ids`` in, ``choices[i].meta_info``
  out) for the session server, ``logprobs`` + ``top_logprobs`` answered as SGLang's OpenAI server does;
  batched ``/generate`` as SGLang serves it; on both, Miles' external-rollout version contract in
  Stitch's words (``weight_version`` constraints, HTTP 409, start/end stamps: ``_versioning``);
* the router's worker list: ``GET /workers`` (SMG shape) and ``GET /list_workers`` (Miles router
  shape), each worker listed at ``<facade>/w/<worker>`` so Miles' abort loop
  ``POST <worker url>/abort_request {"abort_all": true}`` reaches it;
* per worker (``/w/<worker>/...``, or on the worker's own port with ``worker_ports``) SGLang's control
  endpoints, translated to protocol calls with ``workers=[worker]``; at the root the same endpoints
  act on every worker.

Responses are SGLang's exact shapes (sglang 0.5.x): ``[logprob, id, null]`` logprob entries,
``finish_reason`` objects, ``success: false`` with HTTP 400 on failed control calls.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
from aiohttp import web

from rollout_backends import (
    BackendUnavailable,
    ContractViolation,
    FinishReason,
    GenerateRequest,
    Generation,
    InvalidRequest,
    NoCompatibleVersion,
    RolloutBackend,
    RolloutBackendError,
    SamplingParams,
    StaleWeights,
    TransientError,
    Unsupported,
    __version__,
)
from rollout_backends.kit import AbortAll, AbortRequest, json_loads
from rollout_backends.sglang_native import (
    ADMIN_ROUTES,
    ROUTING_KEY_HEADER,
    NativeRequest,
    ParseRules,
    UnknownKeys,
    answer_body,
    batch_field,
    decode_text,
    meta_info,
    native_field,
    parse_abort_body,
    parse_destroy_group_body,
    parse_disk_body,
    parse_distributed_body,
    parse_init_group_body,
    parse_memory_body,
    parse_pause_body,
    parse_request,
    parse_set_version_body,
    parse_tensors_body,
    split_batch,
)

from ._shapes import decode_tensor_payload
from ._versioning import (
    WEIGHT_VERSION_KEY,
    VersionConstraint,
    parse_constraint,
    refusal_body,
    stamp_meta,
    stamp_top_level,
)

__all__ = ["ROUTING_KEY_HEADER", "MilesFacade", "RunningFacade", "start_facade"]

logger = logging.getLogger(__name__)

_SAFE_TOKEN = re.compile(r"^[A-Za-z0-9._:@-]+$")
_FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)"
)
Handler = Callable[[web.Request, "tuple[str, ...] | None"], Awaitable[web.StreamResponse]]
#: How a route answers an error: (status, message, the field a refusal names) -> the response.
ErrorAnswer = Callable[[int, str, "str | None"], web.StreamResponse]

_OPEN_PREFIXES = ("/health", "/metrics")
_WORKER_PREFIX = re.compile(r"^/w/[^/]+(?=/)")


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, NoCompatibleVersion):
        return 409  # Stitch's retryable refusal (the body: _versioning.refusal_body)
    if isinstance(exc, (TransientError, BackendUnavailable)):
        return 503
    if isinstance(exc, ContractViolation):
        return 502
    if isinstance(exc, _HttpError):
        return exc.status
    return 400


def _openai_error(status: int, message: str, field: str | None = None) -> web.Response:
    """SGLang's error shape; a refusal of the caller's input also names the field as the caller
    spelled it (``param``, the codec's :func:`~rollout_backends.sglang_native.error_body`)."""
    kind = "BadRequestError" if status < 500 else "ServiceUnavailableError"
    err: dict[str, Any] = {"message": message, "type": kind, "code": status}
    if field is not None:
        err.update(type="invalid_request_error", param=field)
    return web.json_response({"object": "error", "error": err, "message": message}, status=status)


def _control_error(status: int, message: str, field: str | None = None) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=status)


def _ok(message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": True, "message": message, **extra})


async def _json_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        data = json_loads(raw)
    except (ValueError, RecursionError) as exc:  # orjson refuses past 1024 levels, the stdlib recurses
        raise InvalidRequest("body", f"invalid JSON: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidRequest("body", f"must be a JSON object, got {type(data).__name__}")
    return data


def _caller_field(exc: InvalidRequest) -> InvalidRequest:
    """A backend's refusal (our field names) as a native caller spells it (``sampling_params.sampling_seed``)."""
    return InvalidRequest(native_field(exc.field), exc.reason)


#: Chat keys that are SGLang sampling parameters (``ChatCompletionRequest.to_sampling_params``);
#: the first of two spellings present wins (``max_completion_tokens`` over ``max_tokens``).
_CHAT_SAMPLING = {
    "max_completion_tokens": "max_new_tokens",
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "stop": "stop",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "no_stop_trim": "no_stop_trim",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "logit_bias": "logit_bias",
    "regex": "regex",
    "ebnf": "ebnf",
}
#: Chat keys the protocol cannot honour: refused while set.
_CHAT_REFUSED = {
    "lora_path": "LoRA is not part of the protocol",
    "return_routed_experts": "routed experts are not part of the protocol",
    "return_indexer_topk": "indexer top-k is not part of the protocol",
    "return_hidden_states": "hidden states are not part of the protocol",
    "response_format": "constrained decoding is not part of the protocol",
    "tool_choice": "tool choice is not supported by the facade",
    "custom_logit_processor": "custom logit processors are not part of the protocol",
}
#: Every key a chat completion may carry (OpenAI's, and SGLang's extensions); others are refused
#: unless ``UnknownKeys.IGNORE``.
_CHAT_KEYS = frozenset(
    {
        *_CHAT_SAMPLING, *_CHAT_REFUSED, "messages", "model", "n", "stream", "stream_options", "logprobs",
        "top_logprobs", "tools", "parallel_tool_calls", "user", "metadata", "store", "reasoning_effort",
        "service_tier", "chat_template_kwargs", "continue_final_message", "separate_reasoning",
        "stream_reasoning", "rid", "return_meta_info", "return_prompt_token_ids", "input_ids",
        WEIGHT_VERSION_KEY,
    }
)  # fmt: skip


def _opt_bool(body: Mapping[str, Any], key: str) -> bool:
    """``body[key]`` as a JSON boolean (absent or null: false); a string is not one."""
    v = body.get(key)
    if v is None:
        return False
    if type(v) is not bool:
        raise InvalidRequest(key, f"must be a boolean (true/false), got {type(v).__name__}")
    return v


def _chat_field(exc: InvalidRequest, body: Mapping[str, Any]) -> InvalidRequest:
    """A refusal of the chat's native body, naming the chat key the caller wrote (``seed``, ``max_tokens``)."""
    field = exc.field
    if field.partition("[")[0] == "top_logprobs_num":
        # The chat's ``top_logprobs`` travels as the native ``top_logprobs_num`` (SGLang's
        # ``serving_chat._convert_to_internal_request``: ``top_logprobs_num=request.top_logprobs or 0``).
        field = "top_logprobs" + field.removeprefix("top_logprobs_num")
    elif field.startswith("sampling_params."):
        name, bracket, index = field.removeprefix("sampling_params.").partition("[")
        spelled = [k for k, v in _CHAT_SAMPLING.items() if v == name and body.get(k) is not None]
        field = f"{spelled[0] if spelled else name}{bracket}{index}"
    return InvalidRequest(field, exc.reason)


@attrs.define
class MilesFacade:
    """The facade's state: the backend, an optional tokenizer (for ``text``) and presentation."""

    backend: RolloutBackend
    #: A Hugging Face tokenizer (anything with ``decode``/``encode``/``apply_chat_template``).
    tokenizer: Any = None
    model_path: str | None = None
    served_model_name: str | None = None
    #: Base URL workers are listed under; default: the scheme and Host of each request.
    public_url: str | None = None
    #: Extra keys for ``/get_server_info`` (e.g. what Miles' external-engine check compares).
    server_info: Mapping[str, Any] = attrs.field(factory=dict)
    #: Chat completions without ``max_tokens`` on a backend that does not declare its context.
    default_max_new_tokens: int = 2048
    health_timeout_s: float = 20.0
    #: SGLang's ``--api-key``: every route but ``/health*`` needs ``Authorization: Bearer <key>``.
    api_key: str | None = attrs.field(default=None, repr=False)
    #: SGLang's ``--admin-api-key``: the control routes need it (and only it) when set.
    admin_api_key: str | None = attrs.field(default=None, repr=False)
    #: Unknown top-level keys: refused naming them (a ``return_logprobs`` typo is caught);
    #: ``UnknownKeys.IGNORE`` (``--ignore-unknown-keys``) keeps SGLang's rule of dropping them.
    unknown_keys: UnknownKeys = UnknownKeys.REFUSE
    _aborts: set[asyncio.Task[None]] = attrs.field(factory=set, init=False)
    #: Request ids in flight: a second request with one is refused (SGLang's rule), not merged.
    _inflight: set[str] = attrs.field(factory=set, init=False)

    # -- auth (SGLang's rules: 401 {"error": "Unauthorized"}) ---------------------------------

    def _needed_key(self, path: str) -> str | None:
        if path.startswith(_OPEN_PREFIXES):
            return None
        route = _WORKER_PREFIX.sub("", path)
        if route.startswith(_OPEN_PREFIXES):
            return None
        if route in ADMIN_ROUTES and self.admin_api_key:
            return self.admin_api_key
        return self.api_key

    @web.middleware
    async def auth_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        need = self._needed_key(request.path) if request.method != "OPTIONS" else None
        if need:
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {need}".encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    # -- worker ids in URLs -------------------------------------------------------------------

    def token_of(self, worker: str) -> str:
        if _SAFE_TOKEN.match(worker):
            return worker
        return f"worker-{self.backend.workers.index(worker)}"

    def worker_of(self, token: str) -> str:
        for w in self.backend.workers:
            if self.token_of(w) == token:
                return w
        raise _HttpError(404, f"unknown worker {token!r} (known: {list(self.backend.workers)})")

    def _base_url(self, request: web.Request) -> str:
        return (self.public_url or f"{request.scheme}://{request.host}").rstrip("/")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path or "default"

    # -- apps ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The router app: data plane, worker list, fleet-wide control, and ``/w/<worker>/...``."""
        app = web.Application(client_max_size=1024**3, middlewares=[self.auth_middleware])
        app.router.add_route("GET", "/workers", self.handle_workers)
        app.router.add_route("GET", "/list_workers", self.handle_list_workers)
        app.router.add_route("GET", "/v1/models", self.handle_models)
        app.router.add_route("POST", "/v1/chat/completions", self.handle_chat)
        self._register(app, "", lambda request: None)
        self._register(app, "/w/{worker}", lambda request: (self.worker_of(request.match_info["worker"]),))
        return app

    def worker_app(self, worker: str) -> web.Application:
        """One worker's SGLang server surface at the root (for a per-worker port)."""
        if worker not in self.backend.workers:
            raise InvalidRequest("worker", f"unknown worker {worker!r}")
        app = web.Application(client_max_size=1024**3, middlewares=[self.auth_middleware])
        app.router.add_route("POST", "/v1/chat/completions", self.handle_chat)
        app.router.add_route("GET", "/v1/models", self.handle_models)
        self._register(app, "", lambda request: (worker,))
        return app

    def _register(
        self, app: web.Application, prefix: str, resolve: Callable[[web.Request], tuple[str, ...] | None]
    ) -> None:
        routes: list[tuple[Sequence[str], str, Handler, ErrorAnswer]] = [
            (("POST", "PUT"), "/generate", self.generate, _openai_error),
            (("GET",), "/health", self.health, _plain_error),
            (("GET",), "/health_generate", self.health_generate, _plain_error),
            (("GET",), "/model_info", self.model_info, _openai_error),
            (("GET",), "/get_model_info", self.model_info, _openai_error),
            (("GET",), "/get_weight_version", self.get_weight_version, _openai_error),
            (("GET",), "/server_info", self.server_info_handler, _openai_error),
            (("GET",), "/get_server_info", self.server_info_handler, _openai_error),
            (("POST",), "/abort_request", self.abort_request, _control_error),
            (("POST",), "/pause_generation", self.pause_generation, _control_error),
            (("POST",), "/continue_generation", self.continue_generation, _control_error),
            (("GET", "POST"), "/flush_cache", self.flush_cache, _plain_error),
            (("POST",), "/init_weights_update_group", self.init_weights_update_group, _control_error),
            (("POST",), "/destroy_weights_update_group", self.destroy_weights_update_group, _control_error),
            (("POST",), "/update_weights_from_distributed", self.update_weights_from_distributed, _control_error),
            (("POST",), "/update_weights_from_tensor", self.update_weights_from_tensor, _control_error),
            (("POST",), "/update_weights_from_disk", self.update_weights_from_disk, _control_error),
            (("POST",), "/update_weight_version", self.update_weight_version, _control_error),
            (("POST",), "/begin_weight_update", self.begin_weight_update, _control_error),
            (("POST",), "/end_weight_update", self.end_weight_update, _control_error),
            (("GET", "POST"), "/release_memory_occupation", self.release_memory_occupation, _openai_error),
            (("GET", "POST"), "/resume_memory_occupation", self.resume_memory_occupation, _openai_error),
            (("GET", "POST"), "/weights_checker", self.unsupported("weights_checker"), _control_error),
            (("POST",), "/pull_weights", self.unsupported("pull_weights"), _control_error),
            (("POST",), "/load_lora_adapter", self.unsupported("lora"), _control_error),
            (("POST",), "/load_lora_adapter_from_tensors", self.unsupported("lora"), _control_error),
            (("POST",), "/load_lora_adapter_from_distributed", self.unsupported("lora"), _control_error),
            (("POST",), "/unload_lora_adapter", self.unsupported("lora"), _control_error),
        ]
        for methods, path, handler, on_error in routes:
            wrapped = _wrap(handler, resolve, on_error)
            for method in methods:
                app.router.add_route(method, prefix + path, wrapped)

    # -- worker list --------------------------------------------------------------------------

    async def _healthy(self) -> dict[str, bool]:
        try:
            report = await asyncio.wait_for(self.backend.health(), 10.0)
        except (RolloutBackendError, asyncio.TimeoutError):
            return dict.fromkeys(self.backend.workers, False)
        return {w.worker: w.live for w in report.workers}

    async def handle_workers(self, request: web.Request) -> web.Response:
        base = self._base_url(request)
        healthy = await self._healthy()
        workers = [
            {
                "id": w,
                "url": f"{base}/w/{self.token_of(w)}",
                "model_id": self.model_name,
                "worker_type": "regular",
                "connection_mode": "http",
                "is_healthy": healthy.get(w, False),
                "load": 0,
                "priority": 50,
                "cost": 1.0,
            }
            for w in self.backend.workers
        ]
        n = len(workers)
        return web.json_response(
            {"workers": workers, "total": n, "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": n}}
        )

    async def handle_list_workers(self, request: web.Request) -> web.Response:
        base = self._base_url(request)
        return web.json_response({"urls": [f"{base}/w/{self.token_of(w)}" for w in self.backend.workers]})

    async def handle_models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "rollout-backends"}],
            }
        )

    # -- data plane ---------------------------------------------------------------------------

    async def _run_generation(self, request: GenerateRequest) -> Generation:
        try:
            return await self.backend.generate(request)
        except asyncio.CancelledError:
            # The client went away: SGLang aborts the request then; so do we.
            task = asyncio.ensure_future(self.backend.abort(request.request_id))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise

    def _pinned(self, workers: tuple[str, ...] | None) -> str | None:
        if workers is None:
            return None
        if not self.backend.capabilities.worker_pinning:
            raise Unsupported("worker_pinning", "this backend cannot serve a request on a chosen worker")
        return workers[0]

    def _rules(self) -> ParseRules:
        caps = self.backend.capabilities
        return ParseRules(
            unknown_keys=self.unknown_keys,
            vocab_size=caps.vocab_size,
            max_context=caps.max_context,
            # Miles' --recompute-logprobs-via-prefill sends max_new_tokens 0 with logprob_start_len.
            allow_prefill_only=caps.prompt_logprobs,
            # --rollout-stop strings: the backend matches them; the text is trimmed here, so a
            # tokenizer is needed too (SGLang likewise refuses them under --skip-tokenizer-init).
            stop_strings=caps.stop_strings and self.tokenizer is not None,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def parse(self, body: object, *, routing_key: str | None = None, worker: str | None = None) -> NativeRequest:
        """A ``/generate`` body -> the request, by the codec's one strictness rule (an
        ``InvalidRequest`` names the field as the caller spelled it)."""
        parsed = parse_request(
            body,
            rules=self._rules(),
            encode=self._encode if self.tokenizer is not None else None,
            routing_key=routing_key,
            worker=worker,
            new_rid=lambda: uuid.uuid4().hex,
        )
        top, most = parsed.request.sampling.top_logprobs, self.backend.capabilities.top_logprobs
        if top > most:
            raise InvalidRequest("top_logprobs_num", f"this backend returns at most {most} top logprobs, asked {top}")
        return parsed

    async def _served(self, req: GenerateRequest) -> Generation:
        """``req`` generated; a duplicate in-flight request id is refused (SGLang's words), and the
        backend's refusals name the caller's field."""
        if req.request_id in self._inflight:
            raise InvalidRequest("rid", f"Duplicate request ID detected: {req.request_id}")
        self._inflight.add(req.request_id)
        try:
            return await self._run_generation(req)
        except InvalidRequest as exc:
            raise _caller_field(exc) from None
        finally:
            self._inflight.discard(req.request_id)

    async def generate(self, request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
        """SGLang's ``/generate``: one request, or a batch (a list of prompts) answered as a list in
        order, as SGLang 0.5.16 serves it; Stitch's ``weight_version`` constraint on either."""
        body = await _json_body(request)
        constraint = parse_constraint(body, self.unknown_keys)
        native = {k: v for k, v in body.items() if k != WEIGHT_VERSION_KEY}
        routing_key, worker = request.headers.get(ROUTING_KEY_HEADER) or None, self._pinned(workers)
        items = split_batch(native)
        if items is None:
            req, parsed = self._versioned(native, routing_key, worker, constraint)
            return web.json_response(self._generate_answer(parsed, req, await self._served(req)))
        return web.json_response(await self._generate_batch(native, items, routing_key, worker, constraint))

    def _versioned(
        self, body: object, routing_key: str | None, worker: str | None, constraint: VersionConstraint
    ) -> tuple[GenerateRequest, NativeRequest]:
        parsed = self.parse(body, routing_key=routing_key, worker=worker)
        return constraint.apply(parsed.request), parsed

    def _generate_answer(self, parsed: NativeRequest, req: GenerateRequest, gen: Generation) -> dict[str, Any]:
        text = decode_text(self.tokenizer, gen, parsed.text_options)
        prompt = req.input_ids if parsed.return_prompt_token_ids else None
        body = answer_body(
            gen, return_logprob=req.return_logprobs, text=text, prompt_token_ids=prompt, input_ids=req.input_ids
        )
        stamp_meta(body["meta_info"], gen)
        return body

    async def _generate_batch(
        self,
        batch: Mapping[str, Any],
        items: Sequence[Mapping[str, Any]],
        routing_key: str | None,
        worker: str | None,
        constraint: VersionConstraint,
    ) -> list[dict[str, Any]]:
        """Every prompt of a batch parsed first (a refusal names the item as the batch spelled it),
        then generated concurrently; one failure cancels the rest (each aborted on the backend) and is
        the answer, as a failed item fails SGLang's whole batch."""
        parsed = []
        for i, item in enumerate(items):
            try:
                parsed.append(self._versioned(item, routing_key, worker, constraint))
            except InvalidRequest as exc:
                raise InvalidRequest(batch_field(exc.field, i, batch), exc.reason) from None
        tasks = [asyncio.ensure_future(self._served(req)) for req, _ in parsed]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for i, t in enumerate(tasks):
            failure = None if t.cancelled() else t.exception()
            if isinstance(failure, InvalidRequest):
                raise InvalidRequest(batch_field(failure.field, i, batch), failure.reason) from None
            if failure is not None:
                raise failure
        return [self._generate_answer(p, req, t.result()) for (req, p), t in zip(parsed, tasks, strict=True)]

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._chat(request)
        except (RolloutBackendError, _HttpError) as exc:
            if isinstance(exc, NoCompatibleVersion):
                return _version_refusal(exc)
            return _openai_error(_status_of(exc), str(exc), exc.field if isinstance(exc, InvalidRequest) else None)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        native = self._chat_native_body(body)
        want_logprobs = _opt_bool(body, "logprobs")
        constraint = parse_constraint(body, self.unknown_keys)
        try:
            req, parsed = self._versioned(native, request.headers.get(ROUTING_KEY_HEADER) or None, None, constraint)
        except InvalidRequest as exc:
            raise _chat_field(exc, body) from None
        if req.sampling.top_logprobs and not want_logprobs:
            # OpenAI refuses top_logprobs without logprobs: true (400); SGLang 0.5.x has no such check
            # and drops them (return_logprob=request.logprobs). Refused rather than silently dropped.
            raise InvalidRequest("top_logprobs", "needs logprobs: true (top logprobs come with the logprobs)")
        input_ids = list(req.input_ids)
        opts = parsed.text_options
        try:
            gen = await self._served(req)
        except InvalidRequest as exc:
            raise _chat_field(exc, body) from None
        text = decode_text(self.tokenizer, gen, opts)
        meta = meta_info(gen, return_logprob=True)
        stamp_meta(meta, gen)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None},
            "logprobs": self._chat_logprobs(meta) if want_logprobs else None,
            "finish_reason": gen.finish_reason.value,
            "matched_stop": gen.matched_stop if gen.finish_reason is FinishReason.STOP else None,
        }
        if _opt_bool(body, "return_meta_info") or want_logprobs:
            choice["meta_info"] = meta
        if parsed.return_prompt_token_ids:
            choice["prompt_token_ids"] = list(input_ids)
        out: dict[str, Any] = {
            "id": f"chatcmpl-{gen.request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": gen.prompt_tokens,
                "completion_tokens": len(gen.output_ids),
                "total_tokens": gen.prompt_tokens + len(gen.output_ids),
                "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
            },
        }
        stamp_top_level(out, gen)
        return web.json_response(out)

    def _chat_native_body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """A chat completion body (OpenAI's keys with SGLang's extensions) -> SGLang's ``/generate``
        body, so the codec's one rule checks it; refusals name the chat key (:func:`_chat_field`)."""
        for key in body:
            if key not in _CHAT_KEYS and self.unknown_keys is UnknownKeys.REFUSE:
                raise InvalidRequest(key, "unknown field: a chat completion has no such key (a typo?)")
        if _opt_bool(body, "stream"):
            raise InvalidRequest("stream", "streaming is not supported by the facade (Miles' session server fakes it)")
        n = body.get("n")
        if n is not None and (type(n) is not int or n != 1):
            raise InvalidRequest("n", "n > 1 is not supported: send n requests")
        for key, why in _CHAT_REFUSED.items():
            if body.get(key) not in (None, False, "auto", "none", [], {}, ""):
                raise InvalidRequest(key, why)
        if body.get("input_ids") is not None:
            input_ids: Any = body["input_ids"]
        else:
            if self.tokenizer is None:
                raise InvalidRequest("input_ids", "the facade has no tokenizer: send input_ids (SGLang's extension)")
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise InvalidRequest("messages", "must be a non-empty list of messages")
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise InvalidRequest("chat_template_kwargs", f"must be an object, got {type(kwargs).__name__}")
            try:
                ids = self.tokenizer.apply_chat_template(
                    messages, tokenize=True, add_generation_prompt=True, tools=body.get("tools"), **kwargs
                )
            except (TypeError, ValueError, KeyError) as exc:  # a malformed message or template argument
                raise InvalidRequest("messages", f"cannot apply the chat template: {exc}") from None
            input_ids = list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        params: dict[str, Any] = {}
        for key, native in _CHAT_SAMPLING.items():
            if body.get(key) is not None:
                params.setdefault(native, body[key])
        if "max_new_tokens" not in params:
            # Up to the context where the backend declares it (the codec's room), else the default.
            has_ctx = self.backend.capabilities.max_context is not None
            params["max_new_tokens"] = None if has_ctx else self.default_max_new_tokens
        native_body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True}
        if body.get("top_logprobs") is not None:
            # Checked by the codec (an integer in [0, 20], OpenAI's limit and SGLang's wire field) and
            # against the backend's Capabilities.top_logprobs in parse(); refusals name top_logprobs.
            native_body["top_logprobs_num"] = body["top_logprobs"]
        for key in ("rid", "return_prompt_token_ids"):
            if body.get(key) is not None:
                native_body[key] = body[key]
        return native_body

    def _token_texts(self, ids: Sequence[int]) -> dict[int, str]:
        """Each id's text as SGLang's ``return_text_in_logprobs`` gives it: the id decoded alone
        (``TokenizerManager.detokenize_logprob_tokens``: ``batch_decode([[id] for id in ids])``,
        special tokens kept); the id as a string without a tokenizer."""
        unique = list(dict.fromkeys(ids))
        if self.tokenizer is None:
            return {tid: str(tid) for tid in unique}
        return {tid: str(self.tokenizer.decode([tid])) for tid in unique}

    def _chat_logprobs(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """OpenAI's ``choices[i].logprobs`` from the codec's ``meta_info`` entries, as SGLang's
        ``serving_chat._process_response_logprobs`` builds it from ``output_token_logprobs`` and
        ``output_top_logprobs`` (so the one wire encoder stays ``sglang_native.meta_info``):
        ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}]}``.

        One top entry per id, most likely first. SGLang keys each position's alternatives by text
        (``to_openai_style_logprobs``: ``{text: logprob}``), which merges two ids that decode alike
        (e.g. byte fragments, both ``"\ufffd"``) and keeps the later logprob; OpenAI lists ``k``
        alternatives, so the facade keeps every id rather than that collapse."""
        entries: list[list[Any]] = meta["output_token_logprobs"]
        tops: list[list[list[Any]]] | None = meta.get("output_top_logprobs")
        ids = [e[1] for e in entries] + [e[1] for pos in tops or () for e in pos]
        text = self._token_texts(ids)

        def entry(lp: float, tid: int) -> dict[str, Any]:
            token = text[tid]
            return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}

        content = []
        for j, (lp, tid, _) in enumerate(entries):
            alternatives = [entry(tlp, ttid) for tlp, ttid, _ in tops[j]] if tops is not None else []
            content.append({**entry(lp, tid), "top_logprobs": alternatives})
        return {"content": content}

    # -- health and info ----------------------------------------------------------------------

    async def health(self, request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
        report = await asyncio.wait_for(self.backend.health(), self.health_timeout_s)
        if workers is None:
            ok = report.router_live is not False and any(w.live for w in report.workers)
        else:
            ok = report.worker(workers[0]).live
        return web.Response(status=200 if ok else 503)

    async def health_generate(self, request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
        """A 1-token greedy generation (on the worker, when pinning is possible), like SGLang's."""
        raw = request.query.get("timeout")
        try:
            timeout = self.health_timeout_s if raw is None else float(raw)
        except ValueError:
            raise InvalidRequest("timeout", f"must be a number of seconds, got {raw!r}") from None
        if not 0 < timeout < float("inf"):
            raise InvalidRequest("timeout", f"must be a positive number of seconds, got {raw!r}")
        caps = self.backend.capabilities
        if workers is not None and not caps.worker_pinning:
            report = await asyncio.wait_for(self.backend.health(probe=True), timeout)
            ok = bool(report.worker(workers[0]).making_progress)
            return web.Response(status=200 if ok else 503)
        probe = GenerateRequest(
            input_ids=(0,),
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
            worker=workers[0] if workers is not None else None,
            return_logprobs=False,
        )
        try:
            gen = await asyncio.wait_for(self._run_generation(probe), timeout)
        except asyncio.TimeoutError:
            return web.Response(status=503, text=f"no token within {timeout:.0f}s")
        return web.Response(status=200 if len(gen.output_ids) == 1 else 503)

    async def _version(self, workers: tuple[str, ...] | None) -> str | None:
        if workers is not None:
            return (await self.backend.weight_versions()).get(workers[0])
        try:
            return await self.backend.weight_version()
        except StaleWeights as exc:
            # Workers disagree. SGLang's router answers /model_info from one worker, so answer a
            # version some worker serves: the expected one where a worker serves it, else the one
            # most workers serve (the first worker's on a tie, so the answer does not vary by run).
            served = list(exc.served.values())
            return exc.expected if exc.expected in served else max(served, key=served.count)

    async def model_info(self, request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "served_model_name": self.model_name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": await self._version(workers),
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def get_weight_version(self, request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
        return web.json_response({"weight_version": await self._version(workers)})

    async def server_info_handler(self, request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
        caps = self.backend.capabilities
        info: dict[str, Any] = {
            "version": f"rollout-backends-{__version__}",
            "model_path": self.model_path,
            "served_model_name": self.model_name,
            "skip_tokenizer_init": self.tokenizer is None,
            "enable_memory_saver": caps.memory_release,
            "context_length": caps.max_context,
            "weight_version": await self._version(workers),
            "rollout_backends": {
                "workers": list(workers if workers is not None else self.backend.workers),
                "routing": caps.routing.value,
                "pause_modes": sorted(m.value for m in caps.pause_modes),
                "weight_transports": sorted(t.value for t in caps.weight_transports),
                "version_source": caps.version_source.value,
            },
        }
        info.update(self.server_info)
        return web.json_response(info)

    # -- control ------------------------------------------------------------------------------

    # Bodies are parsed by the codec (the inverse of the wires' builders): every value's JSON type
    # checked, a refusal (400) naming the key as the caller wrote it, SGLang's defaults otherwise.

    async def abort_request(self, request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
        op = parse_abort_body(await _json_body(request))
        if isinstance(op, AbortAll):
            await self.backend.abort_all(workers=workers)
        elif isinstance(op, AbortRequest):
            await self.backend.abort(op.request_id)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
        op = parse_pause_body(await _json_body(request))
        await self.backend.pause(op.mode, workers=workers)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
        await self.backend.resume(workers=workers)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
        await self.backend.flush_cache(workers=workers)
        return web.Response(text=_FLUSH_OK)

    async def _maybe_abort(self, abort_all: bool, workers: tuple[str, ...] | None) -> None:
        if abort_all:
            await self.backend.abort_all(workers=workers)

    async def init_weights_update_group(
        self, request: web.Request, workers: tuple[str, ...] | None
    ) -> web.StreamResponse:
        op = parse_init_group_body(await _json_body(request))
        await self.backend.init_weight_group(op.group, workers=workers)
        return _ok("Succeeded to initialize custom process group.")

    async def destroy_weights_update_group(
        self, request: web.Request, workers: tuple[str, ...] | None
    ) -> web.StreamResponse:
        op = parse_destroy_group_body(await _json_body(request))
        await self.backend.destroy_weight_group(op.group_name, workers=workers)
        return _ok("Succeeded to destroy custom process group.")

    async def update_weights_from_distributed(
        self, request: web.Request, workers: tuple[str, ...] | None
    ) -> web.StreamResponse:
        op, abort_all = parse_distributed_body(await _json_body(request))
        await self._maybe_abort(abort_all, workers)
        await self.backend.update_weights_from_distributed(
            op.bucket, group_name=op.group_name, version=op.version, flush_cache=op.flush_cache, workers=workers
        )
        return _ok("Succeeded to update parameter online from distributed.")

    async def update_weights_from_tensor(
        self, request: web.Request, workers: tuple[str, ...] | None
    ) -> web.StreamResponse:
        tb = parse_tensors_body(await _json_body(request))
        # Every TP rank's entry holds the same named tensors; the backend shards for its own ranks.
        named = decode_tensor_payload(tb.payloads[0], tb.load_format)
        await self._maybe_abort(tb.abort_all_requests, workers)
        await self.backend.update_weights_from_tensors(
            named, version=tb.version, flush_cache=tb.flush_cache, workers=workers
        )
        return _ok("Succeeded to update parameter online from tensor.")

    async def update_weights_from_disk(
        self, request: web.Request, workers: tuple[str, ...] | None
    ) -> web.StreamResponse:
        op, abort_all = parse_disk_body(await _json_body(request))
        await self._maybe_abort(abort_all, workers)
        await self.backend.update_weights_from_disk(
            op.path, version=op.version, load_format=op.load_format, flush_cache=op.flush_cache, workers=workers
        )
        return _ok("Succeeded to update model weights.", num_paused_requests=0)

    async def update_weight_version(self, request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
        op, abort_all = parse_set_version_body(await _json_body(request))
        await self._maybe_abort(abort_all, workers)  # SGLang's default aborts every request
        await self.backend.set_weight_version(op.version, workers=workers)
        return _ok(f"Weight version updated to {op.version}", new_version=op.version)

    async def begin_weight_update(self, request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
        body = await _json_body(request)
        selector = body.get("selector", "all")
        if not isinstance(selector, str):
            raise InvalidRequest("selector", f"must be a string, got {type(selector).__name__}")
        await self.backend.begin_weight_update(selector, workers=workers)
        return _ok("Weight update session opened.")

    async def end_weight_update(self, request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
        await self.backend.end_weight_update(workers=workers)
        return _ok("Weight update session closed.")

    async def release_memory_occupation(
        self, request: web.Request, workers: tuple[str, ...] | None
    ) -> web.StreamResponse:
        await self.backend.release_memory(parse_memory_body(await _json_body(request)), workers=workers)
        return web.json_response(None)

    async def resume_memory_occupation(
        self, request: web.Request, workers: tuple[str, ...] | None
    ) -> web.StreamResponse:
        await self.backend.resume_memory(parse_memory_body(await _json_body(request)), workers=workers)
        return web.json_response(None)

    def unsupported(self, what: str) -> Handler:
        async def handler(request: web.Request, workers: tuple[str, ...] | None) -> web.StreamResponse:
            raise Unsupported(what, "not part of the rollout-backends protocol")

        return handler


def _version_refusal(exc: NoCompatibleVersion) -> web.Response:
    """Stitch's answer when no worker serves an accepted version: HTTP 409, its body (retryable:
    Miles' ``post`` resends every failed call)."""
    return web.json_response(refusal_body(exc), status=_status_of(exc))


def _plain_error(status: int, message: str, field: str | None = None) -> web.Response:
    return web.Response(status=status, text=message)


def _wrap(
    handler: Handler,
    resolve: Callable[[web.Request], tuple[str, ...] | None],
    on_error: ErrorAnswer,
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request, resolve(request))
        except (RolloutBackendError, _HttpError) as exc:
            if isinstance(exc, NoCompatibleVersion):
                return _version_refusal(exc)
            status = _status_of(exc)
            if status >= 500:
                logger.warning("%s %s: %s", request.method, request.path, exc)
            return on_error(status, str(exc), exc.field if isinstance(exc, InvalidRequest) else None)
        except asyncio.TimeoutError:
            return on_error(503, "timed out", None)

    return wrapped


@attrs.define
class RunningFacade:
    """A started facade: ``url`` is the router address; ``worker_urls`` the per-worker ports."""

    url: str
    worker_urls: dict[str, str]
    runners: list[web.AppRunner]

    @property
    def host(self) -> str:
        return self.url.split("://", 1)[1].rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()
        self.runners = []


async def _serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    # handler_cancellation: a client that hangs up aborts its generation, as with SGLang.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    bound = int(sockets[0].getsockname()[1]) if sockets else port
    return runner, bound


async def start_facade(
    facade: MilesFacade,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    worker_ports: Mapping[str, int] | None = None,
) -> RunningFacade:
    """Serve ``facade`` on ``host:port`` (0 = any free port), and each worker's app on its own port
    when ``worker_ports`` maps worker ids to ports."""
    if facade.tokenizer is None:
        logger.warning("facade has no tokenizer: /generate answers text='' (Miles' rewards need the text)")
    runners: list[web.AppRunner] = []
    try:
        runner, bound = await _serve(facade.app(), host, port)
        runners.append(runner)
        worker_urls: dict[str, str] = {}
        for worker, wport in (worker_ports or {}).items():
            wrunner, wbound = await _serve(facade.worker_app(worker), host, wport)
            runners.append(wrunner)
            worker_urls[worker] = f"http://{host}:{wbound}"
    except BaseException:
        for r in runners:
            await r.cleanup()
        raise
    return RunningFacade(url=f"http://{host}:{bound}", worker_urls=worker_urls, runners=runners)
