"""The public in-memory fake (``rollout_backends.testing``) with switchable bugs, for testing the
conformance machinery itself (no torch, no engine).

``bugs`` switches on one contract breach each, so that each check is shown to fail (see
``BUGS``): most in the engine (``BuggyDriver`` overrides one ``FakeDriver`` hook each), three in
what the fleet reports (``FakeBackend`` overrides ``Fleet`` there). ``FakeBackend(declare=
Capabilities())`` declares nothing, to show the skips.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Sequence
from pathlib import Path
from typing import Any

import attrs

import rollout_backends as rb
from rollout_backends import Capabilities, HealthReport, PauseMode
from rollout_backends._fake import _logprobs as fake_logprobs
from rollout_backends.conformance import BackendFactory, Harness
from rollout_backends.kit import (
    AbortAll,
    AbortRequest,
    Command,
    FlushCache,
    Pause,
    Probe,
    Progress,
    Resume,
    SetVersion,
    UpdateFromDisk,
    UpdateFromTensors,
)
from rollout_backends.testing import (
    EOS,
    FAKE_CAPABILITIES,
    MAX_CONTEXT,
    VOCAB_SIZE,
    FakeDriver,
    FakeFleet,
    load_checkpoint,
    permute_checkpoint,
    read_checkpoint,
    write_checkpoint,
)

__all__ = [
    "BUGS",
    "FULL",
    "BuggyDriver",
    "FakeBackend",
    "fake_factory",
    "fake_harness",
    "read_checkpoint",
    "write_checkpoint",
]

VOCAB = VOCAB_SIZE
CONTEXT = MAX_CONTEXT

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
        "generation_value_error",  # the adapter's own parsing raises a plain ValueError (not typed)
        "prompt_logprobs_shifted",  # a prompt token's logprob is conditioned on itself too (one late)
        "version_constraints_ignored",  # min_version / exact_version declared, and routed as if absent
        "stop_string_late",  # a stop string ends the generation one token after the one completing it
        "stream_repeats_token",  # each chunk after the first starts one token early (repeats the last one)
        "stream_unversioned",  # a stream's final Generation carries no weight version
        "stream_no_abort",  # a stream left early goes on generating on the engine
        # the first greedy pick after a RETRACT resume is the second most likely token (a recompute
        # that flips more than a near tie)
        "retract_flips_token",
        # a weight load inside the transaction is acknowledged at once and applied later, after the
        # commit moved the label
        "label_before_load",
        # weight loads refused unless paused (as dynamo.vllm 1.4.2's routes), load_needs_pause not declared
        "loads_only_paused",
        # resume_memory() (every tag) gives back the KV cache only: the weights' memory keeps other numbers
        "resume_forgets_weights",
        # the first resume_memory after a release ends the sleep: later ones do nothing, so what the
        # first did not name stays released (dynamo.vllm 1.4.2's wake-up, docs/vllm.md)
        "first_resume_ends_sleep",
        # logprobs of the distribution sampled from, after top_k/top_p/min_p, renormalised (vLLM's
        # processed_logprobs), with filtered_logprobs not declared
        "filtered_logprobs_undeclared",
        # filtered_logprobs declared, and the logprobs unfiltered (SGLang's) all the same
        "filtered_logprobs_unfiltered",
        # one sampling parameter each, dropped before the engine applies them
        *(f"{name}_ignored" for name in ("temperature", "top_k", "top_p", "min_p", "min_new_tokens")),
        *(f"{name}_penalty_ignored" for name in ("repetition", "frequency", "presence")),
    }
)

#: What each "<parameter>_ignored" bug sets the parameter to (its neutral value; greedy for temperature).
_IGNORED: dict[str, dict[str, Any]] = {
    "temperature_ignored": {"temperature": 0.0},
    "top_k_ignored": {"top_k": -1},
    "top_p_ignored": {"top_p": 1.0},
    "min_p_ignored": {"min_p": 0.0},
    "min_new_tokens_ignored": {"min_new_tokens": 0},
    "repetition_penalty_ignored": {"repetition_penalty": 1.0},
    "frequency_penalty_ignored": {"frequency_penalty": 0.0},
    "presence_penalty_ignored": {"presence_penalty": 0.0},
}
#: How long a "label_before_load" engine takes to apply a load it acknowledged (seconds).
LATE_LOAD_S = 0.3

FULL = FAKE_CAPABILITIES
_LOADS = (UpdateFromDisk, UpdateFromTensors)


def load_fake_weights(path: str) -> list[tuple[str, Any]]:
    return load_checkpoint(path)


class BuggyDriver(FakeDriver):
    """The public fake engine with the driver-side bugs in ``bugs`` switched on (one hook each)."""

    def __init__(self, worker_id: str, *, bugs: frozenset[str], **kwargs: Any) -> None:
        super().__init__(worker_id, **kwargs)
        self.bugs = bugs
        self.loaded_version = self.version  #: what a "version_lag" engine keeps stamping
        self.left_running: list[asyncio.Future[None]] = []  #: "stream_no_abort": what runs on
        self.retracted: set[int] = set()  #: "retract_flips_token": requests parked mid-generation
        self.late_loads: list[asyncio.Future[None]] = []  #: "label_before_load": loads still to apply
        self.loads_only_paused = self.loads_only_paused or "loads_only_paused" in bugs
        self.awake_again = False  #: "first_resume_ends_sleep": a resume came since the last release

    def resume_memory(self, tags: set[rb.MemoryTag]) -> None:
        if "resume_forgets_weights" in self.bugs and tags == set(rb.MemoryTag):
            tags = {rb.MemoryTag.KV_CACHE}
        if "first_resume_ends_sleep" in self.bugs:
            if self.awake_again:
                return
            self.awake_again = bool(self.released)
        super().resume_memory(tags)

    def release_memory(self, tags: set[rb.MemoryTag]) -> None:
        super().release_memory(tags)
        self.awake_again = False

    def _check(self, request: rb.GenerateRequest) -> None:
        if "accept_oov" not in self.bugs:
            super()._check(request)

    async def _wait_resumed(self, r: Any) -> None:
        if "pause_abort_noop" in self.bugs and self.paused is PauseMode.ABORT:
            return  # the bug: in-flight requests go on as if nothing happened
        if "retract_flips_token" in self.bugs and self.paused is PauseMode.RETRACT and r.out:
            self.retracted.add(id(r))
        if "paused_serves" not in self.bugs:
            await super()._wait_resumed(r)

    def _prefix(self, prompt: tuple[int, ...], cached: int) -> tuple[int, int]:
        if "stale_prefix" in self.bugs and cached:
            return self.cache[prompt[:cached]], cached  # KV computed with the old weights, reused
        return super()._prefix(prompt, cached)

    def _greedy(self, r: Any, logprobs: Sequence[float]) -> int:
        if id(r) in self.retracted:
            self.retracted.discard(id(r))
            return super()._ranked(logprobs)[1]
        return super()._greedy(r, logprobs)

    def _effective(self, sampling: rb.SamplingParams) -> rb.SamplingParams:
        changes = {k: v for bug, change in _IGNORED.items() if bug in self.bugs for k, v in change.items()}
        return sampling.replace(**changes) if changes else sampling

    def _filtered_logprobs(self) -> bool:
        if "filtered_logprobs_undeclared" in self.bugs:
            return True
        return "filtered_logprobs_unfiltered" not in self.bugs and super()._filtered_logprobs()

    def _rng(self, sampling: rb.SamplingParams) -> random.Random:
        return random.Random() if "seed_ignored" in self.bugs else super()._rng(sampling)

    def _limit(self, sampling: rb.SamplingParams) -> int:
        n = sampling.max_new_tokens
        return n - 1 if "off_by_one" in self.bugs and n > 1 else n

    def _logprob(self, logprob: float) -> float:
        if "concurrency_noise" in self.bugs and len(self.running) > 1:
            logprob -= 0.01
        return abs(logprob) + 0.5 if "positive_logprob" in self.bugs else logprob

    def _stop_string(self, out: Sequence[int], sampling: rb.SamplingParams) -> str | None:
        if "stop_string_late" in self.bugs:
            return super()._stop_string(out[:-1], sampling) if len(out) > 1 else None
        return super()._stop_string(out, sampling)

    def _scored_prefix(self, prompt: tuple[int, ...], position: int) -> tuple[int, ...]:
        late = 1 if "prompt_logprobs_shifted" in self.bugs else 0
        return prompt[: position + late]

    def _ranked(self, logprobs: Sequence[float]) -> list[int]:
        ranked = super()._ranked(logprobs)
        # The bug: alternatives only, the most likely token left out.
        return ranked[1:] if "top_logprobs_skip_best" in self.bugs else ranked

    def _stops(self, token: int, sampling: rb.SamplingParams) -> bool:
        if "ignore_stop" in self.bugs:
            return not sampling.ignore_eos and token == EOS
        return super()._stops(token, sampling)

    def _chunk(self, r: Any, sent: int) -> rb.TokenChunk:
        if "stream_repeats_token" in self.bugs and sent:
            return super()._chunk(r, sent - 1)
        return super()._chunk(r, sent)

    def _final(self, r: Any) -> rb.Generation:
        gen = super()._final(r)
        return attrs.evolve(gen, weight_version=None) if "stream_unversioned" in self.bugs else gen

    async def _end_stream(self, r: Any, steps: AsyncGenerator[None, None]) -> None:
        if "stream_no_abort" not in self.bugs:
            return await super()._end_stream(r, steps)

        async def run_on() -> None:  # the bug: the engine ignores the client going away
            try:
                async for _ in steps:
                    pass
            finally:
                self._release(r)

        self.left_running.append(asyncio.ensure_future(run_on()))
        return None

    def _answer(self, r: Any, finish: rb.FinishReason, cached: int) -> rb.Generation:
        gen = super()._answer(r, finish, cached)
        if "logprobs_shifted" in self.bugs and gen.output_ids and gen.logprobs is not None:
            prompt = r.request.input_ids
            head = fake_logprobs(self.seed, self.seed, prompt[:-1])[prompt[-1]]
            gen = attrs.evolve(gen, logprobs=(head, *gen.logprobs[:-1]))
        if "logprobs_shifted_ahead" in self.bugs and gen.output_ids and gen.logprobs is not None:
            gen = attrs.evolve(gen, logprobs=(*gen.logprobs[1:], 0.0))
        if finish is rb.FinishReason.ABORT and "abort_drops_tokens" in self.bugs:
            gen = attrs.evolve(
                gen,
                output_ids=(),
                logprobs=() if gen.logprobs is not None else None,
                top_logprobs=() if gen.top_logprobs is not None else None,
            )
        if "generation_value_error" in self.bugs and gen.logprobs is not None:
            # Generation itself refuses misaligned logprobs typed (ContractViolation); an adapter's
            # own parser can still raise a plain exception, e.g. int() of a malformed field.
            raise ValueError(f"invalid literal for int() with base 10: {'x' * len(gen.logprobs)!r}")
        if "version_lag" in self.bugs:
            gen = attrs.evolve(gen, weight_version=self.loaded_version)
        if "wrong_prompt_tokens" in self.bugs:
            gen = attrs.evolve(gen, prompt_tokens=gen.prompt_tokens + 1)
        return gen

    async def control(self, op: Command) -> None:
        if isinstance(op, (AbortRequest, AbortAll)) and "abort_noop" in self.bugs:
            self.ops.append(op)
            return
        if isinstance(op, Resume) and "resume_not_idempotent" in self.bugs and self.paused is None:
            raise rb.ControlFailed("resume", [rb.WorkerFailure(self.id, "resume", "not paused")])
        if isinstance(op, FlushCache) and self.paused is PauseMode.IN_PLACE:
            if "in_place_flush_ok" in self.bugs:
                self.ops.append(op)
                self.cache.clear()
                return
            if "stale_prefix" in self.bugs:
                # The engine refuses every flush while paused in place, so KV computed with the old
                # weights survives the update and is served afterwards.
                raise rb.ControlFailed("flush_cache", [rb.WorkerFailure(self.id, "flush_cache", "paused in place")])
        if isinstance(op, Pause) and op.mode is PauseMode.ABORT and "pause_abort_noop" in self.bugs:
            self.ops.append(op)
            self.paused = PauseMode.ABORT  # and nothing aborted
            return
        if isinstance(op, Pause) and op.mode is PauseMode.RETRACT and "retract_as_abort" in self.bugs:
            op = Pause(PauseMode.ABORT)
        if isinstance(op, _LOADS) and op.version is None and "label_before_load" in self.bugs:
            # A load inside the transaction (it labels nothing itself): the label moves at commit.

            async def late(load: Command = op) -> None:  # the bug: "done" before the weights are in
                await asyncio.sleep(LATE_LOAD_S)
                with contextlib.suppress(rb.RolloutBackendError):  # nobody is told any more
                    await FakeDriver.control(self, load)

            self.late_loads.append(asyncio.ensure_future(late()))
            return
        try:
            await super().control(op)
        except Exception:
            if isinstance(op, UpdateFromDisk) and "failed_load_corrupts" in self.bugs:
                self.seed = -1
            raise
        if isinstance(op, _LOADS) and op.version is not None:
            self.loaded_version = op.version
        if isinstance(op, SetVersion) and "set_version_aborts" in self.bugs:
            await super().control(AbortAll())

    async def aclose(self) -> None:
        for task in self.late_loads:
            task.cancel()
        await super().aclose()

    async def probe(self, op: Probe) -> bool | None:
        if isinstance(op, Progress) and "probe_none" in self.bugs:
            return None
        return await super().probe(op)


class FakeBackend(FakeFleet):
    """``rollout_backends.testing``'s fleet, with ``bugs`` switched on: each breaks the contract
    in one way, so that each conformance check is shown to fail (``BUGS``).
    ``FakeBackend(declare=Capabilities())`` declares nothing, to show the skips."""

    def __init__(
        self,
        seed: int = 1,
        *,
        workers: int = 1,
        declare: Capabilities = FULL,
        bugs: frozenset[str] = frozenset(),
        token_delay: float = 0.002,
        driver: type[BuggyDriver] = BuggyDriver,
    ) -> None:
        unknown = set(bugs) - BUGS
        assert not unknown, unknown
        self.bugs = frozenset(bugs)
        if "filtered_logprobs_unfiltered" in self.bugs:
            declare = attrs.evolve(declare, filtered_logprobs=True)  # the declaration is half the bug
        drivers = [
            driver(f"fake-{i}", bugs=self.bugs, seed=seed, capabilities=declare, token_delay=token_delay)
            for i in range(workers)
        ]
        super().__init__(drivers, capabilities=declare)

    # -- the fleet-side bugs --

    def _check_request(self, request: rb.GenerateRequest) -> None:
        if "accept_oov" not in self.bugs:
            super()._check_request(request)

    def _route_by_version(self, request: rb.GenerateRequest) -> rb.GenerateRequest:
        if "version_constraints_ignored" in self.bugs:
            return request
        return super()._route_by_version(request)

    async def health(self, *, probe: bool = False) -> HealthReport:
        report = await super().health(probe=probe)
        if "no_stale_report" in self.bugs:
            report = attrs.evolve(report, workers=tuple(attrs.evolve(w, stale=False) for w in report.workers))
        if "paused_still_ready" in self.bugs:
            report = attrs.evolve(report, workers=tuple(attrs.evolve(w, ready=w.live) for w in report.workers))
        return report

    # -- test hooks --

    @contextlib.asynccontextmanager
    async def failing_load(self, worker: str) -> AsyncIterator[None]:
        self.fake(worker).fail_next(*_LOADS)
        try:
            yield
        finally:
            self.fake(worker).fail_next()


def fake_factory(seed: int = 1, **kwargs: Any) -> BackendFactory:
    async def make() -> FakeBackend:
        return FakeBackend(seed, **kwargs)

    return make


async def held_requests(backend: Any) -> Collection[str]:
    """The request ids the fake engines hold (``Harness.held_requests``)."""
    return {rid for fake in backend.fakes for rid in fake.running}


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
        permute_vocabulary=permute_checkpoint,
        alt_weights_path=alt,
        base_weights_path=base,
        fresh_factory_on=fresh_on,
        inject_failure=inject,
        load_weights=load_fake_weights,
        held_requests=held_requests,
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


def broken_harness(url: str) -> Harness:
    """A harness function that raises: every check of ``url`` must be a pytest error, none a failure."""
    _register()
    raise RuntimeError("the harness cannot reach its checkpoint store")
