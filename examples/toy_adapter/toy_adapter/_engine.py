"""The toy engine: a tiny language model behind a small JSON HTTP API of its own (not SGLang's).

The "model" is a seeded table: the logits of the next token depend on the weights' seed and the
last two tokens, so the same weights, prompt, sampling and seed always give the same tokens, and a
checkpoint is one number (``toy-weights.json``). Sampling follows SGLang's order (penalties, the
``min_new_tokens`` mask, temperature, top-k / top-p / min-p, draw); a logprob is the log-softmax of
the logits the token was chosen from. Each request runs one token at a time with a short sleep, so
it can be caught in flight: aborted, or paused.

Routes (every body JSON):

=====================  =================================================================
``POST /generate``     ``{rid, input_ids, sampling, logprobs, top_logprobs}`` -> the answer
``POST /abort``        ``{rid}`` or ``{all: true}``: end requests with their tokens so far
``POST /pause``        ``{mode: abort | in_place}``; ``POST /resume``
``POST /flush``        no cache to flush; refused while requests are frozen in place
``POST /load``         ``{path, version}``: load a checkpoint, then take the label
``POST /label``        ``{version}``; ``GET /version``
``GET /health``        live; ``GET /ready``: not paused; ``GET /health_generate``: one token
``GET /info``          ``{worker_id, vocab_size, max_context}``
=====================  =================================================================

A refused request answers 400 ``{"field": ..., "error": ...}``, naming the field as the client
library names it (``sampling.top_k``), so the adapter can raise ``InvalidRequest`` with it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

__all__ = [
    "EOS",
    "MAX_CONTEXT",
    "TOP_LOGPROBS",
    "VOCAB_SIZE",
    "ToyEngine",
    "read_checkpoint",
    "start_server",
    "write_checkpoint",
]

VOCAB_SIZE = 256
EOS = 0
MAX_CONTEXT = 512
#: The most top logprobs per token an answer carries.
TOP_LOGPROBS = 8
_CHECKPOINT = "toy-weights.json"
_SAMPLING_KEYS = frozenset(
    {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "min_new_tokens", "stop_token_ids", "ignore_eos",
     "seed", "repetition_penalty", "frequency_penalty", "presence_penalty"}
)  # fmt: skip


def write_checkpoint(path: str | Path, seed: int) -> str:
    """A toy checkpoint directory (weights = ``seed``) at ``path``; returns the path."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / _CHECKPOINT).write_text(json.dumps({"seed": seed}))
    return str(folder)


def read_checkpoint(path: str | Path) -> int:
    """The weights of the checkpoint at ``path`` (``ValueError`` naming what is wrong)."""
    file = Path(path) / _CHECKPOINT
    try:
        seed = json.loads(file.read_text())["seed"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"no toy checkpoint at {path} ({exc})") from None
    if not isinstance(seed, int):
        raise ValueError(f"{file}: seed must be an int, got {seed!r}")
    return seed


@functools.lru_cache(maxsize=1 << 16)
def _logits(weights: int, before: int, last: int) -> tuple[float, ...]:
    rng = random.Random(f"{weights}:{before}:{last}")
    return tuple(rng.gauss(0.0, 3.0) for _ in range(VOCAB_SIZE))


def _log_softmax(logits: Sequence[float]) -> list[float]:
    top = max(logits)
    total = math.log(sum(math.exp(x - top) for x in logits if x != -math.inf))
    return [x - top - total if x != -math.inf else -math.inf for x in logits]


class _Request:
    def __init__(self, rid: str, input_ids: list[int], sampling: Mapping[str, Any], top_k: int) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.sp = {**_DEFAULTS, **sampling}
        self.top_k = top_k
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[list[float]]] = []
        self.aborted = False
        seed = self.sp["seed"]
        self.rng = random.Random(seed) if seed is not None else random.Random()


_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "min_new_tokens": 0,
    "stop_token_ids": [], "ignore_eos": False, "seed": None, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
}  # fmt: skip


class ToyEngine:
    """One toy worker: its weights, its label, its requests in flight."""

    def __init__(self, worker_id: str, weights: int = 0, version: str = "default", token_delay: float = 0.001) -> None:
        self.worker_id = worker_id
        self.weights = weights
        self.version = version
        self.token_delay = token_delay
        self.paused: str | None = None
        self.requests: dict[str, _Request] = {}

    # -- generation ---------------------------------------------------------------------------

    async def generate(self, body: Mapping[str, Any]) -> dict[str, Any]:
        req = self._admit(body)
        self.requests[req.rid] = req
        try:
            finish, matched = await self._run(req)
        finally:
            self.requests.pop(req.rid, None)
        return {
            "rid": req.rid, "output_ids": req.output_ids, "finish": finish, "matched_stop": matched,
            "logprobs": req.logprobs if body.get("logprobs", True) else None,
            "top_logprobs": req.top if req.top_k else None, "prompt_tokens": len(req.input_ids),
            "version": self.version, "worker": self.worker_id,
        }  # fmt: skip

    def _admit(self, body: Mapping[str, Any]) -> _Request:
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < VOCAB_SIZE for t in ids):
            raise _Refused("input_ids", f"must be a non-empty list of token ids in [0, {VOCAB_SIZE})")
        sampling = body.get("sampling") or {}
        unknown = set(sampling) - _SAMPLING_KEYS
        if unknown:
            raise _Refused(f"sampling.{sorted(unknown)[0]}", "unknown sampling parameter")
        budget = int(sampling.get("max_new_tokens", _DEFAULTS["max_new_tokens"]))
        if len(ids) + budget > MAX_CONTEXT:
            raise _Refused("input_ids", f"{len(ids)} + {budget} new tokens exceed the context ({MAX_CONTEXT})")
        top_k = int(body.get("top_logprobs", 0))
        if not 0 <= top_k <= TOP_LOGPROBS:
            raise _Refused("sampling.top_logprobs", f"must be in [0, {TOP_LOGPROBS}]")
        rid = str(body.get("rid") or "")
        if not rid or rid in self.requests:
            raise _Refused("request_id", f"{rid!r} is empty or already in flight")
        return _Request(rid, ids, sampling, top_k)

    async def _run(self, req: _Request) -> tuple[str, int | None]:
        sp = req.sp
        stops = {EOS, *sp["stop_token_ids"]} if not sp["ignore_eos"] else set()
        while len(req.output_ids) < sp["max_new_tokens"]:
            while self.paused is not None and not req.aborted:  # frozen in place, or waiting to start
                await asyncio.sleep(0.005)
            if req.aborted:
                return "abort", None
            token = self._step(req)
            if token in stops and len(req.output_ids) >= sp["min_new_tokens"]:
                return "stop", token
            await asyncio.sleep(self.token_delay)
        return "length", None

    def _step(self, req: _Request) -> int:
        """Choose the next token of ``req`` and record it with its logprob (and top logprobs)."""
        sp, out = req.sp, req.output_ids
        context = [*req.input_ids, *out]
        logits = list(_logits(self.weights, context[-2] if len(context) > 1 else EOS, context[-1]))
        counts = {t: out.count(t) for t in set(out)}
        for t, n in counts.items():
            x = logits[t]
            rp = sp["repetition_penalty"]
            x = x / rp if x > 0 else x * rp
            logits[t] = x - sp["frequency_penalty"] * n - sp["presence_penalty"]
        if len(out) < sp["min_new_tokens"]:
            for t in {EOS, *sp["stop_token_ids"]}:
                logits[t] = -math.inf
        temperature = sp["temperature"]
        if temperature == 0:
            lps = _log_softmax(logits)
            token = max(range(VOCAB_SIZE), key=lambda t: (lps[t], -t))
        else:
            lps = _log_softmax([x / temperature for x in logits])
            token = _draw(lps, sp, req.rng)
        out.append(token)
        req.logprobs.append(lps[token])
        if req.top_k:
            best = sorted(range(VOCAB_SIZE), key=lambda t: (-lps[t], t))[: req.top_k]
            req.top.append([[t, lps[t]] for t in best])
        return token

    # -- control ------------------------------------------------------------------------------

    def abort(self, rid: str | None) -> None:
        for req in list(self.requests.values()):
            if rid is None or req.rid == rid:
                req.aborted = True

    def pause(self, mode: str) -> None:
        if mode not in ("abort", "in_place"):
            raise _Refused("mode", f"pause mode {mode!r}: this engine has abort and in_place")
        if mode == "abort":
            self.abort(None)
        self.paused = mode

    def flush(self) -> None:
        if self.paused == "in_place" and self.requests:
            raise _Refused("flush", f"{len(self.requests)} requests are frozen in place with their state")

    def load(self, path: str, version: str | None) -> None:
        try:
            self.weights = read_checkpoint(path)
        except ValueError as exc:
            raise _Refused("path", str(exc)) from None
        if version is not None:
            self.version = version


def _draw(lps: Sequence[float], sp: Mapping[str, Any], rng: random.Random) -> int:
    """A token drawn from ``exp(lps)`` after top-k, top-p and min-p (the most likely one always kept)."""
    order = sorted(range(VOCAB_SIZE), key=lambda t: (-lps[t], t))
    probs = [math.exp(lps[t]) for t in order]
    kept: list[float] = []
    seen = 0.0
    for i, p in enumerate(probs):
        keep = i == 0 or ((sp["top_k"] < 1 or i < sp["top_k"]) and seen <= sp["top_p"] and p >= sp["min_p"] * probs[0])
        kept.append(p if keep else 0.0)
        seen += p
    u = rng.random() * sum(kept)
    for t, p in zip(order, kept, strict=True):
        u -= p
        if p and u <= 0:
            return t
    return order[0]


class _Refused(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# -- HTTP -----------------------------------------------------------------------------------------


def _app(engine: ToyEngine) -> web.Application:
    async def body_of(request: web.Request) -> dict[str, Any]:
        data = await request.json() if request.can_read_body else {}
        return data if isinstance(data, dict) else {}

    def handler(call: Any) -> Any:
        async def handle(request: web.Request) -> web.Response:
            try:
                return web.json_response(await call(await body_of(request)))
            except _Refused as exc:
                return web.json_response({"field": exc.field, "error": str(exc)}, status=400)

        return handle

    async def ok(_: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True}

    async def ready(_: web.Request) -> web.Response:
        return web.json_response({"ready": engine.paused is None}, status=200 if engine.paused is None else 503)

    async def one_token(_: dict[str, Any]) -> dict[str, Any]:
        probe = {"rid": f"health-{random.getrandbits(64):x}", "input_ids": [1], "sampling": {"max_new_tokens": 1}}
        return await engine.generate(probe)

    async def pause(b: dict[str, Any]) -> dict[str, Any]:
        engine.pause(str(b.get("mode")))
        return {"ok": True}

    async def resume(_: dict[str, Any]) -> dict[str, Any]:
        engine.paused = None
        return {"ok": True}

    async def abort(b: dict[str, Any]) -> dict[str, Any]:
        engine.abort(None if b.get("all") else str(b.get("rid")))
        return {"ok": True}

    async def flush(_: dict[str, Any]) -> dict[str, Any]:
        engine.flush()
        return {"ok": True}

    async def load(b: dict[str, Any]) -> dict[str, Any]:
        engine.load(str(b.get("path")), b.get("version"))
        return {"ok": True}

    async def label(b: dict[str, Any]) -> dict[str, Any]:
        engine.version = str(b["version"])
        return {"ok": True}

    async def version(_: dict[str, Any]) -> dict[str, Any]:
        return {"version": engine.version}

    async def info(_: dict[str, Any]) -> dict[str, Any]:
        return {"worker_id": engine.worker_id, "vocab_size": VOCAB_SIZE, "max_context": MAX_CONTEXT}

    app = web.Application()
    app.router.add_post("/generate", handler(engine.generate))
    for path, call in (("/abort", abort), ("/pause", pause), ("/resume", resume), ("/flush", flush),
                       ("/load", load), ("/label", label)):  # fmt: skip
        app.router.add_post(path, handler(call))
    for path, call in (("/health", ok), ("/health_generate", one_token), ("/version", version), ("/info", info)):
        app.router.add_get(path, handler(call))
    app.router.add_get("/ready", ready)
    return app


async def start_server(engine: ToyEngine, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve ``engine`` on ``host:port`` (0: a free port) in this event loop; returns the runner
    (``await runner.cleanup()`` stops it) and the port."""
    runner = web.AppRunner(_app(engine), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, int(runner.addresses[0][1])
