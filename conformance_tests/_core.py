"""The check machinery: requirements, results, the context handed to a check, the runner.

A *check* is an ``async def body(ctx: CheckContext) -> None`` wrapped by :func:`check` into a
:class:`Check`; calling the ``Check`` with a backend factory (and optionally a ``Harness``) runs it
and returns a :class:`CheckResult`. No pytest anywhere: failures are ``CheckFailed``
(an ``AssertionError``), skips are ``SkipCheck``.

Outcome rules (SQLAlchemy's dialect-suite style):

* a requirement that the backend does not *declare* (``Capabilities``), or a harness hook that is
  not provided, makes the check **skip** with a reason, before the backend is exercised;
* a declared capability that does not behave is a **fail**: a ``CheckFailed``, any
  ``RolloutBackendError`` (``Unsupported`` included: it was declared), or a hang past
  ``Harness.check_timeout_s``;
* anything else (the factory or a harness hook raising, a bug in a check) is an **error**.
"""

from __future__ import annotations

import asyncio
import enum
import fnmatch
import math
import random
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar, overload

import attrs

from rollout_backends import (
    Capabilities,
    FinishReason,
    GenerateRequest,
    Generation,
    InvalidRequest,
    PauseMode,
    RolloutBackend,
    RolloutBackendError,
    SamplingParams,
    VersionSource,
    WeightTransport,
)

from ._harness import BackendFactory, Harness

__all__ = [
    "ALL_CHECKS",
    "Check",
    "CheckContext",
    "CheckFailed",
    "CheckResult",
    "Gap",
    "HarnessError",
    "Outcome",
    "Report",
    "Requirement",
    "SkipCheck",
    "check",
    "expect",
    "requires",
    "run_checks",
    "select_checks",
]


class Outcome(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"


class Gap(str, enum.Enum):
    """Why a check did not run: what was missing (the closing summary groups skips by it)."""

    CAPABILITY = "not declared by the backend"
    HARNESS = "no harness hook"
    FLEET = "fleet too small"
    LIMIT = "limit unknown"
    WEIGHTS = "served checkpoint not readable here"
    METHOD = "method not offered"
    CHECK = "skipped by the check"


class CheckFailed(AssertionError):
    """The backend broke the contract (raised by checks; survives ``python -O``)."""


class SkipCheck(Exception):
    """The check cannot run here (an undeclared capability, a missing hook, too few workers)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class HarnessError(Exception):
    """The harness (not the backend) is unfit for the check, e.g. alt weights equal to the base."""


def expect(condition: object, message: str) -> None:
    """``assert`` that is not stripped by ``-O`` and raises ``CheckFailed``."""
    if not condition:
        raise CheckFailed(message)


def brief(text: str, limit: int = 120) -> str:
    """``text``'s first line, cut at a word boundary within ``limit`` characters (marked "...")."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    if len(line) <= limit:
        return line
    cut = line[: limit - 3].rsplit(" ", 1)[0].rstrip(" ,;:")
    return cut + "..."


def _measure_value(value: object) -> Any:
    return round(value, 9) if isinstance(value, float) else value


@attrs.frozen(kw_only=True)
class CheckResult:
    """The outcome of one check on one backend."""

    name: str
    outcome: Outcome
    #: Why it failed, was skipped or errored ("" when it passed).
    message: str = ""
    duration_s: float = 0.0
    #: Numbers the check measured (e.g. ``max_abs_dlogprob``), reported whatever the outcome.
    measurements: Mapping[str, Any] = attrs.field(factory=dict)
    #: The formatted traceback of an error (``None`` otherwise).
    traceback: str | None = None
    backend: str | None = None
    #: For a skip: each unmet requirement, ``(what kind of thing was missing, the reason)``.
    gaps: tuple[tuple[Gap, str], ...] = ()

    @property
    def passed(self) -> bool:
        return self.outcome is Outcome.PASS

    @property
    def ok(self) -> bool:
        """Passed or skipped."""
        return self.outcome in (Outcome.PASS, Outcome.SKIP)

    def line(self) -> str:
        meas = ", ".join(f"{k}={_fmt(v)}" for k, v in self.measurements.items())
        text = f"{self.outcome.value.upper():5} {self.name} ({self.duration_s:.2f}s)"
        if self.message:
            text += f": {self.message.splitlines()[0] if self.message else ''}"
        if meas:
            text += f" [{meas}]"
        return text


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


@attrs.frozen(kw_only=True)
class Report:
    """The results of ``run_checks`` in run order."""

    results: tuple[CheckResult, ...]
    backend: str | None = None
    duration_s: float = 0.0

    def _with(self, outcome: Outcome) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.results if r.outcome is outcome)

    @property
    def passed(self) -> tuple[CheckResult, ...]:
        return self._with(Outcome.PASS)

    @property
    def failed(self) -> tuple[CheckResult, ...]:
        return self._with(Outcome.FAIL)

    @property
    def skipped(self) -> tuple[CheckResult, ...]:
        return self._with(Outcome.SKIP)

    @property
    def errors(self) -> tuple[CheckResult, ...]:
        return self._with(Outcome.ERROR)

    @property
    def ok(self) -> bool:
        """No failure and no error."""
        return all(r.ok for r in self.results)

    def __getitem__(self, name: str) -> CheckResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(name)

    def summary(self) -> str:
        head = f"conformance of {self.backend or 'backend'}: " + ", ".join(
            f"{len(self._with(o))} {o.value}" for o in Outcome
        )
        return "\n".join([head + f" in {self.duration_s:.1f}s", *(r.line() for r in self.results)])

    def raise_for_failures(self) -> None:
        """Raise ``CheckFailed`` listing every failed or errored check."""
        bad = [r for r in self.results if not r.ok]
        if bad:
            raise CheckFailed("conformance failures:\n" + "\n".join(r.line() for r in bad))


# -- requirements -------------------------------------------------------------------------------


#: Returns why a requirement is not met (the skip reason), or ``None`` when it is.
Missing = Callable[[Capabilities, Harness, RolloutBackend], "str | None"]


@attrs.frozen
class Requirement:
    """One thing a check needs; ``missing`` returns the skip reason, or ``None`` when it is met."""

    description: str
    missing: Missing
    gap: Gap = Gap.CAPABILITY


def _pause_req(mode: PauseMode) -> Requirement:
    def missing(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
        return None if mode in c.pause_modes else f"pause mode {mode.value!r} not declared"

    return Requirement(f"pause_mode={mode.value}", missing)


def _transport_req(transport: WeightTransport) -> Requirement:
    def missing(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
        return None if transport in c.weight_transports else f"weight transport {transport.value!r} not declared"

    return Requirement(f"transport={transport.value}", missing)


def _flag_req(flag: str, value: bool) -> Requirement:
    def missing(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
        return None if getattr(c, flag) == value else f"capability {flag}={value} not declared"

    return Requirement(f"{flag}={value}", missing)


def _hook_req(hook: str) -> Requirement:
    def missing(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
        return None if getattr(h, hook) is not None else f"harness hook {hook!r} not provided"

    return Requirement(f"harness.{hook}", missing, Gap.HARNESS)


def _method_req(method: str) -> Requirement:
    def missing(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
        return None if callable(getattr(b, method, None)) else f"backend has no {method}() (not part of the protocol)"

    return Requirement(f"method {method}", missing, Gap.METHOD)


def _min_workers_req(n: int) -> Requirement:
    def missing(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
        have = len(b.workers)
        return None if have >= n else f"needs >= {n} workers, the fleet has {have}"

    return Requirement(f"min_workers={n}", missing, Gap.FLEET)


def _any_pause_mode(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    return None if c.pause_modes else "no pause mode declared"


def _vocab_known(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    if c.vocab_size or h.vocab_size:
        return None
    return "vocab size unknown (Capabilities.vocab_size and Harness.vocab_size are None)"


def _context_known(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    if c.max_context or h.max_context:
        return None
    return "context length unknown (Capabilities.max_context and Harness.max_context are None)"


def served_checkpoint(c: Capabilities, h: Harness) -> str | None:
    """The checkpoint the backend serves: ``Harness.base_weights_path``, else ``Capabilities.model_path``."""
    return h.base_weights_path or c.model_path


def _checkpoint_readable(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    path = served_checkpoint(c, h)
    if path is None:
        return "the served checkpoint is unknown (Capabilities.model_path and Harness.base_weights_path are None)"
    if not Path(path).is_dir():
        return f"the served checkpoint {path} is not a folder on this host"
    return None


def _versioned(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
    if c.version_source is not VersionSource.NONE:
        return None
    return "capability version_source is NONE (answers carry no weight version)"


_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")
Body = Callable[["CheckContext"], Awaitable[None]]


class _Requires:
    def __init__(self, reqs: Sequence[Requirement]) -> None:
        self.reqs = tuple(reqs)

    @overload
    def __call__(self, target: Check) -> Check: ...

    @overload
    def __call__(self, target: _F) -> _F: ...

    def __call__(self, target: Any) -> Any:
        if isinstance(target, Check):
            return attrs.evolve(target, requirements=target.requirements + self.reqs)
        existing: tuple[Requirement, ...] = getattr(target, "__rb_requirements__", ())
        target.__rb_requirements__ = existing + self.reqs
        return target


def requires(
    *,
    pause_mode: PauseMode | Iterable[PauseMode] | None = None,
    any_pause_mode: bool = False,
    transport: WeightTransport | Iterable[WeightTransport] | None = None,
    any_transport: Iterable[WeightTransport] | None = None,
    abort: bool | None = None,
    seeded_sampling: bool | None = None,
    logprobs: bool | None = None,
    worker_pinning: bool | None = None,
    progress_probe: bool | None = None,
    batch_invariant: bool | None = None,
    greedy_decoding: bool | None = None,
    memory_release: bool | None = None,
    survives_failed_load: bool | None = None,
    min_workers: int | None = None,
    versioned: bool = False,
    served_checkpoint: bool = False,
    vocab_size: bool = False,
    max_context: bool = False,
    hooks: Sequence[str] = (),
    methods: Sequence[str] = (),
) -> _Requires:
    """Declare what a check needs; what is not there makes it skip (with the reason).

    * ``pause_mode`` / ``transport``: each given one must be declared in ``Capabilities``;
      ``any_pause_mode`` / ``any_transport``: at least one;
    * ``abort``, ``seeded_sampling``, ``logprobs``, ``worker_pinning``, ``progress_probe``,
      ``batch_invariant``, ``greedy_decoding``, ``memory_release``, ``survives_failed_load``:
      boolean capabilities;
    * ``min_workers``: the fleet has at least that many workers;
    * ``versioned``: answers carry a weight version (``version_source`` is not ``NONE``);
    * ``served_checkpoint``: the checkpoint the backend serves is a folder on this host
      (``Harness.base_weights_path``, else ``Capabilities.model_path``);
    * ``vocab_size`` / ``max_context``: the value is known (``Capabilities`` or ``Harness``);
    * ``hooks``: ``Harness`` attributes that must not be ``None``;
    * ``methods``: backend methods beyond the protocol (e.g. ``"expect_version"``).

    Usable above or below ``@check``.
    """
    reqs: list[Requirement] = []
    modes = [pause_mode] if isinstance(pause_mode, PauseMode) else list(pause_mode or ())
    reqs.extend(_pause_req(PauseMode(m)) for m in modes)
    if any_pause_mode:
        reqs.append(Requirement("any pause mode", _any_pause_mode))
    transports = [transport] if isinstance(transport, WeightTransport) else list(transport or ())
    reqs.extend(_transport_req(WeightTransport(t)) for t in transports)
    if any_transport is not None:
        wanted = frozenset(WeightTransport(t) for t in any_transport)
        names = sorted(t.value for t in wanted)

        def _any(c: Capabilities, h: Harness, b: RolloutBackend) -> str | None:
            return None if wanted & c.weight_transports else f"none of the weight transports {names} declared"

        reqs.append(Requirement(f"transport in {names}", _any))
    flags = {
        "abort": abort,
        "seeded_sampling": seeded_sampling,
        "logprobs": logprobs,
        "worker_pinning": worker_pinning,
        "progress_probe": progress_probe,
        "batch_invariant": batch_invariant,
        "greedy_decoding": greedy_decoding,
        "memory_release": memory_release,
        "survives_failed_load": survives_failed_load,
    }
    reqs.extend(_flag_req(k, v) for k, v in flags.items() if v is not None)
    if min_workers is not None:
        reqs.append(_min_workers_req(min_workers))
    if versioned:
        reqs.append(Requirement("version_source not NONE", _versioned))
    if served_checkpoint:
        reqs.append(Requirement("served checkpoint readable", _checkpoint_readable, Gap.WEIGHTS))
    if vocab_size:
        reqs.append(Requirement("vocab_size known", _vocab_known, Gap.LIMIT))
    if max_context:
        reqs.append(Requirement("max_context known", _context_known, Gap.LIMIT))
    reqs.extend(_hook_req(h) for h in hooks)
    reqs.extend(_method_req(m) for m in methods)
    return _Requires(reqs)


# -- checks -------------------------------------------------------------------------------------

#: Every check defined by the suite, in definition order (the order ``run_checks`` uses).
ALL_CHECKS: list[Check] = []


@attrs.frozen(eq=False)
class Check:
    """A conformance check. ``await check(factory, harness)`` runs it and returns a ``CheckResult``."""

    name: str
    body: Body
    group: str
    doc: str = ""
    requirements: tuple[Requirement, ...] = ()

    async def __call__(self, factory: BackendFactory, harness: Harness | None = None) -> CheckResult:
        return await run_check(self, factory, harness)

    def gaps(self, backend: RolloutBackend, harness: Harness) -> tuple[tuple[Gap, str], ...]:
        """Each unmet requirement: what kind of thing is missing, and the reason."""
        caps = backend.capabilities
        found = ((req.gap, req.missing(caps, harness, backend)) for req in self.requirements)
        return tuple((gap, reason) for gap, reason in found if reason)

    def skip_reason(self, backend: RolloutBackend, harness: Harness) -> str | None:
        reasons = [reason for _, reason in self.gaps(backend, harness)]
        return "; ".join(reasons) if reasons else None

    def __repr__(self) -> str:
        return f"<Check {self.name} [{self.group}]>"


def check(group: str, *, register: bool = True) -> Callable[[Body], Check]:
    """Turn ``async def check_x(ctx)`` into a registered :class:`Check` named ``x``."""

    def wrap(body: Body) -> Check:
        name = body.__name__.removeprefix("check_")
        doc = (body.__doc__ or "").strip()
        reqs: tuple[Requirement, ...] = getattr(body, "__rb_requirements__", ())
        c = Check(name=name, body=body, group=group, doc=doc, requirements=reqs)
        if register:
            ALL_CHECKS.append(c)
        return c

    return wrap


# -- context ------------------------------------------------------------------------------------


@attrs.define
class CheckContext:
    """What a check body gets: the backend under test, its factory, the harness, helpers."""

    backend: RolloutBackend
    factory: BackendFactory
    harness: Harness
    name: str
    measurements: dict[str, Any] = attrs.field(factory=dict)
    _counter: int = 0
    _token_time: float | None = None
    _started: list[asyncio.Task[Any]] = attrs.field(factory=list)

    @property
    def capabilities(self) -> Capabilities:
        return self.backend.capabilities

    @property
    def vocab_size(self) -> int | None:
        return self.capabilities.vocab_size or self.harness.vocab_size

    @property
    def max_context(self) -> int | None:
        return self.capabilities.max_context or self.harness.max_context

    def measure(self, key: str, value: Any) -> None:
        self.measurements[key] = _measure_value(value)

    def skip(self, reason: str) -> NoReturn:
        raise SkipCheck(reason)

    def request_id(self, tag: str = "") -> str:
        self._counter += 1
        return f"conf-{self.name}-{tag}{'-' if tag else ''}{self._counter}-{random.getrandbits(32):08x}"

    # -- prompts and requests --

    def prompts(self, n: int, *, min_len: int = 4, max_len: int = 24, seed: int = 0) -> list[tuple[int, ...]]:
        """``n`` deterministic pseudo-random prompts with ids in the harness's prompt-token range."""
        rng = random.Random(f"{self.name}:{seed}")
        lo, hi = self.token_range()
        max_len = self.clamp_prompt_len(max_len)
        min_len = min(min_len, max_len)
        return [tuple(rng.randrange(lo, hi) for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]

    def token_range(self) -> tuple[int, int]:
        hi = self.harness.max_prompt_token
        if self.vocab_size is not None:
            hi = min(hi, self.vocab_size)
        lo = min(self.harness.min_prompt_token, hi - 1)
        return max(lo, 0), hi

    def clamp_prompt_len(self, n: int) -> int:
        ctx = self.max_context
        return max(1, min(n, ctx // 4)) if ctx is not None else n

    def cap_new_tokens(self, prompt_len: int, wanted: int) -> int:
        ctx = self.max_context
        return max(1, min(wanted, ctx - prompt_len - 1)) if ctx is not None else wanted

    def greedy(self, max_new_tokens: int | None = None, **changes: Any) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens or self.harness.max_new_tokens, **changes)

    def request(self, prompt: Sequence[int], sampling: SamplingParams | None = None, tag: str = "") -> GenerateRequest:
        return GenerateRequest(
            input_ids=tuple(prompt),
            sampling=sampling or self.greedy(),
            request_id=self.request_id(tag),
            return_logprobs=self.capabilities.logprobs,
        )

    async def generate(
        self, prompt: Sequence[int], sampling: SamplingParams | None = None, tag: str = ""
    ) -> Generation:
        req = self.request(prompt, sampling, tag)
        gen = await self.backend.generate(req)
        validate_generation(self, req, gen)
        return gen

    async def generate_all(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        *,
        backend: RolloutBackend | None = None,
    ) -> list[Generation]:
        """Each prompt one after the other (no concurrency), on ``backend`` (default: the one under test)."""
        b = backend or self.backend
        out = []
        for p in prompts:
            req = self.request(p, sampling)
            gen = await b.generate(req)
            validate_generation(self, req, gen, answered_by=b)
            out.append(gen)
        return out

    def long_request(
        self, prompt: Sequence[int], max_new_tokens: int | None = None, tag: str = "long"
    ) -> GenerateRequest:
        wanted = max_new_tokens or self.harness.long_max_new_tokens
        return self.request(prompt, self.greedy(self.cap_new_tokens(len(prompt), wanted), ignore_eos=True), tag)

    async def token_time(self) -> float:
        """Seconds for prefill + ~8 tokens of a short prompt, measured once per check."""
        if self._token_time is None:
            prompt = self.prompts(1, min_len=8, max_len=8, seed=991)[0]
            t0 = time.perf_counter()
            await self.backend.generate(self.request(prompt, self.greedy(8, ignore_eos=True), "calibrate"))
            self._token_time = time.perf_counter() - t0
        return self._token_time

    async def let_run(self) -> None:
        """Sleep long enough for an in-flight request to have produced some tokens."""
        t = await self.token_time()
        await asyncio.sleep(max(0.05, 1.5 * t) + self.harness.progress_wait_s)

    def start(self, request: GenerateRequest) -> asyncio.Task[Generation]:
        return self.track(asyncio.ensure_future(self.backend.generate(request)))

    def track(self, task: asyncio.Task[_T]) -> asyncio.Task[_T]:
        """A task of this check's, cancelled at its end if it still runs."""
        self._started.append(task)
        return task

    async def settle(self) -> None:
        """Cancel and await every request a check started and left behind.

        A check that fails midway leaves its in-flight requests unawaited; when the backend
        closes they end in ``ConnectionFailed`` nobody retrieves ("Task exception was never
        retrieved", the 2026-12-02 H200 tier after the Dynamo ``pause_in_place`` failure).
        """
        for task in self._started:
            task.cancel()
        await asyncio.gather(*self._started, return_exceptions=True)

    def near_ties(self) -> bool:
        """Whether two runs of one request may part at a near tie (the engine is not batch
        invariant) and ``compare`` can tell one (top-2 logprobs are declared): ask for them, and
        pass ``near_ties`` to ``compare``."""
        caps = self.capabilities
        return not caps.batch_invariant and caps.logprobs and caps.top_logprobs >= 2

    # -- versions --

    def versioned(self) -> bool:
        return self.capabilities.version_source is not VersionSource.NONE


def validate_generation(
    ctx: CheckContext,
    req: GenerateRequest,
    gen: Generation,
    *,
    allow_abort: bool = False,
    answered_by: RolloutBackend | None = None,
) -> None:
    """Everything the protocol promises about one ``Generation``; ``CheckFailed`` names the breach.

    ``answered_by``: the backend that produced ``gen`` when it is not the one under test (an
    oracle); its own worker ids are the valid ones.
    """
    rid = req.request_id
    expect(isinstance(gen, Generation), f"{rid}: generate returned {type(gen).__name__}, not Generation")
    expect(gen.request_id == rid, f"{rid}: response carries request_id {gen.request_id!r}")
    expect(
        isinstance(gen.finish_reason, FinishReason), f"{rid}: finish_reason {gen.finish_reason!r} is not a FinishReason"
    )
    if not allow_abort:
        expect(gen.finish_reason is not FinishReason.ABORT, f"{rid}: unexpectedly aborted")
    n = len(gen.output_ids)
    limit = req.sampling.max_new_tokens
    expect(n <= limit, f"{rid}: {n} output tokens > max_new_tokens={limit}")
    expect(all(isinstance(t, int) and t >= 0 for t in gen.output_ids), f"{rid}: output ids are not ints >= 0")
    vocab = ctx.vocab_size
    if vocab is not None and ctx.capabilities.greedy_decoding:  # a simulator's random ids are no model's
        expect(all(t < vocab for t in gen.output_ids), f"{rid}: an output id is >= vocab size {vocab}")
    if gen.finish_reason is FinishReason.LENGTH:
        ctx_cap = ctx.max_context
        hit_context = ctx_cap is not None and len(req.input_ids) + n >= ctx_cap
        expect(n == limit or hit_context, f"{rid}: finish 'length' after {n} of max_new_tokens={limit}")
    if gen.finish_reason is FinishReason.STOP:
        expect(n >= 1, f"{rid}: finish 'stop' with no output token (the stop token is part of the output)")
        if isinstance(gen.matched_stop, int):  # a stop token (a stop string ends text, not ids)
            expect(
                gen.output_ids[-1] == gen.matched_stop,
                f"{rid}: matched_stop {gen.matched_stop} is not the last output id {gen.output_ids[-1]}",
            )
        if req.sampling.ignore_eos:
            raise CheckFailed(f"{rid}: finish 'stop' although ignore_eos=True")
    if gen.finish_reason is not FinishReason.ABORT and not req.sampling.ignore_eos:
        stops = set(req.sampling.stop_token_ids)
        early = [i for i, t in enumerate(gen.output_ids[:-1]) if t in stops]
        expect(
            not early, f"{rid}: stop token {gen.output_ids[early[0]] if early else None} at {early[:1]} did not stop"
        )
    if req.return_logprobs and ctx.capabilities.logprobs:
        expect(gen.logprobs is not None, f"{rid}: logprobs requested but None")
    if gen.logprobs is not None:
        expect(len(gen.logprobs) == n, f"{rid}: {len(gen.logprobs)} logprobs for {n} output ids")
        for i, lp in enumerate(gen.logprobs):
            expect(isinstance(lp, float) and math.isfinite(lp), f"{rid}: logprob[{i}]={lp!r} is not a finite float")
            expect(lp <= 1e-6, f"{rid}: logprob[{i}]={lp!r} > 0")
    expect(
        gen.prompt_tokens == len(req.input_ids), f"{rid}: prompt_tokens={gen.prompt_tokens}, sent {len(req.input_ids)}"
    )
    expect(
        0 <= gen.cached_tokens <= len(req.input_ids),
        f"{rid}: cached_tokens={gen.cached_tokens} outside [0, {len(req.input_ids)}]",
    )
    if gen.worker is not None:
        known = (answered_by or ctx.backend).workers
        expect(gen.worker in known, f"{rid}: served by unknown worker {gen.worker!r}")
    if ctx.versioned():
        expect(gen.weight_version is not None, f"{rid}: weight_version is None but version_source is not NONE")


def _around(g: Generation, j: int) -> str:
    return f"...{list(g.output_ids[max(0, j - 2) : j + 3])}... of {len(g.output_ids)} tokens, {g.finish_reason.value}"


def _not_a_near_tie(g: Generation, w: Generation, j: int, tolerance: float) -> str | None:
    """Why position ``j``, where ``g`` and ``w`` first differ, is not a near tie (``None`` if it is):
    each run's token must be in the other run's ``top_logprobs`` at ``j``, within ``tolerance`` of
    the logprob of the token that run chose."""
    if j >= min(len(g.output_ids), len(w.output_ids)):
        return "one run is longer (a length difference is not a near tie)"
    if g.top_logprobs is None or w.top_logprobs is None:
        return "no top_logprobs to tell a near tie"
    for run, chosen, other in ((g, g.output_ids[j], w.output_ids[j]), (w, w.output_ids[j], g.output_ids[j])):
        tops = dict(run.top_logprobs[j])  # type: ignore[index]  # checked not None above
        if chosen not in tops:
            return f"token {chosen} is not in its own run's top {len(tops)}"
        if other not in tops:
            return f"token {other} is not in the top {len(tops)} where the other run chose {chosen}"
        if tops[chosen] - tops[other] > tolerance:
            return (
                f"token {chosen} (logprob {tops[chosen]:.6g}) beat {other} ({tops[other]:.6g}) by more "
                f"than the tolerance {tolerance:.3g}"
            )
    return None


#: The largest logprob either pick of a near tie can have: two tokens about equally likely share at
#: most the whole mass, so each has at most about one half.
_TIE_CEILING = math.log(0.5)


def _could_be_a_near_tie(g: Generation, w: Generation, j: int, tolerance: float) -> str | None:
    """Why position ``j``, where ``g`` and ``w`` first differ, cannot be a near tie (``None`` if it
    could), from each run's own logprobs alone: each pick at most about one half likely, and the two
    within ``tolerance`` of each other (about the same chance in about the same distribution)."""
    if j >= min(len(g.output_ids), len(w.output_ids)):
        return "one run is longer (a length difference is not a near tie)"
    if g.logprobs is None or w.logprobs is None:
        return "no logprobs to judge a near tie by"
    a, b = g.logprobs[j], w.logprobs[j]
    for token, lp in ((g.output_ids[j], a), (w.output_ids[j], b)):
        if lp > _TIE_CEILING + tolerance:
            return f"token {token} was picked with logprob {lp:.6g}, above log(1/2) + tolerance: no tie"
    if abs(a - b) > tolerance:
        return f"the two picks' logprobs {a:.6g} and {b:.6g} differ by more than the tolerance {tolerance:.3g}"
    return None


def compare(
    got: Sequence[Generation],
    want: Sequence[Generation],
    *,
    what: str,
    tolerance: float,
    ctx: CheckContext | None = None,
    key: str = "max_abs_dlogprob",
    near_ties: bool = False,
    ties_unseen: bool = False,
) -> float:
    """Identical ids, logprobs within ``tolerance``; returns the largest |Δlogprob| seen.

    With ``near_ties``, a pair may differ from one position on where that position is a near tie
    (``_not_a_near_tie``): two tokens whose logprobs are within ``tolerance``, so that arithmetic
    differences the tolerance accepts can flip a greedy pick (a retracted request's KV recomputed
    in another batch shape: the smg ``pause_retract`` divergence of the H200 run of 2026-12-03
    16:01). Everything before it must still be equal; nothing after it is compared (the runs no
    longer share a context). ``ctx`` records where under ``near_tie_at``.

    With ``ties_unseen`` (the runs may part at a near tie, but the backend gives no top logprobs to
    tell one: dynamo.vllm 1.4.2, whose ``pause_retract`` run parted at position 141 of 192 where
    vLLM direct, with top logprobs, showed a near tie; H100 GPU tier of 2026-12-05), a first
    difference that could be one (``_could_be_a_near_tie``) skips the check through ``ctx``: it
    cannot tell a near tie from a bug there. One that cannot be a near tie fails.
    """
    expect(len(got) == len(want), f"{what}: {len(got)} results vs {len(want)}")
    worst = 0.0
    ties: list[str] = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        upto = len(g.output_ids)
        if g.output_ids != w.output_ids:
            j = next((k for k, (a, b) in enumerate(zip(g.output_ids, w.output_ids, strict=False)) if a != b), None)
            j = j if j is not None else min(len(g.output_ids), len(w.output_ids))
            why = _not_a_near_tie(g, w, j, tolerance) if near_ties else None
            if ties_unseen:
                why = _could_be_a_near_tie(g, w, j, tolerance)
                if why is None and ctx is None:
                    why = "it could be one, but there is no check context to skip through"
                if why is None:
                    assert ctx is not None
                    ctx.skip(
                        f"{what}: case {i} parts at position {j} of {upto} (got {_around(g, j)}, want "
                        f"{_around(w, j)}), where both picks are unsure enough to be a near tie; without "
                        "top logprobs (not declared) a near tie cannot be told from a bug"
                    )
            if (not near_ties and not ties_unseen) or why is not None:
                raise CheckFailed(
                    f"{what}: case {i} output ids differ at position {j} (got {_around(g, j)}, want {_around(w, j)})"
                    + (f"; not a near tie: {why}" if why else "")
                )
            ties.append(f"case {i} at {j} of {upto}")
            upto = j
        if g.logprobs is not None and w.logprobs is not None:
            for a, b in zip(g.logprobs[:upto], w.logprobs[:upto], strict=True):
                worst = max(worst, abs(a - b))
    if ctx is not None:
        ctx.measure(key, max(worst, float(ctx.measurements.get(key, 0.0))))
        if ties:
            ctx.measure("near_tie_at", "; ".join(ties))
    expect(worst <= tolerance, f"{what}: max |Δlogprob| {worst:.3g} > tolerance {tolerance:.3g}")
    return worst


# -- running --------------------------------------------------------------------------------------


def _unknown_limits(ctx: CheckContext) -> str:
    missing = [
        what
        for what, v in (("the vocabulary size", ctx.vocab_size), ("the context length", ctx.max_context))
        if v is None
    ]
    return " and ".join(missing) + (" are" if len(missing) > 1 else " is") if missing else ""


def raised_by_backend(exc: BaseException, backend: RolloutBackend) -> bool:
    """Whether ``exc`` passed through a method of ``backend`` (the backend under test) on its way up.

    Every frame of the traceback is looked at: one whose ``self`` is the backend means the exception
    came out of a backend call (an oracle from ``Harness.fresh_factory_on`` is another object, so
    its errors stay the harness's).
    """
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_locals.get("self") is backend:
            return True
        tb = tb.tb_next
    return False


async def _cleanup(backend: RolloutBackend) -> str | None:
    problems = []
    if backend.capabilities.pause_modes:
        try:
            await asyncio.wait_for(backend.resume(), 30)
        except Exception as exc:
            problems.append(f"resume during cleanup failed: {type(exc).__name__}: {exc}")
    try:
        await asyncio.wait_for(backend.aclose(), 60)
    except Exception as exc:
        problems.append(f"aclose failed: {type(exc).__name__}: {exc}")
    return "; ".join(problems) or None


def _verdict_on(exc: Exception, backend: RolloutBackend, ctx: CheckContext, harness: Harness) -> tuple[Outcome, str]:
    """What a check's body raising ``exc`` (other than ``SkipCheck``) makes of the check: FAIL where
    the backend is wrong, ERROR where the setup or the harness is."""
    if isinstance(exc, CheckFailed):
        return Outcome.FAIL, str(exc)
    if isinstance(exc, RolloutBackendError):
        unknown = _unknown_limits(ctx)
        if isinstance(exc, InvalidRequest) and unknown:
            # The suite built the request within what it knew; with the limits unknown, a
            # refusal says the setup lacks them, not that the backend is wrong.
            return (
                Outcome.ERROR,
                f"setup: the backend refused a request the suite built ({exc}) while {unknown} "
                "unknown: give them (--rb-vocab-size / --rb-max-context, or Harness.vocab_size / "
                "max_context), or let the adapter discover them",
            )
        return Outcome.FAIL, f"backend raised {type(exc).__name__}: {exc}"
    if isinstance(exc, asyncio.TimeoutError):
        return Outcome.FAIL, f"timed out (Harness.check_timeout_s={harness.check_timeout_s}s): the backend hung"
    if isinstance(exc, AssertionError):
        return Outcome.FAIL, str(exc) or "assertion failed"
    if isinstance(exc, HarnessError):
        return Outcome.ERROR, f"harness: {exc}"
    if raised_by_backend(exc, backend):
        # Not a typed error, but the backend's: e.g. a plain ValueError out of the
        # adapter's own parsing is the adapter's bug, not the harness's.
        return Outcome.FAIL, f"backend raised {type(exc).__name__} (not a RolloutBackendError): {exc}"
    return Outcome.ERROR, f"{type(exc).__name__}: {exc}"


async def run_check(
    c: Check, factory: BackendFactory, harness: Harness | None = None, *, label: str | None = None
) -> CheckResult:
    """Open a backend with ``factory``, run one check on it, close it; never raises (but cancels)."""
    harness = harness or Harness()
    t0 = time.perf_counter()

    def result(
        outcome: Outcome,
        message: str = "",
        tb: str | None = None,
        meas: Mapping[str, Any] | None = None,
        gaps: tuple[tuple[Gap, str], ...] = (),
    ) -> CheckResult:
        return CheckResult(
            name=c.name,
            outcome=outcome,
            message=message,
            duration_s=time.perf_counter() - t0,
            measurements=dict(meas or {}),
            traceback=tb,
            backend=label,
            gaps=gaps,
        )

    try:
        backend = await asyncio.wait_for(factory(), harness.open_timeout_s)
    except Exception as exc:
        return result(Outcome.ERROR, f"the backend factory failed: {type(exc).__name__}: {exc}", traceback.format_exc())
    ctx: CheckContext | None = None
    outcome: CheckResult
    try:
        gaps = c.gaps(backend, harness)
        if gaps:
            outcome = result(Outcome.SKIP, "; ".join(reason for _, reason in gaps), gaps=gaps)
        else:
            ctx = CheckContext(backend=backend, factory=factory, harness=harness, name=c.name)
            try:
                await asyncio.wait_for(c.body(ctx), harness.check_timeout_s)
            except SkipCheck as exc:
                outcome = result(Outcome.SKIP, exc.reason, meas=ctx.measurements, gaps=((Gap.CHECK, exc.reason),))
            except Exception as exc:
                verdict, message = _verdict_on(exc, backend, ctx, harness)
                outcome = result(verdict, message, traceback.format_exc(), ctx.measurements)
            else:
                outcome = result(Outcome.PASS, meas=ctx.measurements)
    finally:
        if ctx is not None:
            await ctx.settle()
        problem = await _cleanup(backend)
    if problem and outcome.outcome is Outcome.PASS:
        outcome = attrs.evolve(outcome, outcome=Outcome.FAIL, message=problem)
    return outcome


def select_checks(
    select: Iterable[str | Check] | None = None,
    exclude: Iterable[str | Check] | None = None,
    checks: Sequence[Check] | None = None,
) -> list[Check]:
    """Checks by name, ``fnmatch`` pattern (``"pause_*"``) or group name; ``None`` = all.

    An entry that matches nothing raises ``ValueError`` (a typo would otherwise run nothing).
    """
    pool = list(checks if checks is not None else ALL_CHECKS)

    def matches(entry: str | Check) -> list[Check]:
        if isinstance(entry, Check):
            return [entry]
        return [c for c in pool if c.group == entry or fnmatch.fnmatchcase(c.name, entry)]

    if select is None:
        chosen = pool
    else:
        chosen = []
        for entry in select:
            found = matches(entry)
            if not found:
                raise ValueError(f"no check matches {entry!r} (checks: {[c.name for c in pool]})")
            chosen.extend(c for c in found if c not in chosen)
    if exclude is not None:
        dropped = {id(c) for entry in exclude for c in matches(entry)}
        chosen = [c for c in chosen if id(c) not in dropped]
    return chosen


async def run_checks(
    factory: BackendFactory,
    harness: Harness | None = None,
    *,
    select: Iterable[str | Check] | None = None,
    exclude: Iterable[str | Check] | None = None,
    label: str | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> Report:
    """Run the selected checks one after the other, each on a backend of its own from ``factory``.

    Usable without pytest::

        report = await run_checks(lambda: rb.open_backend(url), Harness(alt_weights_path=...))
        print(report.summary()); report.raise_for_failures()
    """
    chosen = select_checks(select, exclude)
    t0 = time.perf_counter()
    results = []
    for c in chosen:
        r = await run_check(c, factory, harness, label=label)
        results.append(r)
        if on_result is not None:
            on_result(r)
    return Report(results=tuple(results), backend=label, duration_s=time.perf_counter() - t0)
