"""``ReferenceEngine``: a deterministic, in-process CPU engine that behaves like SGLang.

Why it exists: the protocol, the weight-update transaction and the conformance suite need an
engine whose every number is reproducible, that runs anywhere (CI, laptops) and that has the same
*control-plane* semantics as SGLang (pause modes, flush refusal, weight-update endpoints, memory
release, abort returning partial output). Throughput is not a goal.

How determinism is kept:

* weights are stored with the checkpoint's dtype (bf16 values) but computed in float32;
* every forward pass runs in one worker thread whose intra-op thread count is fixed
  (``num_threads``), so the same request gives the same tokens *and* logprobs in any process;
* requests are never batched: each has its own KV cache (an HF ``DynamicCache``) and the
  scheduler interleaves token-level steps round-robin, so a request's numbers never depend on
  what else is running;
* seeded sampling draws from a per-request ``torch.Generator`` seeded with ``sampling.seed``.

``cached_tokens`` is *reported* from a page-granular prefix index of the sequences seen since the
last flush (what SGLang's radix cache would have hit); the engine itself always recomputes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import json
import math
import random
import time
from collections import deque
from collections.abc import AsyncGenerator, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollout_backends import (
    FinishReason,
    GenerateRequest,
    Generation,
    InvalidRequest,
    MemoryTag,
    PauseMode,
    SamplingParams,
    TokenChunk,
)
from rollout_backends.sglang_native import StopStrings, trim_at_stop

from ._dist import GlooGroup, open_gloo_group, torch_dtype

__all__ = ["ENABLE_MEMORY_SAVER", "EngineError", "EngineHealth", "ReferenceEngine"]

#: ``release_memory`` / ``resume_memory`` drop and restore the weights and the KV cache, as SGLang's
#: ``release_memory_occupation`` does only with ``--enable-memory-saver``: what the reference server's
#: ``/server_info`` reports as ``enable_memory_saver``, and (``ReferenceEngine.enable_memory_saver``)
#: our Dynamo worker's ``get_internal_state`` (``adapters/dynamo/_worker.py``).
ENABLE_MEMORY_SAVER = True

_LOAD_FORMATS = (None, "auto", "safetensors")
#: "flattened_bucket": the pairs were sent as one flat bucket (the server unflattens them; ``FlatBucket``).
_TENSOR_LOAD_FORMATS = (None, "direct", "flattened_bucket")
_SELECTORS = ("all", "target")


class EngineError(Exception):
    """A control call the engine refused or could not complete.

    Unless the message says otherwise, the engine's state (weights, version, cache) is unchanged.
    """


@attrs.frozen(slots=True, kw_only=True)
class EngineHealth:
    """A snapshot of one engine's state (what ``/health`` + ``/server_info`` would tell)."""

    worker: str
    live: bool
    ready: bool  #: accepts and runs generation now (not paused, memory resident)
    paused: PauseMode | None
    weight_version: str
    num_running: int  #: admitted, unfinished requests (including parked and frozen ones)
    num_waiting: int  #: requests that arrived while paused and wait for ``resume``
    released: tuple[MemoryTag, ...]
    update_session: str | None  #: the open ``begin_weight_update`` selector, if any
    weight_groups: tuple[str, ...]
    requests_finished: int
    tokens_generated: int


class _PrefixIndex:
    """Page-granular prefix trie: how many prompt tokens a radix cache would have served."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._root: dict[tuple[int, ...], Any] = {}

    def clear(self) -> None:
        self._root = {}

    def match(self, tokens: Sequence[int]) -> int:
        # Like SGLang, the last prompt token is always computed (its logits pick the first token).
        limit = (len(tokens) - 1) // self.page_size
        node = self._root
        n = 0
        while n < limit:
            page = tuple(tokens[n * self.page_size : (n + 1) * self.page_size])
            child = node.get(page)
            if child is None:
                break
            node = child
            n += 1
        return n * self.page_size

    def insert(self, tokens: Sequence[int]) -> None:
        node = self._root
        for i in range(len(tokens) // self.page_size):
            page = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
            node = node.setdefault(page, {})


@attrs.define(slots=True, eq=False)
class _Req:
    request: GenerateRequest
    future: asyncio.Future[Generation]
    t0: float
    admitted: bool
    output_ids: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    #: Per output token, the ``sampling.top_logprobs`` most likely ``(id, logprob)`` pairs.
    top_logprobs: list[tuple[tuple[int, float], ...]] = attrs.field(factory=list)
    #: ``input_ids[prompt_logprobs_start:]``'s logprobs, from the first prefill (kept over a RETRACT).
    prompt_logprobs: tuple[float | None, ...] | None = None
    #: SGLang's stop-string check for this request (None: no stop strings).
    stop_strings: StopStrings | None = None
    cache: Any = None  #: KV cache; None = not computed yet, or dropped by a RETRACT pause
    generator: Any = None
    counts: Any = None  #: output-token counts (only when a penalty needs them)
    cached_tokens: int | None = None
    finished: bool = False
    #: The label installed when the request arrived (``Generation.version_at_start``).
    version_at_start: str = ""
    #: Runs of ``(first output index, version)``: the label installed when each token's forward ran.
    spans: list[tuple[int, str]] = attrs.field(factory=list)
    #: Set after each step that delivered a token and when the request ends (streams only).
    progress: asyncio.Event | None = None

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling


class ReferenceEngine:
    """One CPU engine (one "worker"). Async methods must be called from one event loop at a time.

    The engine binds to the running loop on first use; once idle it may be used from another
    loop (e.g. a new pytest-asyncio loop per test).
    """

    #: What its servers report as SGLang's ``enable_memory_saver`` (``ENABLE_MEMORY_SAVER``).
    enable_memory_saver = ENABLE_MEMORY_SAVER

    def __init__(
        self,
        model_path: str | Path,
        *,
        worker_id: str = "ref-0",
        page_size: int = 16,
        weight_version: str = "default",
        num_threads: int = 1,
        dist_timeout_s: float = 300.0,
        attn_implementation: str = "eager",
        filtered_logprobs: bool = False,
    ) -> None:
        import torch
        from transformers import AutoConfig, Qwen2ForCausalLM

        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if not weight_version:
            raise ValueError("weight_version must be a non-empty string")
        self._path = Path(model_path)
        self._worker_id = worker_id
        self._num_threads = num_threads
        #: A sampled token's logprobs are renormalised over the tokens the filters kept (vLLM's
        #: ``processed_logprobs``; ``Capabilities.filtered_logprobs``), for the CPU stand-in of vLLM.
        self._filtered_logprobs = filtered_logprobs
        self._dist_timeout_s = dist_timeout_s
        self._config = AutoConfig.from_pretrained(str(self._path))
        self._vocab_size = int(self._config.vocab_size)
        self._max_context = int(self._config.max_position_embeddings)
        self._eos = self._read_eos_ids()
        #: For stop strings (SGLang matches them on decoded text): the model's tokenizer.json, if any.
        self._tokenizer = self._read_tokenizer()
        # The dtype the weights are *stored* in (what a bf16 engine keeps); compute is float32.
        stored = getattr(self._config, "dtype", None) or getattr(self._config, "torch_dtype", None)
        self._store_dtype = torch_dtype(str(stored)) if stored is not None else torch.float32
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"refengine-{worker_id}", initializer=self._init_worker_thread
        )
        self._model = self._executor.submit(self._build_model, Qwen2ForCausalLM, attn_implementation).result()
        self._params: dict[str, Any] = dict(self._model.named_parameters())
        self._tied = bool(getattr(self._config, "tie_word_embeddings", False))
        if self._tied and "lm_head.weight" in self._params:  # pragma: no cover - a transformers regression
            raise RuntimeError("tie_word_embeddings is set but lm_head is not tied to the embedding")
        self._cache_kw = "cache" if "cache" in inspect.signature(self._model.forward).parameters else "past_key_values"
        initial = self._read_checkpoint(self._path, None)
        self._executor.submit(self._install, self._prepare(initial, require_all=True)).result()

        self._version = weight_version
        self._index = _PrefixIndex(page_size)
        self._page_size = page_size
        self._paused: PauseMode | None = None
        self._released: set[MemoryTag] = set()
        self._weights_backup: dict[str, Any] | None = None
        self._session: str | None = None
        self._groups: dict[str, GlooGroup] = {}
        self._reqs: dict[str, _Req] = {}
        self._queue: deque[_Req] = deque()
        self._finished_count = 0
        self._token_count = 0
        self._closed = False
        self._seed_rng = random.SystemRandom()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._scheduler: asyncio.Task[None] | None = None

    # -- properties -------------------------------------------------------------------------

    @property
    def worker_id(self) -> str:
        return self._worker_id

    @property
    def model_path(self) -> Path:
        """The checkpoint the engine started from, or the last one loaded from disk."""
        return self._path

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def has_tokenizer(self) -> bool:
        """The model has a ``tokenizer.json``: stop strings are matched and ``Generation.text`` set."""
        return self._tokenizer is not None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def weight_version(self) -> str:
        return self._version

    @property
    def paused(self) -> PauseMode | None:
        return self._paused

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The requests this engine holds (admitted, parked or waiting), by id."""
        return tuple(self._reqs)

    @property
    def num_running(self) -> int:
        """Admitted, unfinished requests (parked and frozen ones included)."""
        return sum(1 for r in self._reqs.values() if r.admitted)

    @property
    def num_waiting(self) -> int:
        """Requests that arrived while paused and have not been admitted yet."""
        return sum(1 for r in self._reqs.values() if not r.admitted)

    # -- set-up helpers ---------------------------------------------------------------------

    def _init_worker_thread(self) -> None:
        import torch

        torch.set_num_threads(self._num_threads)

    def _build_model(self, cls: Any, attn_implementation: str) -> Any:
        import torch

        # Skip the random init (slow for 0.5B): every weight is overwritten from the checkpoint.
        try:
            no_init: Any = importlib.import_module("transformers.initialization").no_init_weights
        except (ImportError, AttributeError):  # transformers 4.x
            no_init = importlib.import_module("transformers.modeling_utils").no_init_weights
        with no_init():
            model = cls._from_config(self._config, dtype=torch.float32, attn_implementation=attn_implementation)
        model.tie_weights()  # skipped init also skips tying on some versions
        model.eval()
        model.requires_grad_(False)
        return model

    def _read_tokenizer(self) -> Any:
        path = self._path / "tokenizer.json"
        if not path.is_file():
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))

    def _decode(self, ids: Sequence[int]) -> str:
        # HF's decode default (what SGLang's stop check calls): special tokens kept.
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    def _read_eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []

        def add(value: Any) -> None:
            if isinstance(value, int):
                ids.append(value)
            elif isinstance(value, (list, tuple)):
                ids.extend(int(v) for v in value)

        add(getattr(self._config, "eos_token_id", None))
        gen = self._path / "generation_config.json"
        if gen.is_file():  # SGLang merges generation_config's EOS ids in as well
            add(json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id"))
        return tuple(dict.fromkeys(ids))

    # -- event-loop binding -----------------------------------------------------------------

    def _bind(self) -> asyncio.AbstractEventLoop:
        if self._closed:
            raise EngineError(f"{self._worker_id}: engine is closed")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed() and self._reqs:
                raise EngineError(f"{self._worker_id}: engine has requests on another event loop")
            self._loop = loop
            self._lock = asyncio.Lock()
            self._wake = asyncio.Event()
            self._scheduler = None
        return loop

    @property
    def _step_lock(self) -> asyncio.Lock:
        assert self._lock is not None
        return self._lock

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()
        if self._scheduler is None or self._scheduler.done():
            self._scheduler = asyncio.get_running_loop().create_task(
                self._schedule(), name=f"refengine-{self._worker_id}-scheduler"
            )
            self._scheduler.add_done_callback(self._scheduler_done)

    def _scheduler_done(self, task: asyncio.Task[None]) -> None:
        # The loop only ends on close; if it died of a bug, fail every request instead of hanging.
        if task.cancelled() or task.exception() is None:
            return
        exc = EngineError(f"{self._worker_id}: scheduler crashed: {task.exception()!r}")
        for req in list(self._reqs.values()):
            self._fail(req, exc)

    # -- generation -------------------------------------------------------------------------

    def _validate(self, request: GenerateRequest) -> None:
        if not isinstance(request, GenerateRequest):
            raise InvalidRequest("request", f"must be a GenerateRequest, got {type(request).__name__}")
        for i, t in enumerate(request.input_ids):
            if t >= self._vocab_size:
                raise InvalidRequest(f"input_ids[{i}]", f"token id {t} is out of vocabulary (size {self._vocab_size})")
        if len(request.input_ids) >= self._max_context:
            raise InvalidRequest(
                "input_ids",
                f"prompt has {len(request.input_ids)} tokens; the context is {self._max_context} "
                "and at least one token must be generated",
            )
        for i, t in enumerate(request.sampling.stop_token_ids):
            if t >= self._vocab_size:
                raise InvalidRequest(
                    f"sampling.stop_token_ids[{i}]", f"token id {t} is out of vocabulary (size {self._vocab_size})"
                )
        if request.request_id in self._reqs:
            raise InvalidRequest("request_id", f"{request.request_id!r} is already in flight on {self._worker_id}")
        if request.sampling.stop and self._tokenizer is None:
            raise InvalidRequest("sampling.stop", f"stop strings need a tokenizer; {self._path} has no tokenizer.json")

    async def generate(self, request: GenerateRequest) -> Generation:
        """Generate for one request. Waits (does not fail) while the engine is paused.

        An aborted request is *returned* with ``FinishReason.ABORT`` and its partial output.
        Cancelling the calling task aborts the request.
        """
        req = self._submit(request)
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            self._abort_req(req)
            raise

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """``generate``, step by step: a chunk with the tokens the scheduler delivered since the
        last one (one per turn), the last chunk with the ``Generation``. Closing the generator, or
        cancelling the task iterating it, aborts the request (a token in a step then running is
        dropped, as for ``abort``)."""
        req = self._submit(request, streamed=True)
        assert req.progress is not None
        sent = 0
        try:
            while not req.future.done():
                await req.progress.wait()
                req.progress.clear()
                n = len(req.output_ids)
                if n > sent and not req.future.done():
                    lps = tuple(req.logprobs[sent:n]) if request.return_logprobs else None
                    want_top = request.return_logprobs and request.sampling.top_logprobs
                    yield TokenChunk(
                        request_id=request.request_id,
                        index=sent,
                        output_ids=tuple(req.output_ids[sent:n]),
                        logprobs=lps,
                        top_logprobs=tuple(req.top_logprobs[sent:n]) if want_top else None,
                        weight_version=self._version,  # as SGLang stamps an event: the version now
                    )
                    sent = n
            yield TokenChunk.closing(req.future.result(), sent)
        finally:
            if not req.finished:
                self._abort_req(req)

    def _submit(self, request: GenerateRequest, *, streamed: bool = False) -> _Req:
        """Admit a request (or park it while paused) and wake the scheduler."""
        import torch

        loop = self._bind()
        self._validate(request)
        sp = request.sampling
        req = _Req(
            request=request,
            future=loop.create_future(),
            t0=time.monotonic(),
            admitted=self._paused is None,
            version_at_start=self._version,
            progress=asyncio.Event() if streamed else None,
        )
        if sp.stop:
            req.stop_strings = StopStrings.of(
                sp.stop, lambda st: len(self._tokenizer.encode(st, add_special_tokens=False).ids)
            )
        if not sp.greedy:
            seed = sp.seed if sp.seed is not None else self._seed_rng.randrange(2**63)
            req.generator = torch.Generator().manual_seed(seed)
        if sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0:
            req.counts = torch.zeros(self._vocab_size, dtype=torch.float32)
        self._reqs[request.request_id] = req
        if req.admitted:
            self._queue.append(req)
        self._kick()
        return req

    def _runnable(self) -> bool:
        return self._paused is None and not (self._released & {MemoryTag.WEIGHTS, MemoryTag.KV_CACHE})

    async def _schedule(self) -> None:
        """Round-robin over admitted requests, one token per turn, one forward at a time."""
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while not self._closed:
            if not self._queue or not self._runnable():
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._step_lock:
                if not self._queue or not self._runnable():
                    continue
                req = self._queue.popleft()
                if req.finished:
                    continue
                if req.cached_tokens is None:
                    req.cached_tokens = self._index.match(req.request.input_ids)
                    self._index.insert(req.request.input_ids)
                # Loads take the step lock, so these are the weights this step runs with; the label
                # is read before it (a relabel during the forward counts from the next token).
                version = self._version
                try:
                    token, logprob, top = await loop.run_in_executor(self._executor, self._step, req)
                except Exception as exc:  # a bug or a broken weight set: fail this request, keep serving
                    self._fail(req, EngineError(f"{self._worker_id}: forward failed: {type(exc).__name__}: {exc}"))
                    continue
                self._apply(req, token, logprob, top, version)

    def _step(self, req: _Req) -> tuple[int, float, tuple[tuple[int, float], ...] | None]:
        """Worker thread: run the forward for the tokens not in the cache, pick the next token."""
        import torch
        from transformers import DynamicCache

        if torch.get_num_threads() != self._num_threads:
            torch.set_num_threads(self._num_threads)
        # A local reference: an abort may drop ``req.cache`` from the loop thread meanwhile.
        cache = req.cache
        if cache is None:  # first step, or recompute after a RETRACT pause
            ids = list(req.request.input_ids) + req.output_ids
            cache = req.cache = DynamicCache(config=self._config)
        else:
            ids = [req.output_ids[-1]]
        start = req.request.prompt_logprobs_start
        with torch.inference_mode():
            if start is not None and req.prompt_logprobs is None and not req.output_ids:
                # Prompt logprobs: a forward of its own (no cache), so that the generation's own
                # numbers are those of a request without them, bit for bit. SGLang's shape:
                # input_ids[start:], the first entry None; unscaled log_softmax.
                scoring = self._model(
                    input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False, logits_to_keep=len(ids) - start
                )
                rows = scoring.logits[0, :-1].to(torch.float32)
                scored = torch.tensor(ids[start + 1 :], dtype=torch.long)
                lps = torch.log_softmax(rows, dim=-1).gather(1, scored[:, None])[:, 0]
                req.prompt_logprobs = (None, *(float(v) for v in lps.tolist()))
            if req.sampling.max_new_tokens == 0:  # re-scoring only: nothing is sampled
                req.cache = None
                return -1, 0.0, None
            out = self._model(
                input_ids=torch.tensor([ids], dtype=torch.long),
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kw: cache},
            )
            logits = out.logits[0, -1].to(torch.float32)
            return self._sample(req, logits)

    @staticmethod
    def _top(logprobs: Any, k: int) -> tuple[tuple[int, float], ...] | None:
        """The ``k`` most likely ``(id, logprob)`` pairs of one position (ties by id), or ``None``."""
        import torch

        if k <= 0:
            return None
        values, ids = torch.topk(logprobs, min(k, int(logprobs.numel())))
        pairs = [(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]
        return tuple(sorted(pairs, key=lambda p: (-p[1], p[0])))

    def _sample(self, req: _Req, logits: Any) -> tuple[int, float, tuple[tuple[int, float], ...] | None]:
        """SGLang's order: penalties → min_new_tokens mask → (temperature, filters, draw).

        The logprob is ``log_softmax`` of the very logits the token was chosen from (scaled by the
        temperature when sampling, not renormalised after top-k/top-p/min-p), like SGLang; so are
        the top logprobs (SGLang takes them from the same tensor). With ``filtered_logprobs`` they
        are renormalised over the tokens kept (the others ``-inf``), like vLLM's ``processed_logprobs``.
        """
        import torch

        sp = req.sampling
        logits = logits.clone()
        if req.counts is not None:
            seen = req.counts > 0
            if sp.repetition_penalty != 1.0:
                pen = torch.where(logits > 0, logits / sp.repetition_penalty, logits * sp.repetition_penalty)
                logits = torch.where(seen, pen, logits)
            logits -= sp.frequency_penalty * req.counts + sp.presence_penalty * seen.to(torch.float32)
        if len(req.output_ids) < sp.min_new_tokens:
            stops = [t for t in (*self._eos, *sp.stop_token_ids) if t < self._vocab_size]
            if stops:
                logits[stops] = -math.inf
        if sp.greedy:
            token = int(torch.argmax(logits))
            greedy_lps = torch.log_softmax(logits, dim=-1)
            return token, float(greedy_lps[token]), self._top(greedy_lps, sp.top_logprobs)
        scaled = logits / sp.temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        if sp.top_k > 0:
            keep[sp.top_k :] = False
        if sp.top_p < 1.0:
            keep &= (torch.cumsum(sorted_probs, 0) - sorted_probs) <= sp.top_p
        if sp.min_p > 0.0:
            keep &= sorted_probs >= sp.min_p * sorted_probs[0]
        keep[0] = True  # the most likely token always survives the filters
        if self._filtered_logprobs:
            kept_ids = torch.zeros_like(keep).scatter(0, order, keep)  # keep, in vocabulary order
            logprobs = torch.log_softmax(scaled.masked_fill(~kept_ids, -math.inf), dim=-1)
        kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        cdf = torch.cumsum(kept, 0)
        u = torch.rand((), generator=req.generator, dtype=torch.float64).item() * float(cdf[-1])
        pos = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True)[0])
        last = int(keep.nonzero()[-1])
        token = int(order[min(pos, last)])
        return token, float(logprobs[token]), self._top(logprobs, sp.top_logprobs)

    def _apply(
        self, req: _Req, token: int, logprob: float, top: tuple[tuple[int, float], ...] | None, version: str
    ) -> None:
        """Loop thread: record a step's token (and the version it came from); is the request done?"""
        if req.finished:  # aborted during the step: that token is not delivered
            req.cache = None
            return
        sp = req.sampling
        if sp.max_new_tokens == 0:
            self._finish(req, FinishReason.LENGTH)
            return
        if not req.spans or req.spans[-1][1] != version:
            req.spans.append((len(req.output_ids), version))
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        if top is not None:
            req.top_logprobs.append(top)
        self._token_count += 1
        if req.counts is not None:
            req.counts[token] += 1
        if req.progress is not None:
            req.progress.set()
        n = len(req.output_ids)
        # SGLang checks the length limit before stop strings, and stop strings before stop tokens
        # (schedule_batch.py update_finish_state, 0.5.16).
        matched_str = req.stop_strings.match(req.output_ids, self._decode) if req.stop_strings is not None else None
        if n >= sp.max_new_tokens or len(req.request.input_ids) + n >= self._max_context:
            self._finish(req, FinishReason.LENGTH)
        elif matched_str is not None:
            self._finish(req, FinishReason.STOP, matched=matched_str)
        elif not sp.ignore_eos and n >= sp.min_new_tokens and (token in self._eos or token in sp.stop_token_ids):
            self._finish(req, FinishReason.STOP, matched=token)
        else:
            self._queue.append(req)

    def _text(self, req: _Req, matched: int | str | None) -> str | None:
        """SGLang's ``text`` for a request with stop strings (our client's options: special tokens
        kept): cut before the matched string's first occurrence, after it with ``no_stop_trim``."""
        if not req.sampling.stop or self._tokenizer is None:
            return None
        full = self._decode(req.output_ids)
        if isinstance(matched, str):
            return trim_at_stop(full, matched, no_stop_trim=req.sampling.no_stop_trim)
        if isinstance(matched, int) and not req.sampling.no_stop_trim and req.output_ids:
            return self._decode(req.output_ids[:-1])  # a stop token: trimmed from the text
        return full

    def _finish(self, req: _Req, reason: FinishReason, matched: int | str | None = None) -> None:
        if req.finished:
            return
        req.finished = True
        req.cache = None
        self._reqs.pop(req.request.request_id, None)
        if reason is not FinishReason.ABORT:
            # What a radix cache would now hold: every token whose KV was computed.
            self._index.insert(list(req.request.input_ids) + req.output_ids[:-1])
        self._finished_count += 1
        gen = Generation(
            request_id=req.request.request_id,
            output_ids=tuple(req.output_ids),
            logprobs=tuple(req.logprobs) if req.request.return_logprobs else None,
            finish_reason=reason,
            weight_version=self._version,
            prompt_tokens=len(req.request.input_ids),
            cached_tokens=req.cached_tokens or 0,
            worker=self._worker_id,
            latency_s=time.monotonic() - req.t0,
            matched_stop=matched,
            top_logprobs=tuple(req.top_logprobs)
            if req.request.return_logprobs and req.request.sampling.top_logprobs
            else None,
            prompt_logprobs=req.prompt_logprobs if req.request.return_logprobs else None,
            version_at_start=req.version_at_start,
            version_spans=tuple(req.spans),
            text=self._text(req, matched) if reason is not FinishReason.ABORT else None,
        )
        if not req.future.done():
            req.future.set_result(gen)
        if req.progress is not None:
            req.progress.set()

    def _fail(self, req: _Req, exc: BaseException) -> None:
        req.finished = True
        req.cache = None
        self._reqs.pop(req.request.request_id, None)
        if not req.future.done():
            req.future.set_exception(exc)
        if req.progress is not None:
            req.progress.set()

    def _abort_req(self, req: _Req) -> None:
        # Finish now, even mid-step: the step's token is then discarded by ``_apply``.
        self._finish(req, FinishReason.ABORT)

    # -- abort / pause ----------------------------------------------------------------------

    async def abort(self, request_id: str) -> bool:
        """Abort one request (running, parked or waiting); ``False`` if the id is unknown."""
        self._bind()
        req = self._reqs.get(request_id)
        if req is None:
            return False
        self._abort_req(req)
        return True

    async def abort_all(self) -> int:
        """Abort every request, waiting ones included; returns how many."""
        self._bind()
        reqs = list(self._reqs.values())
        for req in reqs:
            self._abort_req(req)
        return len(reqs)

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        """Stop generation after the current step (SGLang's ``/pause_generation``).

        ABORT: in-flight requests end now with ABORT. RETRACT: they are parked, their KV dropped,
        and recomputed from prompt + generated tokens after ``resume`` (with whatever weights are
        loaded then). IN_PLACE: they are frozen with their KV; ``flush_cache`` then fails.
        Pausing an already paused engine applies the new mode to the requests it holds.
        """
        self._bind()
        mode = PauseMode(mode)
        async with self._step_lock:
            self._paused = mode
            admitted = [r for r in self._reqs.values() if r.admitted]
            if mode is PauseMode.ABORT:
                for req in admitted:
                    self._finish(req, FinishReason.ABORT)
            elif mode is PauseMode.RETRACT:
                for req in admitted:
                    req.cache = None

    async def resume(self) -> None:
        """Continue generation; requests that arrived while paused are admitted. Idempotent."""
        self._bind()
        async with self._step_lock:
            self._paused = None
            for req in self._reqs.values():
                if not req.admitted:
                    req.admitted = True
                    self._queue.append(req)
            if self._reqs:
                self._kick()

    # -- cache ------------------------------------------------------------------------------

    def _flush_refusal(self) -> str | None:
        if self._paused is None and self._reqs:
            return f"{len(self._reqs)} request(s) are running or queued; pause first"
        if self._paused is PauseMode.IN_PLACE:
            holding = sum(1 for r in self._reqs.values() if r.cache is not None)
            if holding:
                return f"paused in_place and {holding} request(s) hold KV cache"
        return None

    async def flush_cache(self, wait_s: float = 0.0) -> None:
        """Clear the prefix index. Refused while requests run unpaused or hold KV (IN_PLACE),
        after waiting up to ``wait_s`` for that to end, as SGLang's deferred flush does."""
        self._bind()
        deadline = time.monotonic() + wait_s
        while True:
            async with self._step_lock:
                why = self._flush_refusal()
                if why is None:
                    self._index.clear()
                    return
            if time.monotonic() >= deadline:
                raise EngineError(f"{self._worker_id}: cannot flush cache: {why}")
            await asyncio.sleep(min(0.02, max(0.0, deadline - time.monotonic())))

    # -- weights ----------------------------------------------------------------------------

    def _read_checkpoint(self, path: Path, load_format: str | None) -> list[tuple[str, Any]]:
        from safetensors.torch import load_file

        if load_format not in _LOAD_FORMATS:
            raise EngineError(f"{self._worker_id}: unknown load_format {load_format!r} (known: {list(_LOAD_FORMATS)})")
        if not path.is_dir():
            raise EngineError(f"{self._worker_id}: {str(path)!r} is not a checkpoint directory")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise EngineError(f"{self._worker_id}: no *.safetensors files in {str(path)!r}")
        out: list[tuple[str, Any]] = []
        for f in files:
            try:
                out.extend(load_file(str(f)).items())
            except Exception as exc:
                raise EngineError(f"{self._worker_id}: cannot read {f.name}: {exc}") from exc
        return out

    def _prepare(self, named: Iterable[tuple[str, Any]], *, require_all: bool) -> list[tuple[Any, Any]]:
        """Validate names, shapes and dtypes of *all* tensors before anything is changed.

        Values are rounded to the stored dtype (a bf16 engine keeps bf16 weights) and upcast to
        float32, so a tensor update with float32 values serves what SGLang would serve.
        """
        import torch

        prepared: list[tuple[Any, Any]] = []
        seen: set[str] = set()
        for item in named:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise EngineError(f"{self._worker_id}: weights must be (name, tensor) pairs")
            name, tensor = item
            if not isinstance(tensor, torch.Tensor):
                raise EngineError(f"{self._worker_id}: {name!r} is a {type(tensor).__name__}, not a tensor")
            if name in seen:
                raise EngineError(f"{self._worker_id}: tensor {name!r} given twice")
            seen.add(name)
            if name == "lm_head.weight" and self._tied:
                target = self._params["model.embed_tokens.weight"]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise EngineError(
                        f"{self._worker_id}: shape mismatch for {name!r}: got {tuple(tensor.shape)}, "
                        f"expected {tuple(target.shape)}"
                    )
                continue  # tied to the embedding; SGLang skips it too
            param = self._params.get(name)
            if param is None:
                known = ", ".join(sorted(self._params)[:4])
                raise EngineError(f"{self._worker_id}: unknown weight {name!r} (e.g. {known}, ...)")
            if tuple(tensor.shape) != tuple(param.shape):
                raise EngineError(
                    f"{self._worker_id}: shape mismatch for {name!r}: got {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            if not tensor.is_floating_point():
                raise EngineError(f"{self._worker_id}: {name!r} has non-float dtype {tensor.dtype}")
            value = tensor.detach().to("cpu").to(self._store_dtype).to(torch.float32).contiguous()
            prepared.append((param, value))
        if require_all:
            missing = sorted(set(self._params) - seen)
            if missing:
                raise EngineError(
                    f"{self._worker_id}: checkpoint lacks {len(missing)} weight(s): {', '.join(missing[:4])}"
                )
        return prepared

    def _install(self, prepared: list[tuple[Any, Any]]) -> None:
        import torch

        with torch.no_grad():
            for param, value in prepared:
                param.copy_(value)

    def _check_can_update(self, flush_cache: bool) -> None:
        if MemoryTag.WEIGHTS in self._released:
            raise EngineError(f"{self._worker_id}: weights are released; call resume_memory first")
        if flush_cache:
            why = self._flush_refusal()
            if why is not None:
                raise EngineError(
                    f"{self._worker_id}: weights not updated: flush_cache=True but the cache cannot be "
                    f"flushed ({why}); pause first or pass flush_cache=False"
                )

    async def _load(self, prepared: list[tuple[Any, Any]], version: str | None, flush_cache: bool) -> None:
        """Install validated weights between two forward steps; then flush and relabel."""
        if version is not None and not (isinstance(version, str) and version):
            raise EngineError(f"{self._worker_id}: version must be a non-empty string")
        async with self._step_lock:
            self._check_can_update(flush_cache)
            await asyncio.get_running_loop().run_in_executor(self._executor, self._install, prepared)
            if flush_cache:
                self._index.clear()
            if version is not None:
                self._version = version

    async def update_weights_from_disk(
        self,
        path: str | Path,
        *,
        load_format: str | None = None,
        version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """Load a full safetensors checkpoint directory; on any mismatch the old weights stay.

        Unlike SGLang 0.5.23 (which updates, then fails to flush), an impossible flush is detected
        *before* loading, so a refused call changes nothing.
        """
        self._bind()
        self._check_can_update(flush_cache)
        p = Path(path)
        loop = asyncio.get_running_loop()
        named = await loop.run_in_executor(None, self._read_checkpoint, p, load_format)
        prepared = await loop.run_in_executor(None, lambda: self._prepare(named, require_all=True))
        await self._load(prepared, version, flush_cache)
        self._path = p

    async def update_weights_from_tensors(
        self,
        named_tensors: Sequence[tuple[str, Any]],
        *,
        version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> None:
        """Load in-memory tensors (any subset of the weights). All are validated first."""
        self._bind()
        if load_format not in _TENSOR_LOAD_FORMATS:
            raise EngineError(
                f"{self._worker_id}: unknown load_format {load_format!r} (known: {list(_TENSOR_LOAD_FORMATS)})"
            )
        self._check_can_update(flush_cache)
        named = list(named_tensors)
        prepared = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._prepare(named, require_all=False)
        )
        await self._load(prepared, version, flush_cache)

    async def init_weight_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        """Join a private gloo group as rank ``rank_offset``; blocks (off-loop) until rank 0 joins."""
        self._bind()
        if backend != "gloo":
            raise EngineError(f"{self._worker_id}: a CPU engine needs backend='gloo', got {backend!r}")
        if group_name in self._groups:
            raise EngineError(f"{self._worker_id}: weight group {group_name!r} already exists")
        if not 1 <= rank_offset < world_size:
            raise EngineError(f"{self._worker_id}: rank {rank_offset} is not in [1, {world_size})")
        try:
            group = await asyncio.to_thread(
                open_gloo_group,
                master_address,
                master_port,
                rank_offset,
                world_size,
                group_name,
                timeout_s=self._dist_timeout_s,
            )
        except Exception as exc:
            raise EngineError(f"{self._worker_id}: init_weight_group failed: {type(exc).__name__}: {exc}") from exc
        self._groups[group_name] = group

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> None:
        """Receive tensors by broadcast from rank 0 in list order, then validate and load them.

        Everything is received before validation, so a refused update still consumes the
        sender's broadcasts and the group stays usable.
        """
        import torch

        self._bind()
        group = self._groups.get(group_name)
        if group is None:
            raise EngineError(f"{self._worker_id}: no weight group {group_name!r}; call init_weight_group")
        if load_format is not None:
            raise EngineError(f"{self._worker_id}: unknown load_format {load_format!r} (known: [None])")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise EngineError(
                f"{self._worker_id}: names/dtypes/shapes lengths differ ({len(names)}/{len(dtypes)}/{len(shapes)})"
            )
        try:
            buffers = [
                torch.empty(tuple(int(d) for d in shape), dtype=torch_dtype(str(dt)))
                for dt, shape in zip(dtypes, shapes, strict=True)
            ]
        except (ValueError, TypeError) as exc:
            raise EngineError(f"{self._worker_id}: bad bucket metadata: {exc}") from exc

        def receive() -> None:
            for buf in buffers:
                group.broadcast(buf, src=0)

        try:
            await asyncio.to_thread(receive)
        except Exception as exc:
            raise EngineError(f"{self._worker_id}: broadcast receive failed: {type(exc).__name__}: {exc}") from exc
        self._check_can_update(flush_cache)
        prepared = self._prepare(list(zip(names, buffers, strict=True)), require_all=False)
        await self._load(prepared, version, flush_cache)

    async def destroy_weight_group(self, group_name: str = "weight_update_group") -> None:
        """Leave the group. Idempotent: an unknown name is not an error."""
        self._bind()
        group = self._groups.pop(group_name, None)
        if group is not None:
            await asyncio.to_thread(group.close)

    async def begin_weight_update(self, selector: str = "all") -> None:
        """Open an update session (bookkeeping only: updates also work without one).

        Re-opening is allowed so that a transaction that failed half-way never wedges the engine.
        """
        self._bind()
        if selector not in _SELECTORS:
            raise EngineError(f"{self._worker_id}: unknown selector {selector!r} (known: {list(_SELECTORS)})")
        self._session = selector

    async def end_weight_update(self) -> None:
        """Close the update session; a no-op when none is open."""
        self._bind()
        self._session = None

    async def set_weight_version(self, version: str) -> None:
        """Relabel the served weights; never aborts anything."""
        self._bind()
        if not isinstance(version, str) or not version:
            raise EngineError(f"{self._worker_id}: version must be a non-empty string")
        self._version = version

    # -- memory -----------------------------------------------------------------------------

    def _tags(self, tags: Sequence[MemoryTag | str] | None) -> set[MemoryTag]:
        if tags is None:
            return set(MemoryTag)
        out: set[MemoryTag] = set()
        for t in tags:
            try:
                out.add(MemoryTag(t))
            except ValueError:
                raise EngineError(f"{self._worker_id}: unknown memory tag {t!r}") from None
        return out

    async def release_memory(self, tags: Sequence[MemoryTag | str] | None = None) -> None:
        """Really free the weights' storage (a CPU backup is kept) and/or all KV caches.

        Only while paused or idle, like SGLang (which asserts an idle scheduler). While released,
        requests wait as if paused. Releasing the KV cache flushes the prefix index; it is refused
        while IN_PLACE-frozen requests hold KV. Releasing twice is a no-op.
        """
        import torch

        self._bind()
        wanted = self._tags(tags)
        async with self._step_lock:
            if self._paused is None and self._reqs:
                raise EngineError(f"{self._worker_id}: cannot release memory with {len(self._reqs)} request(s) running")
            if MemoryTag.KV_CACHE in wanted and self._paused is PauseMode.IN_PLACE:
                why = self._flush_refusal()
                if why is not None:
                    raise EngineError(f"{self._worker_id}: cannot release kv_cache: {why}")
            if MemoryTag.WEIGHTS in wanted and MemoryTag.WEIGHTS not in self._released:
                self._weights_backup = {n: p.detach().to(self._store_dtype).clone() for n, p in self._params.items()}
                for p in self._params.values():
                    p.data = torch.empty(0, dtype=torch.float32)
            if MemoryTag.KV_CACHE in wanted:
                for req in self._reqs.values():
                    req.cache = None
                self._index.clear()
            self._released |= wanted

    async def resume_memory(self, tags: Sequence[MemoryTag | str] | None = None) -> None:
        """Take back what ``release_memory`` freed (weights from the CPU backup). Idempotent."""
        import torch

        self._bind()
        wanted = self._tags(tags)
        async with self._step_lock:
            if MemoryTag.WEIGHTS in wanted and self._weights_backup is not None:
                for name, p in self._params.items():
                    p.data = self._weights_backup[name].to(torch.float32)
                self._weights_backup = None
            self._released -= wanted
            if self._reqs:
                self._kick()

    # -- health / lifecycle -----------------------------------------------------------------

    def health(self) -> EngineHealth:
        """A snapshot of the engine's state (synchronous: it never waits for a step)."""
        task = self._scheduler
        crashed = task is not None and task.done() and not task.cancelled() and task.exception() is not None
        live = not self._closed and not crashed
        return EngineHealth(
            worker=self._worker_id,
            live=live,
            ready=live and self._runnable(),
            paused=self._paused,
            weight_version=self._version,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            released=tuple(sorted(self._released, key=lambda t: t.value)),
            update_session=self._session,
            weight_groups=tuple(sorted(self._groups)),
            requests_finished=self._finished_count,
            tokens_generated=self._token_count,
        )

    def weight_checksum(self) -> str:
        """SHA-256 over the served weights (names sorted), like SGLang's ``weights_checker``."""
        import hashlib

        if MemoryTag.WEIGHTS in self._released:
            raise EngineError(f"{self._worker_id}: weights are released")
        h = hashlib.sha256()
        for name in sorted(self._params):
            h.update(name.encode())
            h.update(self._params[name].detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    async def aclose(self) -> None:
        """Abort everything, leave weight groups, stop the worker thread. Idempotent."""
        if self._closed:
            return
        if self._loop is asyncio.get_running_loop():
            for req in list(self._reqs.values()):
                self._abort_req(req)
        self._closed = True
        if self._wake is not None:
            self._wake.set()
        for name in list(self._groups):
            await asyncio.to_thread(self._groups.pop(name).close)
        self._executor.shutdown(wait=False)

    def close(self) -> None:
        """Synchronous close for use outside an event loop (pending requests are dropped)."""
        self._closed = True
        for group in self._groups.values():
            group.close()
        self._groups.clear()
        self._executor.shutdown(wait=False)

    def __repr__(self) -> str:
        return f"<ReferenceEngine {self._worker_id} version={self._version!r} paused={self._paused}>"
