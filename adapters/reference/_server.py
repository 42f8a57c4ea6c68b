"""An aiohttp server that puts SGLang's native HTTP API in front of a ``ReferenceEngine``.

It answers with the field names, response shapes, status codes and error shapes that SGLang 0.5.x
documents (the shapes of ``rollout_backends.sglang_native``), as stock SGLang does with its tokenizer:
``text`` in answers (Miles reads ``output["text"]``) and ``text`` prompts, where the model has a
``tokenizer.json``; ``skip_tokenizer_init=True`` (``--skip-tokenizer-init``) keeps the
tokenizer-free mode (token ids only, no ``text`` key). Bodies are parsed by the SGLang codec
(``rollout_backends.sglang_native``) under its one strictness rule: every refusal is
``400 {"error": {"message", "type", "param"}}`` naming the field as the caller spelled it.

What it cannot honour is refused (400), never ignored: batches, stop strings, ``n > 1``,
constrained decoding, ``logit_bias``, LoRA, routed experts, hidden states,
multimodal data, custom logit processors, sessions, disaggregation (the codec's list), and unknown
keys (``unknown_keys=UnknownKeys.IGNORE`` keeps SGLang's ignore-unknown-keys rule). Like SGLang it
refuses ``len(input_ids) + max_new_tokens >= context`` (it does not truncate).

``"stream": true`` is answered as SGLang 0.5.16 streams (measured on the H200,
bench/rb_bench/capture.py): 200, ``text/event-stream``, one ``data: {json}`` event per
scheduler step, each the answer *so far* (cumulative ``output_ids``, logprobs and ``text``,
``meta_info.finish_reason`` null), the last one the non-streamed answer, then ``data: [DONE]``.
A refusal the codec makes stays a 400 JSON answer; what SGLang's tokenizer manager refuses once
the stream has begun (a duplicate rid, the engine's own checks) is an event ``{"error":
{"message"}}`` then ``[DONE]``. A client that goes away aborts its request in the engine.
Partial events carry ``cached_tokens: 0`` and no ``input_token_logprobs`` (the engine's chunks do
not carry them); the last event has both.

Differences from SGLang that are deliberate: ``min_new_tokens > 0`` is honoured without a
tokenizer; ``sampling_seed`` is always honoured (the engine is deterministic); a negative
``sampling_seed`` is mapped into ``[0, 2**63)``.

Routes are built by :func:`build_app`; ``python -m rollout_backends.adapters.reference.serve``
is the command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
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
    SamplingParams,
    TokenChunk,
)
from rollout_backends.kit import (
    AbortAll,
    AbortRequest,
    decode_tensor_payload,
    deserialize_named_tensors,
    json_loads,
    serialize_named_tensors,
)
from rollout_backends.sglang_native import (
    ADMIN_ROUTES,
    NativeRequest,
    ParseRules,
    UnknownKeys,
    answer_body,
    decode_text,
    error_body,
    native_field,
    parse_abort_body,
    parse_destroy_group_body,
    parse_disk_body,
    parse_memory_body,
    parse_pause_body,
    parse_request,
    parse_set_version_body,
    parse_tensors_body,
)

from ._engine import ENABLE_MEMORY_SAVER

__all__ = [
    "SERVER_KEY",
    "ReferenceServer",
    "build_app",
    "deserialize_named_tensors",
    "serialize_named_tensors",
]

log = logging.getLogger("rollout_backends.reference.server")

_FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)

#: The test-only route that arms injected faults (served only with ``fault_injection=True``).
FAULTS_ROUTE = "/_faults"
_FAULT_MODES = ("error", "close", "delay")

#: Routes that take the admin key when one is set: SGLang's, and the fault switch.
_ADMIN_ROUTES = ADMIN_ROUTES | {FAULTS_ROUTE}
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
        data = json_loads(raw)
    except (ValueError, RecursionError) as e:  # orjson refuses past 1024 levels, the stdlib recurses
        raise _BadRequest(error_body(InvalidRequest("body", f"invalid JSON: {e}"))) from None
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
        tokenizer: Any = None,
        unknown_keys: UnknownKeys = UnknownKeys.REFUSE,
    ) -> None:
        self.engine = engine
        #: A ``tokenizers.Tokenizer`` (``text`` in and out, like SGLang with its tokenizer); None is
        #: ``--skip-tokenizer-init``: token ids only.
        self.tokenizer = tokenizer
        self.unknown_keys = unknown_keys
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
            need = self._admin_key if (path in _ADMIN_ROUTES and self._admin_key) else self._api_key
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
        except InvalidRequest as e:  # a control body the codec refused, naming the key: SGLang's
            # failed-control shape (``success: false``) with the error object that names the field
            return _json({"success": False, "message": str(e), **error_body(e)}, 400)
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

    def _rules(self) -> ParseRules:
        return ParseRules(
            unknown_keys=self.unknown_keys,
            vocab_size=int(self.engine.vocab_size),
            max_context=int(self.engine.max_context),
            allow_prefill_only=True,
            allow_stream=True,
            stop_strings=self.tokenizer is not None and bool(self.engine.has_tokenizer),
        )

    def _encode(self, text: str) -> list[int]:
        assert self.tokenizer is not None
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def parse(self, body: object) -> NativeRequest:
        """A ``/generate`` body -> the request (an ``InvalidRequest`` names the caller's field)."""
        return parse_request(
            body,
            rules=self._rules(),
            encode=self._encode if self.tokenizer is not None else None,
            new_rid=lambda: uuid.uuid4().hex,
        )

    def _answer(self, parsed: NativeRequest, g: Generation) -> dict[str, Any]:
        req = parsed.request
        text = None if self.tokenizer is None else decode_text(self.tokenizer, g, parsed.text_options)
        prompt = req.input_ids if parsed.return_prompt_token_ids else None
        return answer_body(
            g, return_logprob=req.return_logprobs, text=text, prompt_token_ids=prompt, input_ids=req.input_ids
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request, allow_empty=False)
        try:
            parsed = self.parse(body)
        except InvalidRequest as e:
            return _json(error_body(e), 400)
        if parsed.stream:
            return await self._stream(request, parsed)
        req = parsed.request
        if req.request_id in self._inflight:
            # SGLang's words; the first request keeps running (and is not aborted by this one).
            return _json(error_body(InvalidRequest("rid", f"Duplicate request ID detected: {req.request_id}")), 400)
        if parsed.prefill_only and req.prompt_logprobs_start is None:  # a bare prefill: nothing to compute
            return _json(self._answer(parsed, self._bare_prefill(req)))
        self._inflight.add(req.request_id)
        try:
            g = await self.engine.generate(req)
        except InvalidRequest as e:
            return _json(error_body(InvalidRequest(native_field(e.field), e.reason)), 400)
        except Exception as e:
            log.exception("generate %s failed", req.request_id)
            return _json({"error": {"message": f"{type(e).__name__}: {e}"}}, 500)
        finally:
            self._inflight.discard(req.request_id)
        return _json(self._answer(parsed, g))

    def _bare_prefill(self, req: GenerateRequest) -> Generation:
        return Generation(
            request_id=req.request_id,
            output_ids=(),
            logprobs=(),
            finish_reason=FinishReason.LENGTH,
            weight_version=self.engine.weight_version,
            prompt_tokens=len(req.input_ids),
        )

    def _partial(self, parsed: NativeRequest, so_far: Generation) -> dict[str, Any]:
        """A streamed event before the last: the answer so far (``finish_reason`` null)."""
        req = parsed.request
        text = None if self.tokenizer is None else decode_text(self.tokenizer, so_far, parsed.text_options)
        prompt = req.input_ids if parsed.return_prompt_token_ids else None
        return answer_body(
            so_far, return_logprob=req.return_logprobs, text=text, prompt_token_ids=prompt, finished=False
        )

    async def _stream(self, request: web.Request, parsed: NativeRequest) -> web.StreamResponse:
        """``"stream": true``: SGLang 0.5.16's event stream (see the module docstring).

        The engine's stream is closed on every way out (``aclosing``): a client gone away (a
        write raises ``ConnectionResetError``, aiohttp's ``ClientConnectionResetError`` is one) or
        a cancelled handler aborts the request in the engine."""
        req = parsed.request
        resp = web.StreamResponse(status=200)
        resp.content_type = "text/event-stream"
        resp.charset = "utf-8"  # SGLang's head: ``text/event-stream; charset=utf-8``
        await resp.prepare(request)

        async def send(event: object) -> None:
            await resp.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")

        async def done() -> web.StreamResponse:
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

        if req.request_id in self._inflight:
            # SGLang's tokenizer manager refuses a duplicate rid after the 200 (http_server.py
            # stream_results: its ValueError becomes one error event); the first one keeps running.
            await send({"error": {"message": f"Duplicate request ID detected: {req.request_id}"}})
            return await done()
        if parsed.prefill_only and req.prompt_logprobs_start is None:  # a bare prefill: one final event
            await send(self._answer(parsed, self._bare_prefill(req)))
            return await done()
        self._inflight.add(req.request_id)
        t0 = time.monotonic()
        ids: list[int] = []
        lps: list[float] = []
        tops: list[tuple[tuple[int, float], ...]] = []
        try:
            async with contextlib.aclosing(self.engine.stream(req)) as chunks:
                chunk: TokenChunk
                async for chunk in chunks:
                    if chunk.final is not None:
                        await send(self._answer(parsed, chunk.final))
                        break
                    ids.extend(chunk.output_ids)
                    if chunk.logprobs is not None:
                        lps.extend(chunk.logprobs)
                    if chunk.top_logprobs is not None:
                        tops.extend(chunk.top_logprobs)
                    so_far = Generation(
                        request_id=req.request_id,
                        output_ids=tuple(ids),
                        logprobs=tuple(lps) if req.return_logprobs else None,
                        # Nulled by ``finished=False``; LENGTH keeps decode_text from trimming a stop.
                        finish_reason=FinishReason.LENGTH,
                        weight_version=self.engine.weight_version,
                        prompt_tokens=len(req.input_ids),
                        latency_s=time.monotonic() - t0,
                        top_logprobs=tuple(tops) if req.return_logprobs and req.sampling.top_logprobs else None,
                    )
                    await send(self._partial(parsed, so_far))
        except ConnectionResetError:  # the client went away; ``aclosing`` aborted the request
            log.info("stream %s: the client went away after %d tokens", req.request_id, len(ids))
            return resp
        except InvalidRequest as e:  # the engine's own checks: SGLang's ValueError event
            await send({"error": {"message": str(InvalidRequest(native_field(e.field), e.reason))}})
            return await done()
        except Exception as e:
            log.exception("stream %s failed", req.request_id)
            await send({"error": {"message": f"{type(e).__name__}: {e}"}})
            return await done()
        finally:
            self._inflight.discard(req.request_id)
        return await done()

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
            "tokenizer_path": self.model_path if self.tokenizer is not None else None,
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
                "tokenizer_path": self.model_path if self.tokenizer is not None else None,
                "skip_tokenizer_init": self.tokenizer is None,
                "load_format": self.load_format,
                "host": self.host,
                "port": self.port,
                "tp_size": 1,
                "dp_size": 1,
                "page_size": self.page_size,
                "context_length": ctx,
                "max_total_num_tokens": None,
                "enable_deterministic_inference": True,
                "enable_memory_saver": ENABLE_MEMORY_SAVER,
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

    # Control bodies are parsed by the codec (the inverses of the builders the wires send): every
    # value's JSON type, SGLang's defaults, a 400 naming the key.

    async def abort_request(self, request: web.Request) -> web.StreamResponse:
        op = parse_abort_body(await _body(request))
        if isinstance(op, AbortAll):
            await self.engine.abort_all()
        elif isinstance(op, AbortRequest):
            await self.engine.abort(op.request_id)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.StreamResponse:
        pm = parse_pause_body(await _body(request)).mode
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
        raw = request.query.get("timeout", "0")
        try:  # SGLang's ``timeout`` query (seconds to wait for idle, >= 0)
            wait_s = float(raw)
        except ValueError:
            wait_s = -1.0
        if not (0.0 <= wait_s <= 3600.0):
            return web.Response(text=f"timeout: must be a number of seconds in [0, 3600], got {raw!r}\n", status=400)
        try:
            await self.engine.flush_cache(wait_s=wait_s)
        except Exception as e:
            return web.Response(text=f"{e}\n", status=400)
        return web.Response(text=_FLUSH_OK, status=200)

    async def update_weight_version(self, request: web.Request) -> web.StreamResponse:
        op, abort_all = parse_set_version_body(await _body(request))
        v = op.version
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
        op, abort_all = parse_disk_body(await _body(request))
        path, load_format, version, flush = op.path, op.load_format, op.version, op.flush_cache
        if abort_all:
            await self.engine.abort_all()
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
        tb = parse_tensors_body(await _body(request))
        entries, load_format, version, flush = tb.payloads, tb.load_format, tb.version, tb.flush_cache
        if len(entries) != 1:
            return self._result(False, f"expected 1 serialized_named_tensors entry (tp_size=1), got {len(entries)}")
        if (err := self._session_error()) is not None:
            return err
        try:
            # A flat bucket's (load_format "flattened_bucket") comes back as views into its buffer.
            named = decode_tensor_payload(entries[0], load_format)
        except Exception as e:
            return self._result(False, f"cannot decode serialized_named_tensors: {type(e).__name__}: {e}")
        if tb.abort_all_requests:
            await self.engine.abort_all()
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
        group_name = parse_destroy_group_body(await _body(request)).group_name
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
        parsed = parse_memory_body(await _body(request))
        tags = None if parsed is None else [t.value for t in parsed]
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


def load_tokenizer(model_path: str) -> Any:
    """The model's ``tokenizer.json`` as a ``tokenizers.Tokenizer``, or None where there is none."""
    path = os.path.join(model_path, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def build_app(engine: Any, *, skip_tokenizer_init: bool = False, **kwargs: Any) -> web.Application:
    """The aiohttp application serving ``engine``; ``kwargs`` go to :class:`ReferenceServer`.

    The model's tokenizer is loaded from ``model_path`` unless ``skip_tokenizer_init`` (or a
    ``tokenizer`` is given)."""
    if "tokenizer" not in kwargs and not skip_tokenizer_init:
        kwargs["tokenizer"] = load_tokenizer(str(kwargs.get("model_path") or ""))
    server = ReferenceServer(engine, **kwargs)
    app = web.Application(middlewares=[server.middleware], client_max_size=1024**3)
    app.add_routes(server.routes())
    app[SERVER_KEY] = server
    return app


#: ``app[SERVER_KEY]`` is the :class:`ReferenceServer` of an app made by :func:`build_app`.
SERVER_KEY = web.AppKey("server", ReferenceServer)
