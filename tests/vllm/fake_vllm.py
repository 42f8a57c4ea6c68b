"""A vLLM 0.26 server stand-in for CPU tests: the routes ``vllm serve`` serves with
``VLLM_SERVER_DEV_MODE=1``, the request models and answers as vLLM's, over our CPU reference engine.

Written from the ``vllm==0.26.0`` wheel, independently of the adapter's codec (so the adapter is
tested against vLLM's shapes, not its own): the request models mirror ``GenerateRequest`` and
``SamplingParams`` (``scale_out/token_in_token_out/protocol.py``, ``sampling_params.py``), the
answers ``ServingTokens.serve_tokens_*`` (``serving.py``), the control routes
``serve/dev/{rlhf,cache,rpc,sleep,server_info}/api_router.py``, the error bodies
``serve/utils/server_utils.py``. What the reference engine cannot know vLLM's way is listed in
``KNOWN_DIFFERENCES`` (the capture comparison skips those paths, naming why).

Behaviour the engine gives as vLLM does (``docs/vllm.md``): ``/pause?mode=abort`` aborts every
request (answers ``finish_reason: "abort"`` with their tokens), ``mode=keep&clear_cache=true``
preempts them (KV dropped, recomputed on resume), ``mode=keep&clear_cache=false`` freezes them with
their KV (then ``/reset_prefix_cache`` answers ``{"success": false}``); new requests queue while
paused. ``/collective_rpc`` knows ``reload_weights`` only. No weight-transfer engine (CPU: no NCCL,
no CUDA IPC): ``--weight-transfer-config`` is never set, and its routes answer as vLLM does then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pydantic
from aiohttp import web

from rollout_backends import (
    FinishReason,
    GenerateRequest,
    Generation,
    MemoryTag,
    PauseMode,
    SamplingParams,
    TokenChunk,
)
from rollout_backends.adapters.reference import ReferenceEngine
from tests.aiohttp_app import serving

__all__ = ["KNOWN_DIFFERENCES", "FakeVllm", "fake_vllm", "main"]

#: Answer paths where the fake cannot answer vLLM's way (``*``: any key or index), and why.
KNOWN_DIFFERENCES = {
    "prompt_logprobs[*].*.rank": "the reference engine gives no vocabulary rank (vLLM: an int)",
    "created": "a clock value",
    "model": "the served model's name",
}


#: The GPU capture the fake's ``/server_info`` copies vLLM's configuration from.
CAPTURE = Path(__file__).resolve().parents[1] / "data" / "vllm-0.26.0-answers.json"


@functools.cache
def _captured_server_info_text() -> str:
    """vLLM 0.26's ``/server_info`` answer in the capture (``{}`` without the capture: the fake then
    answers only the keys the adapter reads)."""
    if not CAPTURE.is_file():
        return "{}"
    exchanges = json.loads(CAPTURE.read_text())["exchanges"]
    return next((ex["body"] for ex in exchanges if ex["name"] == "server_info" and ex["status"] == 200), "{}")


def _captured_server_info() -> dict[str, Any]:
    info = json.loads(_captured_server_info_text())
    return info if isinstance(info, dict) else {}


class VllmValidationError(ValueError):
    """``vllm.exceptions.VLLMValidationError``: a ``ValueError`` naming its ``parameter``."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter


class SamplingParamsModel(pydantic.BaseModel):
    """The ``SamplingParams`` fields the fake honours; unknown keys are dropped, as vLLM's
    ``PydanticMsgspecMixin`` typed-dict schema does."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True

    @pydantic.model_validator(mode="after")
    def _verify_args(self) -> SamplingParamsModel:
        """``SamplingParams._verify_args`` and ``_validate_logprobs`` (the checks our requests can hit)."""
        checks = [
            (self.n < 1, f"n must be at least 1, got {self.n}.", "n"),
            (not -2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]", "presence_penalty"),
            (not -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]", "frequency_penalty"),
            (self.repetition_penalty <= 0.0, "repetition_penalty must be greater than zero", "repetition_penalty"),
            (not 0.0 <= self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}.",
             "temperature"),
            (not 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.", "top_p"),
            (self.top_k < -1, f"top_k must be -1 (disable), or at least 1, got {self.top_k}.", "top_k"),
            (not 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.", "min_p"),
            (self.max_tokens is not None and self.max_tokens < 1,
             f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens"),
            (self.min_tokens < 0, "min_tokens must be greater than or equal to 0", "min_tokens"),
            (self.logprobs is not None and self.logprobs < 0, f"logprobs must be non-negative, got {self.logprobs}.",
             "logprobs"),
        ]  # fmt: skip
        for failed, message, param in checks:
            if failed:
                raise VllmValidationError(message, param)
        return self


class StreamOptionsModel(pydantic.BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class GenerateRequestModel(pydantic.BaseModel):
    """``token_in_token_out.protocol.GenerateRequest`` (the fields the fake reads)."""

    request_id: str = pydantic.Field(default_factory=lambda: uuid.uuid4().hex)
    token_ids: list[int] = pydantic.Field(min_length=1)
    sampling_params: SamplingParamsModel
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptionsModel | None = None
    priority: int = 0

    @pydantic.field_validator("token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v


def _error(message: str, status: int, param: str | None = None, kind: str = "Bad Request") -> web.Response:
    """``ErrorResponse`` (``{"error": {"message", "type", "param", "code"}}``)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


def _validation_error(exc: pydantic.ValidationError) -> web.Response:
    """``validation_exception_handler``: the ``VLLMValidationError`` parameter, else the first loc."""
    errors = exc.errors()
    param = None
    for err in errors:
        ctx = err.get("ctx") or {}
        if isinstance(ctx.get("error"), VllmValidationError):
            param = ctx["error"].parameter
            break
    if param is None and errors:
        param = ".".join(str(p) for p in ("body", *errors[0]["loc"]))
    label = "error" if len(errors) == 1 else "errors"
    lines = "".join(f"  { ({k: v for k, v in e.items() if k != 'ctx'}) }\n" for e in errors)
    return _error(f"{len(errors)} validation {label}:\n{lines}".rstrip(), 400, param)


def _content(gen: Generation, start: int, end: int, asked: int | None) -> list[dict[str, Any]]:
    """``_create_tokens_logprobs``: per token its logprob and the first ``max(asked, 1)`` entries of
    vLLM's logprob dict (the sampled token first, then the best)."""
    out = []
    for i in range(start, end):
        tok = gen.output_ids[i]
        assert gen.logprobs is not None
        entries: dict[int, float] = {tok: gen.logprobs[i]}
        for t, lp in gen.top_logprobs[i] if gen.top_logprobs else ():
            entries.setdefault(t, lp)
        top = [{"token": f"token_id:{t}", "logprob": max(lp, -9999.0), "bytes": None} for t, lp in entries.items()]
        out.append(
            {
                "token": f"token_id:{tok}",
                "logprob": max(gen.logprobs[i], -9999.0),
                "bytes": None,
                "top_logprobs": top[: max(asked or 0, 1)],
            }
        )
    return out


class FakeVllm:
    """One fake server: the engine, the routes, what was asked of it (``calls``)."""

    def __init__(
        self,
        model_path: Path,
        *,
        model_name: str = "tiny",
        max_logprobs: int = 21,
        sleep_mode: bool = True,
        batch_invariant: bool = False,
        logprobs_mode: str = "processed_logprobs",
        answers_filtered: bool | None = None,
    ) -> None:
        #: ``--logprobs-mode`` (the launcher's by default): ``processed_*`` answers logprobs
        #: renormalised over the tokens top-k/top-p/min-p kept, as vLLM's sampler does; other modes
        #: the reference engine's unfiltered ones (vLLM's ``raw_logprobs`` are also before the
        #: penalties and the temperature: not modelled). ``answers_filtered`` other than ``None`` is a
        #: planted bug: the engine filters (or not) whatever ``/server_info`` says.
        self.logprobs_mode = logprobs_mode
        filtered = logprobs_mode.startswith("processed_") if answers_filtered is None else answers_filtered
        self.engine = ReferenceEngine(model_path, worker_id="fake-vllm", filtered_logprobs=filtered)
        self.model_path = model_path
        self.model_name = model_name
        self.max_logprobs = max_logprobs
        self.sleep_mode = sleep_mode
        #: Advertise VLLM_BATCH_INVARIANT=1 (the reference engine is batch invariant either way).
        self.batch_invariant = batch_invariant
        self.sleeping = False
        #: The executor's ``sleeping_tags`` (``vllm/v1/executor/abstract.py``): what is still asleep.
        self.sleeping_tags: set[str] = set()
        #: Set by a plain ``/wake_up`` after a partial one: vLLM's engine answered nothing after it.
        self.stuck = asyncio.Event()
        #: Set by a failed ``reload_weights``: vLLM 0.26's engine core died (every later POST an
        #: HTTP 500 ``EngineDeadError``; H100 capture of 2026-12-06 06:22).
        self.dead = False
        self.calls: list[tuple[str, str]] = []
        #: ``host:port`` once served (the backend's worker id).
        self.url_id = ""

    # -- generation -------------------------------------------------------------------------

    def _engine_request(self, req: GenerateRequestModel) -> GenerateRequest:
        sp = req.sampling_params
        if sp.logprobs is not None and sp.logprobs > self.max_logprobs:
            raise VllmValidationError(
                f"Requested sample logprobs of {sp.logprobs}, which is greater than max allowed: {self.max_logprobs}",
                "logprobs",
            )
        if max(req.token_ids) >= self.engine.vocab_size:
            raise ValueError(f"Token id {max(req.token_ids)} is out of vocabulary")
        if len(req.token_ids) >= self.engine.max_context:
            raise VllmValidationError(
                f"This model's maximum context length is {self.engine.max_context} tokens. "
                f"However, your request has {len(req.token_ids)} input tokens.",
                "input_tokens",
            )
        want_top = min(sp.logprobs or 0, 20)
        sampling = SamplingParams(
            max_new_tokens=sp.max_tokens or 16,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else -1,
            min_p=sp.min_p,
            min_new_tokens=sp.min_tokens,
            # vLLM's ignore_eos ignores EOS only; explicit stop ids still stop (unlike SGLang's).
            stop_token_ids=tuple(sp.stop_token_ids or ()),
            ignore_eos=sp.ignore_eos and not sp.stop_token_ids,
            seed=sp.seed,
            repetition_penalty=sp.repetition_penalty,
            frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty,
            top_logprobs=want_top,
        )
        return GenerateRequest(
            input_ids=req.token_ids,
            sampling=sampling,
            request_id=f"generate-tokens-{req.request_id}",
            return_logprobs=sp.logprobs is not None or sp.prompt_logprobs is not None,
            prompt_logprobs_start=0 if sp.prompt_logprobs is not None else None,
        )

    def _usage(self, gen: Generation) -> dict[str, Any]:
        n = len(gen.output_ids)
        return {
            "prompt_tokens": gen.prompt_tokens,
            "total_tokens": gen.prompt_tokens + n,
            "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens, "created_cache_tokens": None,
                                      "multimodal_tokens": None},
        }  # fmt: skip

    def _prompt_logprobs(self, request: GenerateRequest, gen: Generation) -> list[Any] | None:
        if gen.prompt_logprobs is None:
            return None
        out: list[Any] = [None]
        for tok, lp in zip(request.input_ids[1:], gen.prompt_logprobs[1:], strict=True):
            out.append({str(tok): {"logprob": max(lp, -9999.0) if lp is not None else -9999.0, "rank": None,
                                   "decoded_token": None}})  # fmt: skip
        return out

    def _answer(self, request: GenerateRequest, gen: Generation, asked: int | None) -> dict[str, Any]:
        """``serve_tokens_full_generator``'s ``GenerateResponse``."""
        logprobs = {"content": _content(gen, 0, len(gen.output_ids), asked)} if asked is not None else None
        choice = {
            "index": 0,
            "logprobs": logprobs,
            "finish_reason": gen.finish_reason.value,
            "token_ids": list(gen.output_ids),
            "routed_experts": None,
        }
        return {
            "request_id": request.request_id,
            "model": self.model_name,
            "created": int(time.time()),
            "choices": [choice],
            "usage": self._usage(gen),
            "prompt_logprobs": self._prompt_logprobs(request, gen),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
        }

    async def generate(self, http: web.Request) -> web.StreamResponse:
        if self.stuck.is_set():
            await asyncio.Event().wait()  # no answer, as vLLM gave none after the failed wake-up
        try:
            req = GenerateRequestModel.model_validate(await http.json())
            request = self._engine_request(req)
        except pydantic.ValidationError as exc:
            return _validation_error(exc)
        except VllmValidationError as exc:
            return _error(str(exc), 400, exc.parameter)
        except ValueError as exc:
            return _error(str(exc), 400, None, "BadRequestError")
        asked = req.sampling_params.logprobs
        if req.stream:
            return await self._stream(http, req, request, asked)
        gen = await self.engine.generate(request)
        return web.json_response(self._answer(request, gen, asked))

    async def _stream(
        self, http: web.Request, req: GenerateRequestModel, request: GenerateRequest, asked: int | None
    ) -> web.StreamResponse:
        """``serve_tokens_stream_generator``: an event per output that adds tokens (the last with its
        finish_reason; an output adding none is skipped), the usage event, ``[DONE]``."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(http)
        # The client going away ends the engine's stream, which aborts the request (with_cancellation).
        with contextlib.suppress(ConnectionResetError):
            await self._stream_events(resp, request, req, asked)
        return resp

    async def _stream_events(
        self, resp: web.StreamResponse, request: GenerateRequest, req: GenerateRequestModel, asked: int | None
    ) -> None:

        async def write(chunk: TokenChunk, gen: Generation, finish: FinishReason | None) -> None:
            start = chunk.index if chunk.final is not None else 0
            choice = {
                "index": 0,
                "logprobs": {"content": _content(gen, start, start + len(chunk.output_ids), asked)}
                if asked is not None
                else None,
                "finish_reason": None if finish is None else finish.value,
                "token_ids": list(chunk.output_ids),
                "routed_experts": None,
            }
            event = {"request_id": request.request_id, "choices": [choice], "usage": None}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())

        def partial(chunk: TokenChunk) -> Generation:
            return Generation(
                request_id=request.request_id, output_ids=chunk.output_ids, logprobs=chunk.logprobs,
                finish_reason=FinishReason.LENGTH, weight_version=None, prompt_tokens=len(request.input_ids),
                top_logprobs=chunk.top_logprobs,
            )  # fmt: skip

        # One chunk held back: vLLM's finishing token arrives with its finish_reason, and the
        # engine may deliver the last token before it says the request finished.
        pending: TokenChunk | None = None
        final: Generation | None = None
        async for chunk in self.engine.stream(request):
            if chunk.final is None:
                if pending is not None:
                    await write(pending, partial(pending), None)
                pending = chunk
                continue
            final = chunk.final
            aborted = final.finish_reason is FinishReason.ABORT
            if chunk.output_ids:
                if pending is not None:
                    await write(pending, partial(pending), None)
                await write(chunk, final, final.finish_reason)
            elif pending is not None:
                # An abort adds no token: vLLM skips that output, so no finish_reason is sent.
                await write(pending, partial(pending), None if aborted else final.finish_reason)
        if final is not None and req.stream_options is not None and req.stream_options.include_usage:
            usage = {k: v for k, v in self._usage(final).items() if v is not None}
            await resp.write(
                f"data: {json.dumps({'request_id': request.request_id, 'choices': [], 'usage': usage})}\n\n".encode()
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    # -- control ----------------------------------------------------------------------------

    async def pause(self, http: web.Request) -> web.Response:
        mode = http.query.get("mode", "abort")
        clear = http.query.get("clear_cache", "true").lower() == "true"
        modes = {"abort": PauseMode.ABORT, "keep": PauseMode.RETRACT if clear else PauseMode.IN_PLACE}
        if mode not in modes:
            # "wait" (drain) is vLLM's third mode; the adapter never sends it and the engine has none.
            return web.json_response({"error": f"Invalid pause mode: {mode}"}, status=400)
        await self.engine.pause(modes[mode])
        return web.json_response({"status": "paused"})

    async def resume(self, http: web.Request) -> web.Response:
        await self.engine.resume()
        return web.json_response({"status": "resumed"})

    async def is_paused(self, http: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.engine.paused is not None or self.sleeping})

    async def abort_requests(self, http: web.Request) -> web.Response:
        ids = (await http.json()).get("request_ids")
        if ids:
            for rid in ids:
                await self.engine.abort(rid)
            return web.json_response({"status": "aborted", "aborted": len(ids)})
        n = await self.engine.abort_all()
        return web.json_response({"status": "aborted", "aborted": n})

    async def reset_prefix_cache(self, http: web.Request) -> web.Response:
        try:
            await self.engine.flush_cache()
        except Exception:
            return web.json_response({"success": False})  # blocks still held
        return web.json_response({"success": True})

    async def collective_rpc(self, http: web.Request) -> web.Response:
        body = await http.json()
        if body.get("method") is None:
            return _error("Missing 'method' in request body", 400, None)
        if body["method"] != "reload_weights":
            return web.Response(status=500, text="Internal Server Error")  # AttributeError in the worker
        path = (body.get("kwargs") or {}).get("weights_path") or str(self.model_path)
        try:
            await self.engine.update_weights_from_disk(path, flush_cache=False)
        except Exception as exc:
            self.dead = True  # the layerwise reload failed inside the engine core, which died
            return _error(f"Call to collective_rpc method failed: {exc}", 500, None, "InternalServerError")
        return web.json_response({"results": [None]})

    async def transfer_not_configured(self, http: web.Request) -> web.Response:
        # _check_weight_transfer_engine raises RuntimeError in the worker: an unhandled 500.
        return web.Response(status=500, text="Internal Server Error")

    async def sleep(self, http: web.Request) -> web.Response:
        if not self.sleep_mode:
            return web.Response(status=500, text="Internal Server Error")  # sleep mode is not enabled
        if http.query.get("mode", "abort") == "abort":
            await self.engine.abort_all()
        await self.engine.pause(PauseMode.RETRACT)  # level >= 1: clear_cache, running ones preempted
        await self.engine.release_memory(None)
        self.sleeping = True
        self.sleeping_tags = {"weights", "kv_cache"}
        return web.Response(status=200)

    async def wake_up(self, http: web.Request) -> web.Response:
        """vLLM 0.26's ``Executor.wake_up``: nothing when not asleep, nothing (a warning) when a
        named tag is not asleep; ``tags=None`` reaches ``CuMemAllocator.wake_up(None)``, which maps
        every allocation again, so after a partial wake it fails (HTTP 500, "CUDA Error: invalid
        argument") and the engine answers nothing more (H100 capture of 2026-12-06)."""
        tags = http.query.getall("tags", []) or None
        if not self.sleeping_tags or (tags is not None and not set(tags) <= self.sleeping_tags):
            return web.Response(status=200)
        if tags is None and self.sleeping_tags != {"weights", "kv_cache"}:
            self.stuck.set()
            msg = "Call to wake_up method failed: CUDA Error: invalid argument at <path>:169"
            return _error(msg, 500, None, "InternalServerError")
        known = {"weights": MemoryTag.WEIGHTS, "kv_cache": MemoryTag.KV_CACHE}
        await self.engine.resume_memory([known[t] for t in tags if t in known] if tags else None)
        self.sleeping_tags -= set(tags) if tags else self.sleeping_tags
        if not self.sleeping_tags:
            self.sleeping = False
            await self.engine.resume()  # EngineCore.wake_up: resume scheduling once all is resident
        return web.Response(status=200)

    async def is_sleeping(self, http: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.sleeping or self.engine.paused is not None})

    async def health(self, http: web.Request) -> web.Response:
        return web.Response(status=200)

    async def world_size(self, http: web.Request) -> web.Response:
        return web.json_response({"world_size": 1})

    async def metrics(self, http: web.Request) -> web.Response:
        """The two Prometheus series the capture keeps (the fake counts no preemption)."""
        running = self.engine.num_running
        text = f'vllm:num_preemptions_total{{model_name="{self.model_name}"}} 0.0\n'
        text += f'vllm:num_requests_running{{model_name="{self.model_name}"}} {running}.0\n'
        return web.Response(text=text, content_type="text/plain")

    async def models(self, http: web.Request) -> web.Response:
        """``OpenAIServingModels.show_available_models`` (``entrypoints/openai/models/serving.py``): a
        ``ModelCard`` with one default ``ModelPermission`` (``entrypoints/openai/engine/protocol.py``)."""
        now = int(time.time())
        permission = {"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission", "created": now,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}  # fmt: skip
        card = {"id": self.model_name, "object": "model", "created": now, "owned_by": "vllm",
                "root": str(self.model_path), "parent": None, "max_model_len": self.engine.max_context,
                "permission": [permission]}  # fmt: skip
        return web.json_response({"object": "list", "data": [card]})

    async def server_info(self, http: web.Request) -> web.Response:
        """``/server_info?config_format=json``: vLLM's whole ``VllmConfig`` and ``VLLM_*`` environment,
        taken from the GPU capture (``_captured_server_info``) with this server's own values where
        the adapter reads them (``adapters/vllm/_client.py`` ``served_config``)."""
        info = _captured_server_info()
        cfg, env = info.setdefault("vllm_config", {}), info.setdefault("vllm_env", {})
        cfg.setdefault("model_config", {}).update(
            model=str(self.model_path), max_model_len=self.engine.max_context, max_logprobs=self.max_logprobs,
            enable_sleep_mode=self.sleep_mode, logprobs_mode=self.logprobs_mode,
        )  # fmt: skip
        cfg["weight_transfer_config"] = None  # no transfer engine on CPU (module docstring)
        env.update(VLLM_SERVER_DEV_MODE=True, VLLM_BATCH_INVARIANT=self.batch_invariant)
        return web.json_response(info)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        post, get = app.router.add_post, app.router.add_get
        post("/inference/v1/generate", self.generate)
        post("/pause", self.pause)
        post("/resume", self.resume)
        get("/is_paused", self.is_paused)
        post("/abort_requests", self.abort_requests)
        post("/reset_prefix_cache", self.reset_prefix_cache)
        post("/collective_rpc", self.collective_rpc)
        for path in (
            "/init_weight_transfer_engine",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
        ):
            post(path, self.transfer_not_configured)
        post("/sleep", self.sleep)
        post("/wake_up", self.wake_up)
        get("/is_sleeping", self.is_sleeping)
        get("/health", self.health)
        get("/get_world_size", self.world_size)
        get("/metrics", self.metrics)
        get("/v1/models", self.models)
        get("/server_info", self.server_info)
        return app

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.calls.append((request.method, request.path_qs))
        if self.dead and request.method == "POST":
            msg = "EngineCore encountered an issue. See stack trace (above) for the root cause."
            return _error(msg, 500, None, "InternalServerError")
        return await handler(request)  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        await self.engine.aclose()


@asynccontextmanager
async def fake_vllm(model_path: Path, **kw: Any) -> AsyncIterator[tuple[FakeVllm, str]]:
    """A fake server on a free loopback port: ``(fake, base_url)``."""
    fake = FakeVllm(model_path, **kw)
    try:
        async with serving(fake.app()) as url:
            fake.url_id = url.split("://", 1)[1]
            yield fake, url
    finally:
        await fake.aclose()
        await asyncio.sleep(0)


def main(argv: Sequence[str] | None = None) -> None:
    """One fake as a process, on ``vllm serve``'s command line (``python -m tests.vllm.fake_vllm
    --model DIR --host H --port P ...``): the flags the fake models are read, the rest ignored. The
    fan-out benchmark starts it on CPU in place of vLLM (``rb_bench.fanout.FakeVllmCommand``)."""
    p = argparse.ArgumentParser(prog="python -m tests.vllm.fake_vllm")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--served-model-name", default=None, help="default: the model path, as vLLM's")
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--logprobs-mode", default="raw_logprobs")
    p.add_argument("--enable-sleep-mode", action="store_true")
    args, _ = p.parse_known_args(argv)

    async def app() -> web.Application:
        fake = FakeVllm(
            Path(args.model),
            model_name=args.served_model_name or args.model,
            max_logprobs=args.max_logprobs,
            sleep_mode=args.enable_sleep_mode,
            logprobs_mode=args.logprobs_mode,
        )
        fake.url_id = f"{args.host}:{args.port}"
        served = fake.app()

        async def close(_: web.Application) -> None:
            await fake.aclose()

        served.on_cleanup.append(close)
        return served

    web.run_app(app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
