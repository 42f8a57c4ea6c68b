"""An aiohttp server that puts SGLang's native HTTP API in front of a ``ReferenceEngine``.

It answers with the field names, response shapes, status codes and error shapes that SGLang 0.5.x
documents (``/work/shared/reference/sglang.md`` §1-5), as a server started with
``--skip-tokenizer-init`` would: token ids in, token ids out, logprob entries ``[lp, id, null]``.

What it does not do (each answered with 400 ``{"error": {"message"}}`` rather than ignored):
streaming (``stream: true``), batches (``input_ids`` as a list of lists, list ``sampling_params``),
``text`` prompts, stop strings, ``n > 1``, constrained decoding, ``logit_bias``, input/top logprobs
(``logprob_start_len != -1``, ``top_logprobs_num > 0``), LoRA.

Differences from SGLang that are deliberate: ``min_new_tokens > 0`` is honoured (SGLang needs a
tokenizer for it); ``sampling_seed`` is always honoured (the engine is deterministic); a negative
``sampling_seed`` is mapped into ``[0, 2**63)``.

Routes are built by :func:`build_app`; ``python -m rollout_backends.adapters.reference.serve``
is the command line.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from rollout_backends import (
    FinishReason,
    GenerateRequest,
    Generation,
    InvalidRequest,
    MemoryTag,
    PauseMode,
    SamplingParams,
)
from rollout_backends.kit import deserialize_named_tensors, serialize_named_tensors

__all__ = [
    "SAMPLING_PARAM_KEYS",
    "SERVER_KEY",
    "ReferenceServer",
    "build_app",
    "deserialize_named_tensors",
    "serialize_named_tensors",
]

log = logging.getLogger("rollout_backends.reference.server")

#: The ``sampling_params`` keys SGLang accepts (``_FIELDS_SamplingParams``, 0.5.23); any other is a 400.
SAMPLING_PARAM_KEYS: tuple[str, ...] = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_regex",
    "stop_token_ids",
    "ignore_eos",
    "min_new_tokens",
    "n",
    "no_stop_trim",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "sampling_seed",
    "logit_bias",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "choice",
    "stream_interval",
    "custom_params",
    "beam_width",
    "watermark",
)

_INT_KEYS = {"max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed", "stream_interval", "beam_width"}
_FLOAT_KEYS = {"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"}
_BOOL_KEYS = {"ignore_eos", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "watermark"}
#: Accepted but only meaningful with a tokenizer or for streaming: ignored here, as SGLang does.
_NOOP_KEYS = {
    "no_stop_trim",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stream_interval",
    "custom_params",
}
#: Accepted by SGLang but not supported by the reference engine: a non-null value is a 400.
_UNSUPPORTED_KEYS = {"stop_regex", "logit_bias", "json_schema", "regex", "ebnf", "structural_tag", "choice",
                     "beam_width", "watermark"}  # fmt: skip

_INT64 = 2**63
_GREEDY_EPS = 1e-6
_FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)

#: The test-only route that arms injected faults (served only with ``fault_injection=True``).
FAULTS_ROUTE = "/_faults"
_FAULT_MODES = ("error", "close", "delay")

#: Routes that take the admin key when one is set (SGLang's ``ADMIN_OPTIONAL``).
ADMIN_ROUTES = frozenset(
    {
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/update_weight_version",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        FAULTS_ROUTE,
    }
)
#: SGLang's API-key middleware lets these through without a key.
_OPEN_PREFIXES = ("/health", "/metrics")


class _BadRequest(Exception):
    """A request error; ``body`` is the JSON sent with 400."""

    def __init__(self, body: Any, status: int = 400) -> None:
        super().__init__(str(body))
        self.body = body
        self.status = status


def _err(message: str) -> _BadRequest:
    return _BadRequest({"error": {"message": message}})


# -- tensors over HTTP (SGLang's MultiprocessingSerializer) ------------------------------------


# -- request parsing ----------------------------------------------------------------------------


def _type_name(v: object) -> str:
    return "null" if v is None else type(v).__name__


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_sampling_schema(sp: Mapping[str, Any]) -> None:
    """The schema gate: unknown keys and wrong JSON types are rejected before anything else."""
    for key in sp:
        if key not in SAMPLING_PARAM_KEYS:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_PARAM_KEYS)
            raise _BadRequest({"error": f"unknown field `{key}`, expected one of {expected}"})
    for key, v in sp.items():
        if v is None:
            continue
        ok = True
        if key in _INT_KEYS:
            ok = _is_int(v)
        elif key in _FLOAT_KEYS:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        elif key in _BOOL_KEYS:
            ok = isinstance(v, bool)
        elif key == "stop":
            ok = isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))
        elif key == "stop_token_ids":
            ok = isinstance(v, list) and all(_is_int(t) for t in v)
        if not ok:
            raise _err(f"sampling_params.{key}: invalid type {_type_name(v)}")


def _sampling_from_sglang(sp: Mapping[str, Any], *, prompt_len: int, max_context: int) -> SamplingParams:
    _check_sampling_schema(sp)
    for key in _UNSUPPORTED_KEYS:
        if sp.get(key) not in (None, False):
            raise _err(f"sampling_params.{key} is not supported by the reference server")
    stop = sp.get("stop")
    if stop:
        raise _err("stop strings need a tokenizer; the reference server runs tokenizer-less (use stop_token_ids)")
    n = sp.get("n")
    if n is not None and n != 1:
        raise _err("n > 1 is not supported by the reference server; send n separate requests")

    kw: dict[str, Any] = {}
    room = max_context - prompt_len
    m = sp.get("max_new_tokens", 128)
    kw["max_new_tokens"] = room if m is None else min(m, room)
    if m is not None and m < 0:
        raise _err(f"max_new_tokens must be >= 0, got {m}")
    t = sp.get("temperature")
    if t is not None:
        kw["temperature"] = 0.0 if 0 <= t < _GREEDY_EPS else float(t)
    for key in ("top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        if sp.get(key) is not None:
            kw[key] = float(sp[key])
    k = sp.get("top_k")
    if k is not None:
        kw["top_k"] = k
    if sp.get("min_new_tokens") is not None:
        kw["min_new_tokens"] = min(sp["min_new_tokens"], kw["max_new_tokens"])
    if sp.get("stop_token_ids") is not None:
        kw["stop_token_ids"] = tuple(sp["stop_token_ids"])
    if sp.get("ignore_eos") is not None:
        kw["ignore_eos"] = sp["ignore_eos"]
    seed = sp.get("sampling_seed")
    if seed is not None:
        if not -_INT64 <= seed < _INT64:
            raise _err(f"sampling_seed must be a signed int64, got {seed}")
        kw["seed"] = seed % _INT64
    try:
        return SamplingParams(**kw)
    except InvalidRequest as e:
        raise _err(str(e)) from None


def _finish_reason(g: Generation) -> dict[str, Any]:
    if g.finish_reason is FinishReason.STOP:
        return {"type": "stop", "matched": g.matched_stop}
    if g.finish_reason is FinishReason.ABORT:
        return {"type": "abort", "message": "Abort request.", "status_code": None, "err_type": None}
    return {"type": "length", "length": len(g.output_ids)}


def generation_body(g: Generation, *, return_logprob: bool, input_ids: list[int] | None = None) -> dict[str, Any]:
    """The JSON body SGLang returns for one finished (or aborted) non-streamed request."""
    meta: dict[str, Any] = {
        "id": g.request_id,
        "finish_reason": _finish_reason(g),
        "prompt_tokens": g.prompt_tokens,
        "completion_tokens": len(g.output_ids),
        "cached_tokens": g.cached_tokens,
        "weight_version": g.weight_version,
        "e2e_latency": g.latency_s,
    }
    if return_logprob:
        lps = g.logprobs if g.logprobs is not None else (None,) * len(g.output_ids)
        meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(lps, g.output_ids, strict=True)]
    body: dict[str, Any] = {"output_ids": list(g.output_ids), "meta_info": meta}
    if input_ids is not None:
        body["prompt_token_ids"] = input_ids
    return body


# -- the app ------------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


async def _body(request: web.Request, *, allow_empty: bool = True) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise _err("request body is empty")
    try:
        import json

        data = json.loads(raw)
    except ValueError as e:
        raise _err(f"invalid JSON: {e}") from None
    if data is None and allow_empty:
        return {}
    if not isinstance(data, dict):
        raise _err(f"the body must be a JSON object, got {_type_name(data)}")
    return data


def _field(
    body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ..., *, nullable: bool = False
) -> Any:
    if key not in body:
        if default is ...:
            raise _err(f"missing required field `{key}`")
        return default
    v = body[key]
    if v is None and nullable:
        return None
    if isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _err(f"`{key}`: expected {kind}, got bool")
    if not isinstance(v, kind):
        raise _err(f"`{key}`: invalid type {_type_name(v)}")
    return v


class ReferenceServer:
    """Holds the engine and the server's own state (in-flight rids, update session)."""

    def __init__(
        self,
        engine: Any,
        *,
        model_path: str,
        served_model_name: str | None = None,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        with_begin_end: bool = False,
        page_size: int = 16,
        sglang_version: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        health_generation: bool | None = None,
        health_timeout: float | None = None,
        fault_injection: bool = False,
    ) -> None:
        self.engine = engine
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self._api_key = api_key
        self._admin_key = admin_api_key
        self.with_begin_end = with_begin_end
        self.page_size = page_size
        self.sglang_version = sglang_version or ("0.5.23" if with_begin_end else "0.5.16")
        self.host = host
        self.port = port
        if health_generation is None:
            health_generation = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1").lower() not in (
                "0", "false", "no", "off",
            )  # fmt: skip
        self.health_generation = health_generation
        if health_timeout is None:
            health_timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
        self.health_timeout = health_timeout
        self.load_format = "safetensors"
        self.startup_time = time.time()
        self._inflight: set[str] = set()
        self._session_open = False
        #: Test-only (``--fault-injection``): armed faults by path; see :meth:`faults`.
        self.fault_injection = fault_injection
        self._faults: dict[str, dict[str, Any]] = {}

    # -- auth (SGLang: 401 {"error": "Unauthorized"}) ------------------------------------------

    @staticmethod
    def _bearer_ok(request: web.Request, key: str) -> bool:
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {key}".encode())

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if request.method != "OPTIONS" and not path.startswith(_OPEN_PREFIXES):
            need = self._admin_key if (path in ADMIN_ROUTES and self._admin_key) else self._api_key
            if need and not self._bearer_ok(request, need):
                return _json({"error": "Unauthorized"}, 401)
        try:
            if self._faults and path in self._faults:
                injected = await self._inject(request, path)
                if injected is not None:
                    return injected
            return await handler(request)
        except _BadRequest as e:
            if isinstance(e.body, str):
                return web.Response(text=e.body, status=e.status)
            return _json(e.body, e.status)
        except web.HTTPNotFound:
            return _json({"detail": "Not Found"}, 404)
        except web.HTTPMethodNotAllowed:
            return _json({"detail": "Method Not Allowed"}, 405)

    # -- fault injection (test-only: served with ``--fault-injection`` alone) -----------------

    async def _inject(self, request: web.Request, path: str) -> web.StreamResponse | None:
        """Fire the fault armed for ``path`` (one shot per ``times``); ``None`` = serve normally."""
        fault = self._faults[path]
        fault["times"] -= 1
        if fault["times"] <= 0:
            del self._faults[path]
        log.warning("injected fault on %s: %s", path, fault["mode"])
        if fault["mode"] == "delay":
            await asyncio.sleep(fault["delay_s"])
            return None
        await request.read()
        if fault["mode"] == "close":
            if request.transport is not None:
                request.transport.close()
            raise ConnectionResetError(f"injected fault: connection closed on {path}")
        return _json({"success": False, "message": f"injected fault on {path}"}, fault["status"])

    async def faults(self, request: web.Request) -> web.StreamResponse:
        """``POST /_faults {"path", "mode": "error"|"close"|"delay", "status": 500, "times": 1,
        "delay_s": 0}`` arms a fault on ``path``; ``DELETE`` clears all; ``GET`` lists them."""
        if request.method == "GET":
            return _json({"faults": self._faults})
        if request.method == "DELETE":
            self._faults.clear()
            return _json({"faults": {}})
        body = await _body(request, allow_empty=False)
        path = _field(body, "path", str)
        if not path.startswith("/") or path == FAULTS_ROUTE:
            raise _err("`path`: must be a route of this server (not /_faults)")
        mode = _field(body, "mode", str, "error")
        if mode not in _FAULT_MODES:
            raise _err(f"`mode`: must be one of {_FAULT_MODES}, got {mode!r}")
        status = _field(body, "status", int, 500)
        if not 400 <= status <= 599:
            raise _err(f"`status`: must be in 400..599, got {status}")
        times = _field(body, "times", int, 1)
        if not 1 <= times <= 1_000_000:
            raise _err(f"`times`: must be in 1..1000000, got {times}")
        delay = _field(body, "delay_s", (int, float), 0)
        if not 0 <= delay <= 3600:
            raise _err(f"`delay_s`: must be in [0, 3600], got {delay}")
        self._faults[path] = {"mode": mode, "status": status, "times": times, "delay_s": float(delay)}
        return _json({"faults": self._faults})

    # -- data plane ---------------------------------------------------------------------------

    def _request_from_body(self, body: Mapping[str, Any]) -> tuple[GenerateRequest, bool, bool]:
        if body.get("text") is not None:
            raise _err("text input needs a tokenizer; the reference server runs tokenizer-less (send input_ids)")
        ids = body.get("input_ids")
        if ids is None:
            raise _err("Either text, input_ids or input_embeds should be provided.")
        if not isinstance(ids, list):
            raise _err(f"input_ids: invalid type {_type_name(ids)}")
        if not ids:
            raise _err("input_ids must not be empty")
        if all(isinstance(x, list) for x in ids):
            raise _err("batch requests (a list of input_ids lists) are not supported by the reference server")
        if not all(_is_int(x) for x in ids):
            raise _err("input_ids: every element must be an int token id")
        if body.get("stream"):
            raise _err("streaming is not supported by the reference server (send stream=false)")
        if body.get("logprob_start_len", -1) not in (-1, None):
            raise _err("logprob_start_len other than -1 (input logprobs) is not supported by the reference server")
        if body.get("top_logprobs_num") or body.get("token_ids_logprob"):
            raise _err("top_logprobs_num / token_ids_logprob are not supported by the reference server")
        if body.get("lora_path"):
            raise _err("lora_path: LoRA is not supported by the reference server")
        ret_lp = body.get("return_logprob", False)
        if not isinstance(ret_lp, bool):
            raise _err(f"return_logprob: invalid type {_type_name(ret_lp)}")
        ret_prompt = body.get("return_prompt_token_ids", False)
        rid = body.get("rid")
        if rid is None:
            rid = uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise _err("rid must be a non-empty string")
        sp = body.get("sampling_params") or {}
        if isinstance(sp, list):
            raise _err("a list of sampling_params (batch) is not supported by the reference server")
        if not isinstance(sp, dict):
            raise _err(f"sampling_params: invalid type {_type_name(sp)}")
        vocab = int(self.engine.vocab_size)
        ctx = int(self.engine.max_context)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise _err(f"The input_ids {bad[:8]} contain values outside the vocabulary [0, {vocab}).")
        if len(ids) >= ctx:
            raise _err(f"The input ({len(ids)} tokens) is longer than the model's context length ({ctx} tokens).")
        _check_sampling_schema(sp)
        if sp.get("max_new_tokens") == 0:
            # Prefill only: SGLang allows it, the engine's SamplingParams does not.
            sampling = None
        else:
            sampling = _sampling_from_sglang(sp, prompt_len=len(ids), max_context=ctx)
        req = GenerateRequest(
            input_ids=ids,
            sampling=sampling or SamplingParams(max_new_tokens=1),
            request_id=rid,
            return_logprobs=ret_lp,
        )
        return req, sampling is None, bool(ret_prompt)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request, allow_empty=False)
        req, prefill_only, ret_prompt = self._request_from_body(body)
        if req.request_id in self._inflight:
            raise _err(f"Duplicate request ID detected: {req.request_id}")
        prompt = list(req.input_ids) if ret_prompt else None
        if prefill_only:
            g = Generation(
                request_id=req.request_id,
                output_ids=(),
                logprobs=(),
                finish_reason=FinishReason.LENGTH,
                weight_version=self.engine.weight_version,
                prompt_tokens=len(req.input_ids),
            )
            return _json(generation_body(g, return_logprob=req.return_logprobs, input_ids=prompt))
        self._inflight.add(req.request_id)
        try:
            g = await self.engine.generate(req)
        except InvalidRequest as e:
            raise _err(str(e)) from None
        except Exception as e:
            log.exception("generate %s failed", req.request_id)
            return _json({"error": {"message": f"{type(e).__name__}: {e}"}}, 500)
        finally:
            self._inflight.discard(req.request_id)
        return _json(generation_body(g, return_logprob=req.return_logprobs, input_ids=prompt))

    # -- health and info ----------------------------------------------------------------------

    async def _probe(self) -> bool:
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        req = GenerateRequest(
            input_ids=(0,), sampling=SamplingParams(max_new_tokens=1, temperature=0.0), request_id=rid,
            return_logprobs=False,
        )  # fmt: skip
        task = asyncio.ensure_future(self.engine.generate(req))
        try:
            await asyncio.wait_for(asyncio.shield(task), self.health_timeout)
            return True
        except asyncio.TimeoutError:
            try:
                await self.engine.abort(rid)
            except Exception:
                log.debug("abort of health probe %s failed", rid, exc_info=True)
            task.cancel()
            return False
        except Exception:
            log.warning("health probe failed", exc_info=True)
            return False

    async def health(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health" and not self.health_generation:
            return web.Response(status=200)
        return web.Response(status=200 if await self._probe() else 503)

    async def ready(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=503 if self.engine.paused else 200)

    def _model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": None,
            "architectures": None,
            "served_model_name": self.served_model_name,
            "load_format": self.load_format,
        }

    async def model_info(self, request: web.Request) -> web.StreamResponse:
        return _json(self._model_info())

    async def server_info(self, request: web.Request) -> web.StreamResponse:
        ctx = int(self.engine.max_context)
        return _json(
            {
                "model_path": self.model_path,
                "served_model_name": self.served_model_name,
                "tokenizer_path": None,
                "skip_tokenizer_init": True,
                "load_format": self.load_format,
                "host": self.host,
                "port": self.port,
                "tp_size": 1,
                "dp_size": 1,
                "page_size": self.page_size,
                "context_length": ctx,
                "max_total_num_tokens": None,
                "enable_deterministic_inference": True,
                "weight_version": self.engine.weight_version,
                "api_key_set": self._api_key is not None,
                "admin_api_key_set": self._admin_key is not None,
                "internal_states": [{"last_gen_throughput": 0.0, "paused": bool(self.engine.paused)}],
                "deployment_info": {"page_size": self.page_size},
                "startup_time": self.startup_time,
                "version": self.sglang_version,
                "reference": {
                    "worker_id": self.engine.worker_id,
                    "vocab_size": int(self.engine.vocab_size),
                    "with_begin_end": self.with_begin_end,
                },
            }
        )

    async def v1_models(self, request: web.Request) -> web.StreamResponse:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.served_model_name,
                        "object": "model",
                        "created": int(self.startup_time),
                        "owned_by": "sglang",
                        "root": self.served_model_name,
                        "parent": None,
                        "max_model_len": int(self.engine.max_context),
                    }
                ],
            }
        )

    async def openapi(self, request: web.Request) -> web.StreamResponse:
        paths: dict[str, dict[str, Any]] = {}
        for route in request.app.router.routes():
            info = route.resource.get_info() if route.resource is not None else {}
            path = info.get("path") or info.get("formatter")
            if not path or route.method in ("HEAD", "*"):
                continue
            paths.setdefault(path, {})[route.method.lower()] = {"summary": getattr(route.handler, "__name__", "")}
        return _json({"openapi": "3.1.0", "info": {"title": "FastAPI", "version": "0.1.0"}, "paths": paths})

    # -- control ------------------------------------------------------------------------------

    @staticmethod
    def _result(ok: bool, message: str, **extra: Any) -> web.Response:
        return _json({"success": ok, "message": message, **extra}, 200 if ok else 400)

    async def _control(self, what: str, call: Awaitable[Any], **extra: Any) -> web.Response:
        """Run an engine control call; a failure becomes ``400 {"success": false, "message"}``."""
        try:
            await call
        except asyncio.CancelledError:
            raise
        except Exception as e:  # EngineError, InvalidRequest, anything: SGLang reports success=false
            log.warning("%s failed: %s", what, e)
            return self._result(False, f"{what} failed: {e}", **extra)
        return self._result(True, "Succeeded to " + what + ".", **extra)

    async def abort_request(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        rid = _field(body, "rid", str, "", nullable=True) or ""
        if _field(body, "abort_all", bool, False):
            await self.engine.abort_all()
        elif rid:
            await self.engine.abort(rid)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        mode = _field(body, "mode", str, "abort")
        try:
            pm = PauseMode(mode)
        except ValueError:
            raise _err(f"mode must be one of abort, retract, in_place; got {mode!r}") from None
        try:
            await self.engine.pause(pm)
        except Exception as e:
            raise _err(f"pause_generation failed: {e}") from None
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.StreamResponse:
        await _body(request)
        try:
            await self.engine.resume()
        except Exception as e:
            raise _err(f"continue_generation failed: {e}") from None
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.StreamResponse:
        try:
            await self.engine.flush_cache()
        except Exception as e:
            return web.Response(text=f"{e}\n", status=400)
        return web.Response(text=_FLUSH_OK, status=200)

    async def update_weight_version(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        if "new_version" not in body or not isinstance(body["new_version"], str):
            return self._result(False, "new_version (a string) is required")
        v = body["new_version"]
        abort_all = _field(body, "abort_all_requests", bool, True)
        try:
            if abort_all:
                await self.engine.abort_all()
            await self.engine.set_weight_version(v)
        except Exception as e:
            return self._result(False, f"update_weight_version failed: {e}")
        return self._result(True, f"Weight version updated to {v}", new_version=v)

    async def _maybe_abort(self, body: Mapping[str, Any]) -> None:
        if _field(body, "abort_all_requests", bool, False):
            await self.engine.abort_all()

    async def update_weights_from_disk(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        if not isinstance(body.get("model_path"), str) or not body["model_path"]:
            raise _err("missing required field `model_path`")
        path = body["model_path"]
        load_format = _field(body, "load_format", str, None, nullable=True)
        version = _field(body, "weight_version", str, None, nullable=True)
        flush = _field(body, "flush_cache", bool, True)
        await self._maybe_abort(body)
        resp = await self._control(
            "update weights from disk",
            self.engine.update_weights_from_disk(path, load_format=load_format, version=version, flush_cache=flush),
            num_paused_requests=0,
        )
        if resp.status == 200:
            self.model_path = path
            self.served_model_name = path
            if load_format:
                self.load_format = load_format
        return resp

    def _session_error(self) -> web.Response | None:
        if self.with_begin_end and not self._session_open:
            return self._result(False, "update_weights must run between begin_weight_update() and end_weight_update()")
        return None

    async def update_weights_from_tensor(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise _err("missing required field `serialized_named_tensors` (a list of strings, one per TP rank)")
        if len(entries) != 1:
            return self._result(False, f"expected 1 serialized_named_tensors entry (tp_size=1), got {len(entries)}")
        load_format = _field(body, "load_format", str, None, nullable=True)
        version = _field(body, "weight_version", str, None, nullable=True)
        flush = _field(body, "flush_cache", bool, True)
        if (err := self._session_error()) is not None:
            return err
        try:
            named = deserialize_named_tensors(entries[0])
        except Exception as e:
            return self._result(False, f"cannot decode serialized_named_tensors: {type(e).__name__}: {e}")
        await self._maybe_abort(body)
        return await self._control(
            "update weights from tensor",
            self.engine.update_weights_from_tensors(named, version=version, flush_cache=flush, load_format=load_format),
        )

    async def init_weights_update_group(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        addr = _field(body, "master_address", str)
        port = _field(body, "master_port", int)
        rank_offset = _field(body, "rank_offset", int)
        world_size = _field(body, "world_size", int)
        group_name = _field(body, "group_name", str, "weight_update_group")
        backend = _field(body, "backend", str, "nccl")
        return await self._control(
            "init weights update group",
            self.engine.init_weight_group(addr, port, rank_offset, world_size, group_name, backend),
        )

    async def update_weights_from_distributed(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        names = _field(body, "names", list)
        dtypes = _field(body, "dtypes", list)
        shapes = _field(body, "shapes", list)
        if not (len(names) == len(dtypes) == len(shapes)):
            return self._result(False, "names, dtypes and shapes must have the same length")
        group_name = _field(body, "group_name", str, "weight_update_group")
        version = _field(body, "weight_version", str, None, nullable=True)
        flush = _field(body, "flush_cache", bool, True)
        load_format = _field(body, "load_format", str, None, nullable=True)
        if (err := self._session_error()) is not None:
            return err
        await self._maybe_abort(body)
        return await self._control(
            "update weights from distributed",
            self.engine.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                group_name=group_name,
                version=version,
                flush_cache=flush,
                load_format=load_format,
            ),
        )

    async def destroy_weights_update_group(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        group_name = _field(body, "group_name", str, "weight_update_group")
        return await self._control("destroy weights update group", self.engine.destroy_weight_group(group_name))

    async def begin_weight_update(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        selector = _field(body, "selector", str, "all")
        resp = await self._control("begin weight update", self.engine.begin_weight_update(selector))
        if resp.status == 200:
            self._session_open = True
        return resp

    async def end_weight_update(self, request: web.Request) -> web.StreamResponse:
        await _body(request)
        resp = await self._control("end weight update", self.engine.end_weight_update())
        if resp.status == 200:
            self._session_open = False
        return resp

    async def _memory(self, request: web.Request, release: bool) -> web.StreamResponse:
        body = await _body(request)
        tags = body.get("tags")
        if tags is not None:
            if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                raise _err("tags must be null or a list of strings")
            known = {m.value for m in MemoryTag}
            for t in tags:
                if t not in known:
                    raise _err(f"unknown memory tag {t!r} (known: {sorted(known)})")
        try:
            await (self.engine.release_memory(tags) if release else self.engine.resume_memory(tags))
        except Exception as e:
            raise _err(f"{'release' if release else 'resume'}_memory_occupation failed: {e}") from None
        return _json(None)

    async def release_memory_occupation(self, request: web.Request) -> web.StreamResponse:
        return await self._memory(request, True)

    async def resume_memory_occupation(self, request: web.Request) -> web.StreamResponse:
        return await self._memory(request, False)

    # -- wiring -------------------------------------------------------------------------------

    def routes(self) -> list[web.RouteDef]:
        r: list[web.RouteDef] = [
            web.post("/generate", self.generate),
            web.put("/generate", self.generate),
            web.get("/health", self.health, allow_head=False),
            web.get("/health_generate", self.health, allow_head=False),
            web.get("/ready", self.ready, allow_head=False),
            web.get("/model_info", self.model_info, allow_head=False),
            web.get("/get_model_info", self.model_info, allow_head=False),
            web.get("/server_info", self.server_info, allow_head=False),
            web.get("/get_server_info", self.server_info, allow_head=False),
            web.get("/v1/models", self.v1_models, allow_head=False),
            web.get("/openapi.json", self.openapi, allow_head=False),
            web.post("/abort_request", self.abort_request),
            web.post("/pause_generation", self.pause_generation),
            web.post("/continue_generation", self.continue_generation),
            web.get("/flush_cache", self.flush_cache, allow_head=False),
            web.post("/flush_cache", self.flush_cache),
            web.post("/update_weight_version", self.update_weight_version),
            web.post("/update_weights_from_disk", self.update_weights_from_disk),
            web.post("/update_weights_from_tensor", self.update_weights_from_tensor),
            web.post("/init_weights_update_group", self.init_weights_update_group),
            web.post("/update_weights_from_distributed", self.update_weights_from_distributed),
            web.post("/destroy_weights_update_group", self.destroy_weights_update_group),
            web.get("/release_memory_occupation", self.release_memory_occupation, allow_head=False),
            web.post("/release_memory_occupation", self.release_memory_occupation),
            web.get("/resume_memory_occupation", self.resume_memory_occupation, allow_head=False),
            web.post("/resume_memory_occupation", self.resume_memory_occupation),
        ]
        if self.fault_injection:
            r += [
                web.get(FAULTS_ROUTE, self.faults, allow_head=False),
                web.post(FAULTS_ROUTE, self.faults),
                web.delete(FAULTS_ROUTE, self.faults),
            ]
        if self.with_begin_end:
            r += [
                web.post("/begin_weight_update", self.begin_weight_update),
                web.post("/end_weight_update", self.end_weight_update),
            ]
        return r


def build_app(engine: Any, **kwargs: Any) -> web.Application:
    """The aiohttp application serving ``engine``; ``kwargs`` go to :class:`ReferenceServer`."""
    server = ReferenceServer(engine, **kwargs)
    app = web.Application(middlewares=[server.middleware], client_max_size=1024**3)
    app.add_routes(server.routes())
    app[SERVER_KEY] = server
    return app


#: ``app[SERVER_KEY]`` is the :class:`ReferenceServer` of an app made by :func:`build_app`.
SERVER_KEY = web.AppKey("server", ReferenceServer)
