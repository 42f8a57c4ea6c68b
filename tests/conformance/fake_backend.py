"""A tiny in-memory backend for testing the conformance machinery itself (no torch, no engine).

The "model" is a hash: the logits for the next token are drawn from ``Random((seed, last tokens))``,
where ``seed`` stands for the weights (a checkpoint is a directory holding ``weights.json`` with
``{"seed": N}``). Each token takes ``token_delay`` seconds, so requests can be caught in flight.

``bugs`` switches on one contract breach each, so that each check is shown to fail (see
``BUGS``). ``FakeBackend(declare=Capabilities())`` declares nothing, to show the skips.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollout_backends import (
    Capabilities,
    ControlFailed,
    FinishReason,
    GenerateRequest,
    Generation,
    HealthReport,
    InvalidRequest,
    MemoryTag,
    PauseMode,
    Unsupported,
    WeightBucket,
    WeightGroup,
    WeightTransport,
    WorkerFailure,
    WorkerHealth,
)
from rollout_backends.conformance import BackendFactory, Harness
from rollout_backends.kit import BackendBase, VersionBook, fan_out

VOCAB = 64
EOS = 0
CONTEXT = 256

#: Every bug a FakeBackend can be told to have.
BUGS = frozenset(
    {
        "positive_logprob",
        "ignore_stop",
        "off_by_one",
        "abort_drops_tokens",
        "abort_noop",
        "concurrency_noise",
        "set_version_aborts",
        "stale_prefix",
        "version_lag",
        "retract_as_abort",
        "in_place_flush_ok",
        "paused_serves",
        "failed_load_corrupts",
        "no_stale_report",
        "accept_oov",
        "seed_ignored",
        "probe_none",
        "resume_not_idempotent",
        "paused_still_ready",
        "wrong_prompt_tokens",
        "top_logprobs_skip_best",
        # logprobs[0] is the prompt's last token's, logprobs[i] that of output[i-1] (one position late)
        "logprobs_shifted",
        # logprobs[i] is that of output[i+1], the last one padded with 0.0 (one position early)
        "logprobs_shifted_ahead",
        "pause_abort_noop",  # pause(ABORT) leaves in-flight requests running
        "generation_value_error",  # the adapter builds a Generation its constructor refuses (ValueError)
    }
)

FULL = Capabilities(
    pause_modes=[PauseMode.ABORT, PauseMode.RETRACT, PauseMode.IN_PLACE],
    weight_transports=[WeightTransport.DISK, WeightTransport.TENSOR],
    seeded_sampling=True,
    abort=True,
    batch_invariant=True,
    top_logprobs=20,
    vocab_size=VOCAB,
    max_context=CONTEXT,
)


def write_checkpoint(path: Path, seed: int) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "weights.json").write_text(json.dumps({"seed": seed}))
    return str(path)


def read_checkpoint(path: str) -> int:
    try:
        return int(json.loads((Path(path) / "weights.json").read_text())["seed"])
    except (OSError, ValueError, KeyError) as exc:
        raise RuntimeError(f"cannot load checkpoint {path}: {exc}") from exc


def load_fake_weights(path: str) -> list[tuple[str, Any]]:
    return [("seed", read_checkpoint(path))]


def _logprobs(seed: int, prompt_seed: int, seq: Sequence[int]) -> list[float]:
    rng = random.Random(f"{seed}/{prompt_seed}/{tuple(seq[-3:])}/{len(seq) % 5}")
    logits = [rng.gauss(0.0, 3.0) for _ in range(VOCAB)]
    logits[EOS] -= 4.0  # keep natural stops rare but possible
    m = max(logits)
    z = m + math.log(sum(math.exp(x - m) for x in logits))
    return [x - z for x in logits]


@attrs.define(eq=False)
class _Req:
    request: GenerateRequest
    worker: str
    abort: bool = False
    out: list[int] = attrs.field(factory=list)
    lps: list[float] = attrs.field(factory=list)
    tops: list[tuple[tuple[int, float], ...]] = attrs.field(factory=list)


@attrs.define(eq=False)
class _Worker:
    seed: int
    version: str = "v0"
    loaded_version: str = "v0"  #: what a "version_lag" backend keeps stamping (moved by loaders only)
    paused: PauseMode | None = None
    resumed: asyncio.Event = attrs.field(factory=asyncio.Event)
    cache: dict[tuple[int, ...], int] = attrs.field(factory=dict)  #: prefix -> seed it was computed with
    fail_next_load: bool = False


class FakeBackend(BackendBase):
    def __init__(
        self,
        seed: int = 1,
        *,
        workers: int = 1,
        declare: Capabilities = FULL,
        bugs: frozenset[str] = frozenset(),
        token_delay: float = 0.002,
    ) -> None:
        unknown = set(bugs) - BUGS
        assert not unknown, unknown
        self.capabilities = declare
        self.bugs = frozenset(bugs)
        self.token_delay = token_delay
        self._w = {f"fake-{i}": _Worker(seed=seed) for i in range(workers)}
        for w in self._w.values():
            w.resumed.set()
        self._reqs: dict[str, _Req] = {}
        self._rr = 0
        self._versions = VersionBook(self._w, label="v0")
        self.closed = False

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self._w)

    # -- data plane --

    async def generate(self, request: GenerateRequest) -> Generation:
        if "accept_oov" not in self.bugs:
            for i, t in enumerate(request.input_ids):
                if t >= VOCAB:
                    raise InvalidRequest(f"input_ids[{i}]", f"{t} >= vocab {VOCAB}")
        if len(request.input_ids) >= CONTEXT:
            raise InvalidRequest("input_ids", f"longer than the context ({CONTEXT})")
        wid = request.worker or self.workers[self._rr % len(self._w)]
        self._rr += 1
        w = self._w[wid]
        r = _Req(request, wid)
        self._reqs[request.request_id] = r
        try:
            return await self._run(r, w)
        finally:
            self._reqs.pop(request.request_id, None)

    async def _run(self, r: _Req, w: _Worker) -> Generation:
        sp = r.request.sampling
        prompt = r.request.input_ids
        if "paused_serves" not in self.bugs:
            await w.resumed.wait()
        cached = max((len(p) for p in w.cache if prompt[: len(p)] == p and len(p) < len(prompt)), default=0)
        prompt_seed = w.seed
        if "stale_prefix" in self.bugs and cached:
            prompt_seed = w.cache[prompt[:cached]]
        elif cached and w.cache[prompt[:cached]] != w.seed:
            cached = 0  # a correct engine does not reuse KV computed with other weights
        for k in range(1, len(prompt) + 1):
            w.cache.setdefault(prompt[:k], w.seed)
        rng = random.Random(sp.seed if sp.seed is not None and "seed_ignored" not in self.bugs else None)
        limit = sp.max_new_tokens - (1 if "off_by_one" in self.bugs and sp.max_new_tokens > 1 else 0)
        finish = FinishReason.LENGTH
        while len(r.out) < limit:
            await asyncio.sleep(self.token_delay)
            if w.paused is not None and "paused_serves" not in self.bugs:
                await w.resumed.wait()
            if r.abort:
                finish = FinishReason.ABORT
                break
            lps = _logprobs(w.seed, prompt_seed, prompt + tuple(r.out))
            if sp.temperature == 0.0:
                tok = max(range(VOCAB), key=lambda i: lps[i])
            else:
                weights = [math.exp(x / sp.temperature) for x in lps]
                tok = rng.choices(range(VOCAB), weights)[0]
            lp = lps[tok]
            if "concurrency_noise" in self.bugs and len(self._reqs) > 1:
                lp -= 0.01
            if "positive_logprob" in self.bugs:
                lp = abs(lp) + 0.5
            r.out.append(tok)
            r.lps.append(lp)
            if sp.top_logprobs:
                ranked = sorted(range(VOCAB), key=lambda i: (-lps[i], i))
                if "top_logprobs_skip_best" in self.bugs:
                    ranked = ranked[1:]  # the bug: alternatives only, the most likely token left out
                r.tops.append(tuple((i, lps[i]) for i in ranked[: sp.top_logprobs]))
            if not sp.ignore_eos and (tok == EOS or (tok in sp.stop_token_ids and "ignore_stop" not in self.bugs)):
                finish = FinishReason.STOP
                break
        out, lps_out = tuple(r.out), tuple(r.lps)
        tops = tuple(r.tops) if r.request.return_logprobs and sp.top_logprobs else None
        if "logprobs_shifted" in self.bugs and out:
            head = _logprobs(w.seed, prompt_seed, prompt[:-1])[prompt[-1]]
            lps_out = (head, *lps_out[:-1])
        if "logprobs_shifted_ahead" in self.bugs and out:
            lps_out = (*lps_out[1:], 0.0)
        if finish is FinishReason.ABORT and "abort_drops_tokens" in self.bugs:
            out, lps_out = (), ()
        if "generation_value_error" in self.bugs and r.request.return_logprobs:
            lps_out = (*lps_out, -1.0)  # one logprob too many: Generation raises ValueError
        return Generation(
            request_id=r.request.request_id,
            output_ids=out,
            logprobs=lps_out if r.request.return_logprobs else None,
            finish_reason=finish,
            weight_version=w.loaded_version if "version_lag" in self.bugs else w.version,
            prompt_tokens=len(prompt) + (1 if "wrong_prompt_tokens" in self.bugs else 0),
            cached_tokens=cached,
            worker=r.worker,
            matched_stop=out[-1] if finish is FinishReason.STOP else None,
            top_logprobs=tops[: len(out)] if tops is not None else None,
        )

    async def abort(self, request_id: str) -> None:
        r = self._reqs.get(request_id)
        if r is not None and "abort_noop" not in self.bugs:
            r.abort = True

    async def abort_all(self, *, workers: Sequence[str] | None = None) -> None:
        sel = set(self._select(workers))
        for r in self._reqs.values():
            if r.worker in sel and "abort_noop" not in self.bugs:
                r.abort = True

    # -- pause --

    async def pause(self, mode: PauseMode = PauseMode.RETRACT, *, workers: Sequence[str] | None = None) -> None:
        m = self._require_pause_mode(mode)
        for wid in self._select(workers):
            w = self._w[wid]
            w.paused = m
            w.resumed.clear()
            if m is PauseMode.ABORT and "pause_abort_noop" in self.bugs:
                w.resumed.set()  # the bug: in-flight requests go on as if nothing happened
            elif m is PauseMode.ABORT or (m is PauseMode.RETRACT and "retract_as_abort" in self.bugs):
                await self.abort_all(workers=[wid])
                w.resumed.set()  # aborted requests must get out
                await asyncio.sleep(self.token_delay * 3)
                w.resumed.clear()

    async def resume(self, *, workers: Sequence[str] | None = None) -> None:
        sel = self._select(workers)
        if "resume_not_idempotent" in self.bugs and any(self._w[w].paused is None for w in sel):
            raise ControlFailed("resume", [WorkerFailure(sel[0], "resume", "not paused")])
        for wid in sel:
            self._w[wid].paused = None
            self._w[wid].resumed.set()

    # -- weights --

    async def _load(
        self, seed_of: Any, *, version: str | None, flush_cache: bool, workers: Sequence[str] | None
    ) -> None:
        async def one(wid: str) -> None:
            w = self._w[wid]
            if w.fail_next_load:
                w.fail_next_load = False
                raise RuntimeError("injected load failure")
            try:
                seed = seed_of()
            except Exception:
                if "failed_load_corrupts" in self.bugs:
                    w.seed = -1
                raise
            w.seed = seed
            if flush_cache:
                w.cache.clear()
            if version is not None:
                w.version = w.loaded_version = version

        selected = self._select(workers)
        await fan_out("update_weights", selected, one)
        self._versions.relabelled(version, selected)

    async def update_weights_from_disk(
        self,
        path: str,
        *,
        version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        workers: Sequence[str] | None = None,
    ) -> None:
        self._require_transport(WeightTransport.DISK)
        await self._load(lambda: read_checkpoint(path), version=version, flush_cache=flush_cache, workers=workers)

    async def update_weights_from_tensors(
        self,
        named_tensors: Sequence[tuple[str, Any]],
        *,
        version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
        workers: Sequence[str] | None = None,
    ) -> None:
        self._require_transport(WeightTransport.TENSOR)
        named = dict(named_tensors)
        await self._load(lambda: int(named["seed"]), version=version, flush_cache=flush_cache, workers=workers)

    async def init_weight_group(self, group: WeightGroup, *, workers: Sequence[str] | None = None) -> None:
        raise Unsupported("weight_transport.distributed")

    async def update_weights_from_distributed(
        self,
        bucket: WeightBucket,
        *,
        group_name: str = "weight_update_group",
        version: str | None = None,
        flush_cache: bool = True,
        workers: Sequence[str] | None = None,
    ) -> None:
        raise Unsupported("weight_transport.distributed")

    async def destroy_weight_group(
        self, group_name: str = "weight_update_group", *, workers: Sequence[str] | None = None
    ) -> None:
        return None

    async def begin_weight_update(self, selector: str = "all", *, workers: Sequence[str] | None = None) -> None:
        return None

    async def end_weight_update(self, *, workers: Sequence[str] | None = None) -> None:
        return None

    async def set_weight_version(self, version: str, *, workers: Sequence[str] | None = None) -> None:
        selected = self._select(workers)
        for wid in selected:
            self._w[wid].version = version
            if "set_version_aborts" in self.bugs:
                await self.abort_all(workers=[wid])
        self._versions.relabelled(version, selected)

    async def weight_versions(self) -> Mapping[str, str | None]:
        return {wid: w.version for wid, w in self._w.items()}

    async def flush_cache(self, *, workers: Sequence[str] | None = None) -> None:
        async def one(wid: str) -> None:
            w = self._w[wid]
            busy = any(r.worker == wid for r in self._reqs.values())
            if w.paused is PauseMode.IN_PLACE and busy and "in_place_flush_ok" not in self.bugs:
                raise RuntimeError("cannot flush: requests frozen in place hold KV")
            if w.paused is PauseMode.IN_PLACE and "stale_prefix" in self.bugs:
                # The bug: the engine refuses every flush while paused in place, so KV computed with
                # the old weights survives the update and is served afterwards.
                raise RuntimeError("cannot flush while paused in place")
            w.cache.clear()

        await fan_out("flush_cache", self._select(workers), one)

    async def release_memory(
        self, tags: Sequence[MemoryTag | str] | None = None, *, workers: Sequence[str] | None = None
    ) -> None:
        raise Unsupported("memory_release")

    async def resume_memory(
        self, tags: Sequence[MemoryTag | str] | None = None, *, workers: Sequence[str] | None = None
    ) -> None:
        raise Unsupported("memory_release")

    # -- health --

    async def health(self, *, probe: bool = False) -> HealthReport:
        expected = self._versions.expected
        out = []
        for wid, w in self._w.items():
            stale = VersionBook.is_stale(w.version, expected=expected, live=True) and "no_stale_report" not in self.bugs
            progress = None if not probe or "probe_none" in self.bugs else True
            out.append(
                WorkerHealth(
                    worker=wid,
                    live=True,
                    ready=w.paused is None or "paused_still_ready" in self.bugs,
                    making_progress=progress,
                    weight_version=w.version,
                    stale=stale,
                )
            )
        return HealthReport(workers=tuple(out), expected_version=expected)

    async def aclose(self) -> None:
        self.closed = True

    # -- test hooks --

    @contextlib.asynccontextmanager
    async def failing_load(self, worker: str) -> AsyncIterator[None]:
        self._w[worker].fail_next_load = True
        try:
            yield
        finally:
            self._w[worker].fail_next_load = False


def fake_factory(seed: int = 1, **kwargs: Any) -> BackendFactory:
    async def make() -> FakeBackend:
        return FakeBackend(seed, **kwargs)

    return make


def fake_harness(tmp: Path, **changes: Any) -> Harness:
    alt = write_checkpoint(tmp / "alt", 2)
    base = write_checkpoint(tmp / "base", 1)

    def fresh_on(path: str) -> BackendFactory:
        return fake_factory(read_checkpoint(path))

    @contextlib.asynccontextmanager
    async def inject(backend: Any, worker: str) -> AsyncIterator[None]:
        async with backend.failing_load(worker):
            yield

    h = Harness(
        alt_weights_path=alt,
        base_weights_path=base,
        fresh_factory_on=fresh_on,
        inject_failure=inject,
        load_weights=load_fake_weights,
        concurrency=40,
        long_max_new_tokens=200,
        pause_max_new_tokens=120,
        wait_s=0.1,
        check_timeout_s=30.0,
    )
    return h.replace(**changes)


def open_fake_url(url: str, **kw: Any) -> FakeBackend:
    """``fake://?workers=2&bugs=a,b`` (registered by ``url_harness``, for plugin tests)."""
    from urllib.parse import parse_qs, urlparse

    q = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    bugs = frozenset(b for b in q.get("bugs", "").split(",") if b)
    return FakeBackend(int(q.get("seed", "1")), workers=int(q.get("workers", "1")), bugs=bugs)


def url_harness(url: str) -> Harness:
    """``--rb-harness tests.conformance.fake_backend:url_harness``: registers ``fake://`` too."""
    import tempfile

    _register()
    return fake_harness(Path(tempfile.mkdtemp(prefix="rb-fake-")))


def _register() -> None:
    from rollout_backends import register_scheme

    register_scheme("fake", open_fake_url)


def bare_harness(url: str) -> Harness:
    """``--rb-harness tests.conformance.fake_backend:bare_harness``: ``fake://`` with no hook at all."""
    _register()
    return Harness()


def short_budget_harness(url: str) -> Harness:
    """``fake://`` with requests too short to be caught in flight: the abort and pause checks' setup is wrong."""
    _register()
    return Harness(long_max_new_tokens=2, pause_max_new_tokens=2, concurrency=8)
