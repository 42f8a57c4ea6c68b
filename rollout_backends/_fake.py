"""In-memory fake engines for unit tests: a ``Fleet`` of ``FakeDriver``s, no servers, no torch.

The "model" is a hash: the logits for the next token are drawn from ``Random((seed, last
tokens))``, where ``seed`` stands for the weights (a checkpoint is a directory holding
``weights.json`` with ``{"seed": N}``; ``update_weights_from_tensors`` takes ``[("seed", N)]``).
A checkpoint may also name a vocabulary permutation (``"perm": [[i, j], ...]``, token ``i`` of
the model is token ``j`` of the seed's hash), the fake's version of a checkpoint whose embedding
rows were permuted (``permute_checkpoint``). Each token takes ``token_delay`` seconds, so
requests can be caught in flight. The fake keeps SGLang's control semantics where the protocol
states them: pause modes, a flush refused while requests are frozen in place, the prefix cache,
version labels, aborts that keep partial tokens; and its sampling parameters, in SGLang's order
(penalties on the tokens generated so far, the ``min_new_tokens`` mask of stop tokens, then
temperature, ``top_k``, ``top_p``, ``min_p`` and the draw). Its logprobs are unfiltered, as
SGLang's, unless its capabilities declare ``filtered_logprobs``: then a sampled token's are those
of the distribution it was drawn from (temperature-scaled, renormalised over the tokens the
filters kept; the others ``-9999``, vLLM's floor), as vLLM's ``processed_logprobs``.

It passes the conformance suite (``tests/conformance``), and the suite's fake with switchable bugs
subclasses ``FakeDriver`` to prove each check can fail. The ``_``-prefixed methods are the hooks
it overrides; they are not part of the public surface.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import random
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollout_backends._errors import (
    BackendUnavailable,
    ContractViolation,
    ControlFailed,
    InvalidRequest,
    Unsupported,
    WorkerFailure,
)
from rollout_backends._fleet import Fleet
from rollout_backends._ops import (
    AbortAll,
    AbortRequest,
    BeginWeightUpdate,
    Command,
    DestroyWeightGroup,
    EndWeightUpdate,
    FlushCache,
    InitWeightGroup,
    Live,
    Pause,
    Probe,
    Progress,
    Ready,
    ReleaseMemory,
    Resume,
    ResumeMemory,
    SetVersion,
    UpdateFromDisk,
    UpdateFromDistributed,
    UpdateFromTensors,
    unhandled,
)
from rollout_backends._types import (
    Capabilities,
    FinishReason,
    GenerateRequest,
    Generation,
    MemoryTag,
    PauseMode,
    SamplingParams,
    TokenChunk,
    WeightTransport,
)

__all__ = [
    "EOS",
    "FAKE_CAPABILITIES",
    "MAX_CONTEXT",
    "VOCAB_SIZE",
    "FakeDriver",
    "FakeFleet",
    "fake_factory",
    "fake_fleet",
    "load_checkpoint",
    "permute_checkpoint",
    "read_checkpoint",
    "write_checkpoint",
]

VOCAB_SIZE = 64
EOS = 0
MAX_CONTEXT = 256

#: What a fake declares unless told otherwise: every pause mode, disk and tensor loads.
FAKE_CAPABILITIES = Capabilities(
    pause_modes=[PauseMode.ABORT, PauseMode.RETRACT, PauseMode.IN_PLACE],
    weight_transports=[WeightTransport.DISK, WeightTransport.TENSOR],
    seeded_sampling=True,
    abort=True,
    batch_invariant=True,
    top_logprobs=20,
    prompt_logprobs=True,
    version_constraints=True,  # the Fleet's routing by label, as for every engine
    stop_strings=True,
    streaming=True,
    cached_tokens=True,  # a prefix index per worker (FakeDriver.generate)
    progress_probe=True,  # probe(Progress): not paused
    memory_release=True,  # FakeDriver.release_memory: the weights' memory holds other numbers until resumed
    vocab_size=VOCAB_SIZE,
    max_context=MAX_CONTEXT,
)


#: The fake's "tokenizer": token ``t`` is the one character ``_CHARS[t]``.
_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/"


def fake_text(ids: Sequence[int]) -> str:
    """The fake's text for token ids (one character each)."""
    return "".join(_CHARS[t % len(_CHARS)] for t in ids)


#: A vocabulary permutation: token ``i`` -> ``perm[i]`` (ids it does not name map to themselves).
Perm = dict[int, int]


def write_checkpoint(path: str | Path, seed: int, perm: Perm | None = None) -> str:
    """Write a fake checkpoint (the weights are ``seed``, conjugated by ``perm``) under ``path``;
    returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"seed": seed}
    if perm:
        data["perm"] = sorted([i, j] for i, j in perm.items() if i != j)
    (path / "weights.json").write_text(json.dumps(data))
    return str(path)


def _read_weights(path: str | Path) -> tuple[int, Perm]:
    try:
        data = json.loads((Path(path) / "weights.json").read_text())
        return int(data["seed"]), {int(i): int(j) for i, j in data.get("perm", ())}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest("path", f"cannot load fake checkpoint {path}: {exc}") from exc


def read_checkpoint(path: str | Path) -> int:
    """The seed of a fake checkpoint (``InvalidRequest`` naming ``path`` if there is none)."""
    return _read_weights(path)[0]


def load_checkpoint(path: str | Path) -> list[tuple[str, Any]]:
    """A fake checkpoint as the named tensors ``update_weights_from_tensors`` takes."""
    seed, perm = _read_weights(path)
    return [("seed", seed), *([("perm", sorted(perm.items()))] if perm else [])]


def permute_checkpoint(src: str, dst: str, pairs: Sequence[tuple[int, int]]) -> None:
    """``Harness.permute_vocabulary`` for fake checkpoints: ``dst`` holds ``src``'s weights with
    each pair of token ids swapped (the model on ``dst`` answers ``swap(x)`` with ``swap`` of what
    ``src`` answers to ``x``)."""
    seed, perm = _read_weights(src)
    swap: Perm = {}
    for a, b in pairs:
        swap[a], swap[b] = b, a
    # Token i of the new model is token swap[i] of the old one, which is perm[swap[i]] of the hash.
    keys = set(perm) | set(swap)
    write_checkpoint(dst, seed, {i: perm.get(swap.get(i, i), swap.get(i, i)) for i in keys})


def _logprobs(seed: int, prompt_seed: object, seq: Sequence[int]) -> list[float]:
    rng = random.Random(f"{seed}/{prompt_seed}/{tuple(seq[-3:])}/{len(seq) % 5}")
    logits = [rng.gauss(0.0, 3.0) for _ in range(VOCAB_SIZE)]
    logits[EOS] -= 4.0  # keep natural stops rare but possible
    return _normalised(logits)


def _normalised(logits: Sequence[float]) -> list[float]:
    m = max(logits)
    z = m + math.log(sum(math.exp(x - m) for x in logits if x != -math.inf))
    return [x - z for x in logits]


def _penalised(logits: Sequence[float], out: Sequence[int], sp: SamplingParams) -> list[float]:
    """SGLang's penalties on the tokens generated so far (not the prompt's): repetition (a logit
    divided by it where positive, multiplied where negative), then ``frequency * count +
    presence``, subtracted."""
    z = list(logits)
    for t, n in collections.Counter(out).items():
        x = z[t]
        if sp.repetition_penalty != 1.0:
            x = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
        z[t] = x - (sp.frequency_penalty * n + sp.presence_penalty)
    return z


def _filtered(logprobs: Sequence[float], sp: SamplingParams) -> tuple[list[int], list[float]]:
    """The tokens ``top_k``, ``top_p`` and ``min_p`` keep (SGLang's rules, on the temperature-scaled
    distribution; the most likely token always stays), and their weights."""
    weights = [math.exp(x / sp.temperature) for x in logprobs]
    total = sum(weights)
    probs = [w / total for w in weights]
    order = sorted(range(VOCAB_SIZE), key=lambda i: (-probs[i], i))
    kept, mass = [], 0.0
    for rank, i in enumerate(order):
        if rank and (
            (sp.top_k > 0 and rank >= sp.top_k)
            or (sp.top_p < 1.0 and mass > sp.top_p)
            or (sp.min_p > 0.0 and probs[i] < sp.min_p * probs[order[0]])
        ):
            break
        kept.append(i)
        mass += probs[i]
    return kept, [weights[i] for i in kept]


#: vLLM's floor for a logprob its answers carry (``-inf`` is not JSON): ``max(logprob, -9999.0)``.
_FLOOR = -9999.0


def _drawn_from(kept: Sequence[int], weights: Sequence[float]) -> list[float]:
    """The logprobs of the distribution a token was drawn from: ``weights`` over ``kept``,
    renormalised; every other token at ``_FLOOR``."""
    total = sum(weights)
    out = [_FLOOR] * VOCAB_SIZE
    for i, w in zip(kept, weights, strict=True):
        out[i] = max(math.log(w / total), _FLOOR) if w > 0 else _FLOOR
    return out


@attrs.define(eq=False)
class _Running:
    request: GenerateRequest
    aborted: bool = False
    out: list[int] = attrs.field(factory=list)
    lps: list[float] = attrs.field(factory=list)
    tops: list[tuple[tuple[int, float], ...]] = attrs.field(factory=list)
    prompt_lps: tuple[float | None, ...] | None = None
    matched: str | None = None
    finish: FinishReason = FinishReason.LENGTH
    cached: int = 0


class FakeDriver:
    """One fake engine: a ``Driver`` a ``Fleet`` runs like any other.

    Public state, for tests to read (and set): ``seed`` (the weights), ``version`` (the label it
    serves), ``paused``, ``ops`` (every command received, in order), ``requests`` (every request
    received), ``running`` (request ids in flight), ``live`` (set it ``False`` and the worker is
    down: it refuses every call and its probes fail, as a crashed engine's would).
    """

    def __init__(
        self,
        worker_id: str = "fake-0",
        *,
        seed: int = 1,
        version: str = "v0",
        capabilities: Capabilities = FAKE_CAPABILITIES,
        token_delay: float = 0.002,
    ) -> None:
        self._id = worker_id
        self._caps = capabilities
        self.token_delay = token_delay
        self.seed = seed
        #: The vocabulary permutation the weights are conjugated by (``permute_checkpoint``).
        self.perm: Perm = {}
        self.version = version
        self.paused: PauseMode | None = None
        #: Prefix -> the weights its KV was computed with (``weights_key``).
        self.cache: dict[tuple[int, ...], object] = {}
        self.ops: list[Command] = []
        self.requests: list[GenerateRequest] = []
        self.closed = False
        self.live = True
        self._running: dict[str, _Running] = {}
        #: What ``release_memory`` freed (SGLang's tags), and the weights to put back on resume.
        self.released: set[MemoryTag] = set()
        self._weights_backup: tuple[int, Perm] | None = None
        self._changed = asyncio.Event()
        self._failing: dict[type[Any], Exception] = {}
        #: Refuse weight loads unless paused (as dynamo.vllm does); by default what the
        #: capabilities declare (``load_needs_pause``): set it alone to plant the undeclared bug.
        self.loads_only_paused = capabilities.load_needs_pause

    # -- what a fleet reads -------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self._id

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def aborts_by_id(self) -> bool:
        return True

    @property
    def ranks(self) -> int:
        return 1

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(self._running)

    def fail_next(self, *op_types: type[Any], error: Exception | None = None) -> None:
        """Make the next command of one of ``op_types`` (e.g. ``UpdateFromDisk``) fail on this
        worker, once, with ``error`` (default: a ``ControlFailed`` naming it); ``fail_next()``
        with no types clears what is pending."""
        if not op_types:
            self._failing.clear()
        for t in op_types:
            self._failing[t] = error or ControlFailed(t.name, [WorkerFailure(self._id, t.name, "injected failure")])

    # -- generation ---------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> Generation:
        r = self._admit(request)
        try:
            return await self._run(r)
        finally:
            self._release(r)

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """``generate`` chunk by chunk: each token as soon as it is drawn, the last one with the
        ``Generation``. Closed early, the request is dropped (as SGLang aborts a request whose
        client went away)."""
        r = self._admit(request)
        steps = self._steps(r)
        sent = 0
        try:
            async for _ in steps:
                chunk = self._chunk(r, sent)
                sent = chunk.end
                yield chunk
            yield TokenChunk.closing(self._final(r), sent)
        finally:
            await self._end_stream(r, steps)

    def _admit(self, request: GenerateRequest) -> _Running:
        self.requests.append(request)
        if self.closed or not self.live:
            raise BackendUnavailable(f"{self._id}: down", worker=self._id)
        self._check(request)
        if request.request_id in self._running:  # SGLang's tokenizer manager refuses it so
            raise InvalidRequest("request_id", f"Duplicate request ID detected: {request.request_id!r}")
        r = _Running(request)
        self._running[request.request_id] = r
        return r

    def _release(self, r: _Running) -> None:
        if self._running.get(r.request.request_id) is r:
            del self._running[r.request.request_id]

    def _chunk(self, r: _Running, sent: int) -> TokenChunk:
        """The tokens drawn since ``sent`` (a stream hook)."""
        logprobs = tuple(r.lps[sent:]) if r.request.return_logprobs else None
        tops = tuple(r.tops[sent:]) if r.request.return_logprobs and r.request.sampling.top_logprobs else None
        return TokenChunk(
            request_id=r.request.request_id,
            index=sent,
            output_ids=tuple(r.out[sent:]),
            logprobs=logprobs,
            top_logprobs=tops,
        )

    def _final(self, r: _Running) -> Generation:
        """The Generation a stream ends with (a stream hook)."""
        return self._answer(r, r.finish, r.cached)

    async def _end_stream(self, r: _Running, steps: AsyncGenerator[None, None]) -> None:
        """A stream ended or was left: the request is dropped here (a stream hook)."""
        r.aborted = True
        await steps.aclose()
        self._release(r)

    def _check(self, request: GenerateRequest) -> None:
        for i, t in enumerate(request.input_ids):
            if t >= VOCAB_SIZE:
                raise InvalidRequest(f"input_ids[{i}]", f"{t} >= vocab {VOCAB_SIZE}")
        if len(request.input_ids) >= MAX_CONTEXT:
            raise InvalidRequest("input_ids", f"longer than the context ({MAX_CONTEXT})")

    async def _run(self, r: _Running) -> Generation:
        async for _ in self._steps(r):
            pass
        return self._answer(r, r.finish, r.cached)

    async def _steps(self, r: _Running) -> AsyncGenerator[None, None]:
        """Generate ``r``, yielding each time a token was drawn and more are to come (the last one
        is the answer's); ``r.finish`` and ``r.cached`` say how it ended."""
        sp = self._effective(r.request.sampling)
        prompt = r.request.input_ids
        await self._wait_resumed(r)
        if MemoryTag.KV_CACHE in self.released:  # a real engine has nowhere to put the request's KV
            raise ContractViolation("generated with its KV cache released", worker=self._id)
        cached = max((len(p) for p in self.cache if prompt[: len(p)] == p and len(p) < len(prompt)), default=0)
        prompt_key, r.cached = self._prefix(prompt, cached)
        for k in range(1, len(prompt) + 1):
            self.cache.setdefault(prompt[:k], self.weights_key)
        rng = self._rng(sp)
        limit = self._limit(sp)
        start = r.request.prompt_logprobs_start
        if start is not None and r.request.return_logprobs:
            # Each prompt token's logprob given the tokens before it (SGLang's shape: the first None).
            scored = range(start + 1, len(prompt))
            r.prompt_lps = (
                None,
                *(self._dist(prompt_key, self._scored_prefix(prompt, j))[prompt[j]] for j in scored),
            )
        r.finish = FinishReason.LENGTH
        while len(r.out) < limit:
            if r.out:
                yield  # the token drawn last is out: a stream delivers it now
            await asyncio.sleep(self.token_delay)
            await self._wait_resumed(r)
            if r.aborted:
                r.finish = FinishReason.ABORT
                break
            tok, lps = self._next_token(r, sp, self._dist(prompt_key, prompt + tuple(r.out)), rng)
            r.out.append(tok)
            r.lps.append(self._logprob(lps[tok]))
            if sp.top_logprobs:
                r.tops.append(tuple((i, lps[i]) for i in self._ranked(lps)[: sp.top_logprobs]))
            if len(r.out) >= limit:  # SGLang: the length limit before stop strings
                break
            r.matched = self._stop_string(r.out, sp)
            if r.matched is not None:
                r.finish = FinishReason.STOP
                break
            if self._stops(tok, sp):
                r.finish = FinishReason.STOP
                break

    def _next_token(
        self, r: _Running, sp: SamplingParams, logprobs: Sequence[float], rng: random.Random
    ) -> tuple[int, list[float]]:
        """The next token and the logprobs it was chosen from (SGLang's order: penalties, the
        ``min_new_tokens`` mask of stop tokens, then greedy or temperature + filters + draw)."""
        logits = _penalised(logprobs, r.out, sp)
        if len(r.out) < sp.min_new_tokens:
            for t in (EOS, *sp.stop_token_ids):
                logits[t] = -math.inf
        lps = _normalised(logits)
        if sp.temperature == 0.0:
            return self._greedy(r, lps), lps
        if sp.top_k == -1 and sp.top_p == 1.0 and sp.min_p == 0.0:
            kept: Sequence[int] = range(VOCAB_SIZE)
            weights = [math.exp(x / sp.temperature) for x in lps]
        else:
            kept, weights = _filtered(lps, sp)
        token = rng.choices(kept, weights)[0]
        return token, (_drawn_from(kept, weights) if self._filtered_logprobs() else lps)

    def _filtered_logprobs(self) -> bool:
        """A sampled token's logprobs are the distribution it was drawn from (``filtered_logprobs``)."""
        return self._caps.filtered_logprobs

    def _stop_string(self, out: Sequence[int], sampling: SamplingParams) -> str | None:
        """SGLang's check: the last (longest stop + 1) tokens' text; the first stop it contains."""
        if not sampling.stop:
            return None
        tail = fake_text(out[-(max(map(len, sampling.stop)) + 1) :])
        return next((st for st in sampling.stop if st in tail), None)

    async def _wait_resumed(self, r: _Running) -> None:
        """Hold a request while paused (an aborted one gets out)."""
        while self.paused is not None and not r.aborted:
            await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def weights_key(self) -> object:
        """What the loaded weights are: the seed, with the permutation where there is one."""
        return (self.seed, tuple(sorted(self.perm.items()))) if self.perm else self.seed

    def _dist(self, prompt_key: object, seq: Sequence[int]) -> list[float]:
        """The model's next-token logprobs after ``seq``, the prompt's KV computed with the weights
        ``prompt_key``: the seed's hash, conjugated by the permutation."""
        perm = self.perm
        fresh = prompt_key == self.weights_key
        hashed = _logprobs(self.seed, self.seed if fresh else prompt_key, [perm.get(t, t) for t in seq])
        return [hashed[perm.get(i, i)] for i in range(VOCAB_SIZE)] if perm else hashed

    def _prefix(self, prompt: tuple[int, ...], cached: int) -> tuple[object, int]:
        """The weights the prompt's KV stands for, and the cached tokens: KV computed with other
        weights is not reused."""
        if cached and self.cache[prompt[:cached]] != self.weights_key:
            cached = 0
        return self.weights_key, cached

    def _effective(self, sampling: SamplingParams) -> SamplingParams:
        """The sampling parameters the engine applies (all of them)."""
        return sampling

    def _greedy(self, r: _Running, logprobs: Sequence[float]) -> int:
        """The temperature-0 pick: the most likely token."""
        return max(range(VOCAB_SIZE), key=lambda i: logprobs[i])

    def _rng(self, sampling: SamplingParams) -> random.Random:
        return random.Random(sampling.seed)

    def _limit(self, sampling: SamplingParams) -> int:
        return sampling.max_new_tokens

    def _logprob(self, logprob: float) -> float:
        return logprob

    def _scored_prefix(self, prompt: tuple[int, ...], position: int) -> tuple[int, ...]:
        """The tokens a prompt position's logprob is conditioned on (``prompt_logprobs_start``)."""
        return prompt[:position]

    def _ranked(self, logprobs: Sequence[float]) -> list[int]:
        """Token ids, most likely first (ties by id): what ``top_logprobs`` lists."""
        return sorted(range(VOCAB_SIZE), key=lambda i: (-logprobs[i], i))

    def _stops(self, token: int, sampling: SamplingParams) -> bool:
        return not sampling.ignore_eos and (token == EOS or token in sampling.stop_token_ids)

    def _answer(self, r: _Running, finish: FinishReason, cached: int) -> Generation:
        out = tuple(r.out)
        tops = tuple(r.tops) if r.request.return_logprobs and r.request.sampling.top_logprobs else None
        return Generation(
            request_id=r.request.request_id,
            output_ids=out,
            logprobs=tuple(r.lps) if r.request.return_logprobs else None,
            finish_reason=finish,
            weight_version=self.version,
            prompt_tokens=len(r.request.input_ids),
            cached_tokens=cached,
            worker=self._id,
            matched_stop=(r.matched or out[-1]) if finish is FinishReason.STOP else None,
            top_logprobs=tops,
            prompt_logprobs=r.prompt_lps,
            text=self._text(r, finish) if r.request.sampling.stop else None,
        )

    def _text(self, r: _Running, finish: FinishReason) -> str:
        """SGLang's text: cut before the matched stop string (after it with ``no_stop_trim``)."""
        full = fake_text(r.out)
        if finish is FinishReason.STOP and r.matched is not None:
            pos = full.find(r.matched)
            return full[: pos + len(r.matched)] if r.request.sampling.no_stop_trim else full[:pos]
        if finish is FinishReason.STOP and not r.request.sampling.no_stop_trim:
            return full[:-1]
        return full

    # -- control ------------------------------------------------------------------------------

    async def control(self, op: Command) -> None:
        self.ops.append(op)
        if not self.live:
            raise ControlFailed(op.name, [WorkerFailure(self._id, op.name, "cannot connect (down)")])
        failure = self._failing.pop(type(op), None)
        if failure is not None:
            raise failure
        match op:
            case AbortRequest():
                r = self._running.get(op.request_id)
                if r is not None:
                    self._abort([r])
            case AbortAll():
                self._abort(list(self._running.values()))
            case Pause():
                await self._pause(op.mode)
            case Resume():
                self.paused = None
                self._wake()
            case FlushCache():
                self._flush()
            case InitWeightGroup() | UpdateFromDistributed():
                raise Unsupported("weight_transport.distributed", "the fake has no process group")
            case DestroyWeightGroup() | BeginWeightUpdate() | EndWeightUpdate():
                return None
            case UpdateFromDisk() | UpdateFromTensors() if MemoryTag.WEIGHTS in self.released:
                why = "weights are released; call resume_memory first"  # as the reference engine
                raise ControlFailed(op.name, [WorkerFailure(self._id, op.name, why)])
            case UpdateFromDisk() | UpdateFromTensors() if self.loads_only_paused and self.paused is None:
                # As ai-dynamo 1.4.2's dynamo.vllm weight routes answer (Capabilities.load_needs_pause).
                raise ControlFailed(
                    op.name, [WorkerFailure(self._id, op.name, "Worker must be paused before updating weights")]
                )
            case UpdateFromDisk():
                try:
                    seed, perm = _read_weights(op.path)
                except InvalidRequest as exc:  # the engine cannot load it, as SGLang answers success: false
                    raise ControlFailed(op.name, [WorkerFailure(self._id, op.name, str(exc))]) from exc
                self._load(seed, perm, op.version, op.flush_cache)
            case UpdateFromTensors():
                named = dict(op.tensors.items)
                if "seed" not in named:
                    raise InvalidRequest("named_tensors", "the fake's weights are a tensor named 'seed'")
                perm = {int(i): int(j) for i, j in named.get("perm", ())}
                self._load(int(named["seed"]), perm, op.version, op.flush_cache)
            case SetVersion():
                self.version = op.version
            case ReleaseMemory(tags=tags):
                self.release_memory(set(tags or MemoryTag))
            case ResumeMemory(tags=tags):
                self.resume_memory(set(tags or MemoryTag))
            case _:
                unhandled(op)

    def release_memory(self, tags: set[MemoryTag]) -> None:
        """Free the tagged memory: the weights' memory then holds other numbers (as freed GPU
        memory would), the KV cache is gone. Refused with requests running unless paused, as
        SGLang asserts an idle scheduler."""
        if self._running and self.paused is None:
            raise ControlFailed("release_memory", [WorkerFailure(self._id, "release_memory", "requests running")])
        if MemoryTag.WEIGHTS in tags and MemoryTag.WEIGHTS not in self.released:
            self._weights_backup = (self.seed, self.perm)
            self.seed, self.perm = self.seed + 7919, {}
        if MemoryTag.KV_CACHE in tags:
            self.cache.clear()
        self.released |= tags

    def resume_memory(self, tags: set[MemoryTag]) -> None:
        """Take back the tagged memory (the weights from their backup); what is not released is left alone."""
        if MemoryTag.WEIGHTS in tags and self._weights_backup is not None:
            self.seed, self.perm = self._weights_backup
            self._weights_backup = None
        self.released -= tags

    def _abort(self, requests: Sequence[_Running]) -> None:
        for r in requests:
            r.aborted = True
        self._wake()

    async def _pause(self, mode: PauseMode) -> None:
        self.paused = mode
        if mode is PauseMode.ABORT:
            self._abort(list(self._running.values()))

    def _flush(self) -> None:
        if self.paused is PauseMode.IN_PLACE and self._running:
            raise ControlFailed(
                "flush_cache", [WorkerFailure(self._id, "flush_cache", "requests frozen in place hold KV")]
            )
        self.cache.clear()

    def _load(self, seed: int, perm: Perm, version: str | None, flush_cache: bool) -> None:
        self.seed, self.perm = seed, perm
        if flush_cache:
            self.cache.clear()
        if version is not None:
            self.version = version

    # -- health and lifecycle -----------------------------------------------------------------

    async def probe(self, op: Probe) -> bool | None:
        if not self.live:
            raise BackendUnavailable(f"{self._id}: cannot connect (down)", worker=self._id)
        match op:
            case Live():
                return True
            case Ready() | Progress():
                return self.paused is None
            case _:
                unhandled(op)

    async def served_version(self) -> str | None:
        if not self.live:
            raise BackendUnavailable(f"{self._id}: cannot connect (down)", worker=self._id)
        return self.version

    async def aclose(self) -> None:
        self.closed = True
        self._abort(list(self._running.values()))

    def __repr__(self) -> str:
        return f"<FakeDriver {self._id} seed={self.seed} version={self.version!r} paused={self.paused}>"


class FakeFleet(Fleet):
    """A ``Fleet`` of ``FakeDriver``s (the protocol is ``Fleet``'s, as for every engine)."""

    def __init__(self, drivers: Sequence[FakeDriver], *, capabilities: Capabilities | None = None) -> None:
        super().__init__(drivers, capabilities=capabilities, name="fake")
        self._fakes = {d.id: d for d in drivers}
        for d in drivers:
            self.set_installed_version(d.version, [d.id])

    def fake(self, worker: str) -> FakeDriver:
        """The fake engine behind a worker id."""
        self.driver(worker)
        return self._fakes[worker]

    @property
    def fakes(self) -> tuple[FakeDriver, ...]:
        return tuple(self._fakes[w] for w in self.workers)


def fake_fleet(
    workers: int = 1,
    *,
    seed: int = 1,
    version: str = "v0",
    capabilities: Capabilities = FAKE_CAPABILITIES,
    token_delay: float = 0.002,
) -> FakeFleet:
    """``workers`` fake engines ``fake-0``, ``fake-1``, ... on the weights ``seed``, labelled ``version``."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidRequest("workers", f"must be an int >= 1, got {workers!r}")
    drivers = [
        FakeDriver(f"fake-{i}", seed=seed, version=version, capabilities=capabilities, token_delay=token_delay)
        for i in range(workers)
    ]
    return FakeFleet(drivers, capabilities=capabilities)


def fake_factory(
    workers: int = 1,
    *,
    seed: int = 1,
    version: str = "v0",
    capabilities: Capabilities = FAKE_CAPABILITIES,
    token_delay: float = 0.002,
) -> Callable[[], Awaitable[FakeFleet]]:
    """A conformance-suite factory: each call makes a fresh ``fake_fleet`` with these arguments."""

    async def make() -> FakeFleet:
        return fake_fleet(workers, seed=seed, version=version, capabilities=capabilities, token_delay=token_delay)

    return make
