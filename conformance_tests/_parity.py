"""Parity: the same greedy requests on several backends, and against a transformers forward pass.

Every case runs on cold caches (``flush_cache`` on each backend before each prompt), one request
at a time, so that neither prefix reuse nor batching enters the comparison.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rollout_backends import GenerateRequest, Generation, RolloutBackend, SamplingParams

from ._core import (
    CheckContext,
    CheckResult,
    Outcome,
    check,
    expect,
    requires,
)
from ._harness import BackendFactory

__all__ = [
    "HFParity",
    "PairParity",
    "ParityReport",
    "check_hf_logprob_parity",
    "check_parity",
    "default_parity_prompts",
    "hf_logprobs",
    "pair_parity",
]


@attrs.frozen(kw_only=True)
class PairParity:
    """Two backends compared on every case."""

    a: str
    b: str
    ids_equal: bool
    #: ``(case index, token index)`` of the first differing output id, if any.
    first_mismatch: tuple[int, int] | None
    #: Largest |Δlogprob| over the positions where both produced the same ids so far.
    max_abs_dlogprob: float
    tolerance: float
    #: Alternatives per token compared (``Generation.top_logprobs``; 0: one side has none).
    top_logprobs_compared: int = 0
    #: ``(case, token index)`` where the top alternatives differ beyond a tie at the cut-off.
    top_mismatch: tuple[int, int] | None = None
    #: Largest |Δlogprob| over the alternatives both list (and the prompt's, where compared).
    max_abs_dtop_logprob: float = 0.0
    #: Whether both sides returned prompt logprobs (``Generation.prompt_logprobs``) to compare.
    prompt_logprobs_compared: bool = False
    max_abs_dprompt_logprob: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.ids_equal
            and self.top_mismatch is None
            and max(self.max_abs_dlogprob, self.max_abs_dtop_logprob, self.max_abs_dprompt_logprob) <= self.tolerance
        )

    def result(self) -> CheckResult:
        if self.ok:
            msg = ""
        elif self.first_mismatch is not None:
            msg = f"greedy ids differ at case {self.first_mismatch[0]}, token {self.first_mismatch[1]}"
        elif self.top_mismatch is not None:
            case, token = self.top_mismatch
            msg = f"top-{self.top_logprobs_compared} alternatives differ at case {case}, token {token}"
        elif self.max_abs_dlogprob > self.tolerance:
            msg = f"max |Δlogprob| {self.max_abs_dlogprob:.3g} > tolerance {self.tolerance:.3g}"
        elif self.max_abs_dtop_logprob > self.tolerance:
            msg = f"max |Δ top logprob| {self.max_abs_dtop_logprob:.3g} > tolerance {self.tolerance:.3g}"
        else:
            msg = f"max |Δ prompt logprob| {self.max_abs_dprompt_logprob:.3g} > tolerance {self.tolerance:.3g}"
        measurements: dict[str, Any] = {"max_abs_dlogprob": self.max_abs_dlogprob, "tolerance": self.tolerance}
        measurements["top_logprobs_compared"] = self.top_logprobs_compared
        if self.top_logprobs_compared:
            measurements["max_abs_dtop_logprob"] = self.max_abs_dtop_logprob
        measurements["prompt_logprobs_compared"] = self.prompt_logprobs_compared
        if self.prompt_logprobs_compared:
            measurements["max_abs_dprompt_logprob"] = self.max_abs_dprompt_logprob
        return CheckResult(
            name=f"parity[{self.a}~{self.b}]",
            outcome=Outcome.PASS if self.ok else Outcome.FAIL,
            message=msg,
            measurements=measurements,
        )


@attrs.frozen(kw_only=True)
class HFParity:
    """One backend's logprobs against a transformers forward pass over its own output ids."""

    backend: str
    max_abs_dlogprob: float
    mean_abs_dlogprob: float
    tokens: int
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_dlogprob <= self.tolerance

    def result(self) -> CheckResult:
        return CheckResult(
            name=f"parity[{self.backend}~transformers]",
            outcome=Outcome.PASS if self.ok else Outcome.FAIL,
            message="" if self.ok else f"max |Δlogprob| {self.max_abs_dlogprob:.3g} > tolerance {self.tolerance:.3g}",
            measurements={
                "max_abs_dlogprob": self.max_abs_dlogprob,
                "mean_abs_dlogprob": self.mean_abs_dlogprob,
                "tokens": self.tokens,
                "tolerance": self.tolerance,
            },
        )


@attrs.frozen(kw_only=True)
class ParityReport:
    names: tuple[str, ...]
    cases: int
    pairs: tuple[PairParity, ...]
    hf: tuple[HFParity, ...]
    duration_s: float
    #: ``{backend: [Generation per case]}``.
    outputs: Mapping[str, tuple[Generation, ...]] = attrs.field(factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.pairs) and all(h.ok for h in self.hf)

    def results(self) -> tuple[CheckResult, ...]:
        """One ``CheckResult`` per pair and per transformers comparison (for reports and pytest)."""
        return tuple(p.result() for p in self.pairs) + tuple(h.result() for h in self.hf)

    def summary(self) -> str:
        head = f"parity of {', '.join(self.names)} on {self.cases} cases ({self.duration_s:.1f}s)"
        return "\n".join([head, *(r.line() for r in self.results())])


def default_parity_prompts(vocab_size: int | None, n: int = 8, *, low: int = 1) -> list[tuple[int, ...]]:
    """Deterministic prompts of 1..57 tokens with ids in ``[low, min(vocab, 4096))``."""
    import random

    rng = random.Random("rollout-backends-parity")
    hi = min(vocab_size or 4096, 4096)
    lengths = [1, 3, 8, 17, 32, 57, 5, 12][:n] + [rng.randint(1, 57) for _ in range(max(0, n - 8))]
    return [tuple(rng.randrange(low, hi) for _ in range(k)) for k in lengths]


_HF_CACHE: dict[str, Any] = {}


def _hf_model(path: str) -> Any:
    model = _HF_CACHE.get(path)
    if model is None:
        import torch
        from transformers import AutoModelForCausalLM

        # Load in the checkpoint's dtype, then compute in float32 (bf16 -> fp32 is exact).
        loaded: Any = AutoModelForCausalLM.from_pretrained(path)
        model = loaded.to(dtype=torch.float32)
        model.eval()
        _HF_CACHE.clear()  # keep at most one model resident
        _HF_CACHE[path] = model
    return model


def hf_logprobs(model_path: str, prompt: Sequence[int], output_ids: Sequence[int]) -> list[float]:
    """log p(output_ids[i] | prompt + output_ids[:i]) from one float32 transformers forward pass."""
    import torch

    model = _hf_model(model_path)
    ids = torch.tensor([list(prompt) + list(output_ids)], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    start = len(prompt) - 1
    logp = torch.log_softmax(logits[start : start + len(output_ids)], dim=-1)
    picked = logp.gather(1, torch.tensor(list(output_ids), dtype=torch.long).unsqueeze(1)).squeeze(1)
    return [float(x) for x in picked]


async def hf_parity(
    name: str, model_path: str, prompts: Sequence[Sequence[int]], gens: Sequence[Generation], tol: float
) -> HFParity:
    deltas: list[float] = []
    for p, g in zip(prompts, gens, strict=True):
        if not g.output_ids or g.logprobs is None:
            continue
        ref = await asyncio.to_thread(hf_logprobs, model_path, p, g.output_ids)
        deltas.extend(abs(a - b) for a, b in zip(g.logprobs, ref, strict=True))
    return HFParity(
        backend=name,
        max_abs_dlogprob=max(deltas, default=0.0),
        mean_abs_dlogprob=sum(deltas) / len(deltas) if deltas else 0.0,
        tokens=len(deltas),
        tolerance=tol,
    )


#: Alternatives per token that parity asks for where a backend declares them (``_parity_sampling``).
PARITY_TOP_LOGPROBS = 3


def _top_differs(
    x: Sequence[tuple[int, float]], y: Sequence[tuple[int, float]], k: int, tol: float
) -> tuple[bool, float]:
    """Whether two top-``k`` lists (most likely first) differ beyond a tie at the cut-off, and the
    largest |Δlogprob| over the ids both list. An id only one side lists is a tie when its logprob
    is within ``tol`` of the other side's k-th (two engines may cut a tie differently)."""
    xs, ys = dict(x[:k]), dict(y[:k])
    worst = max((abs(xs[t] - ys[t]) for t in xs.keys() & ys.keys()), default=0.0)
    for mine, other in ((xs, ys), (ys, xs)):
        floor = min(other.values(), default=float("-inf"))
        if any(abs(lp - floor) > tol for t, lp in mine.items() if t not in other):
            return True, worst
    return len(xs) != len(ys), worst


def pair_parity(a: str, b: str, ga: Sequence[Generation], gb: Sequence[Generation], tol: float) -> PairParity:
    """Two runs of the same cases compared: ``ga[i]`` with ``gb[i]`` (ids equal, |Δlogprob| <= ``tol``
    over the ids they share before the first difference; where both carry them, the top
    alternatives of those positions and the prompt's logprobs too). ``check_parity`` uses it across
    backends, the GPU tier (``bench/rb_bench/gpu_tier.py``) for one backend's cold and warm runs."""
    worst = worst_top = worst_prompt = 0.0
    mismatch: tuple[int, int] | None = None
    top_mismatch: tuple[int, int] | None = None
    top_k: int | None = None
    prompt_compared = bool(ga) and all(
        x.prompt_logprobs is not None and y.prompt_logprobs is not None for x, y in zip(ga, gb, strict=True)
    )
    for case, (x, y) in enumerate(zip(ga, gb, strict=True)):
        if x.top_logprobs is not None and y.top_logprobs is not None:
            widths = [len(t) for t in (*x.top_logprobs, *y.top_logprobs)]
            k = min(widths, default=top_k or 0)
            top_k = k if top_k is None else min(top_k, k)
        else:
            top_k = 0
        if prompt_compared:
            assert x.prompt_logprobs is not None and y.prompt_logprobs is not None
            for p, q in zip(x.prompt_logprobs, y.prompt_logprobs, strict=False):
                if p is not None and q is not None:
                    worst_prompt = max(worst_prompt, abs(p - q))
        n = min(len(x.output_ids), len(y.output_ids))
        j = next((k for k in range(n) if x.output_ids[k] != y.output_ids[k]), None)
        if j is None and len(x.output_ids) != len(y.output_ids):
            j = n
        if j is not None and mismatch is None:
            mismatch = (case, j)
        upto = n if j is None else j
        if x.logprobs is not None and y.logprobs is not None:
            for k in range(upto):
                worst = max(worst, abs(x.logprobs[k] - y.logprobs[k]))
        if x.top_logprobs is not None and y.top_logprobs is not None and top_k:
            for k in range(min(upto, len(x.top_logprobs), len(y.top_logprobs))):
                differs, d = _top_differs(x.top_logprobs[k], y.top_logprobs[k], top_k, tol)
                worst_top = max(worst_top, d)
                if differs and top_mismatch is None:
                    top_mismatch = (case, k)
    return PairParity(
        a=a,
        b=b,
        ids_equal=mismatch is None,
        first_mismatch=mismatch,
        max_abs_dlogprob=worst,
        tolerance=tol,
        top_logprobs_compared=top_k or 0,
        top_mismatch=top_mismatch,
        max_abs_dtop_logprob=worst_top,
        prompt_logprobs_compared=prompt_compared,
        max_abs_dprompt_logprob=worst_prompt,
    )


async def parity_outputs(
    backend: RolloutBackend, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16
) -> tuple[Generation, ...]:
    """Greedy generations of ``prompts`` on cold caches (what each backend gives ``check_parity``),
    with top alternatives and the prompt's logprobs where the backend declares them."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    return tuple(await _run_cold(backend, prompts, sampling))


async def _run_cold(
    backend: RolloutBackend, prompts: Sequence[Sequence[int]], sampling: SamplingParams
) -> list[Generation]:
    caps = backend.capabilities
    top = min(PARITY_TOP_LOGPROBS, caps.top_logprobs) if caps.logprobs else 0
    if top:
        sampling = attrs.evolve(sampling, top_logprobs=top)
    out = []
    for i, p in enumerate(prompts):
        await backend.flush_cache()
        out.append(
            await backend.generate(
                GenerateRequest(
                    input_ids=tuple(p),
                    sampling=sampling,
                    request_id=f"conf-parity-{i}-{time.monotonic_ns()}",
                    prompt_logprobs_start=0 if caps.prompt_logprobs and caps.logprobs else None,
                )
            )
        )
    return out


async def check_parity(
    factories: Mapping[str, BackendFactory],
    prompts: Sequence[Sequence[int]] | None = None,
    *,
    max_new_tokens: int = 16,
    tolerance: float = 1e-3,
    hf_model_path: str | None = None,
    hf_tolerance: float = 2e-2,
) -> ParityReport:
    """Greedy parity across backends (ids identical, |Δlogprob| <= ``tolerance``) and, with
    ``hf_model_path``, each backend's logprobs against transformers (<= ``hf_tolerance``).

    Measured numbers are in the report whatever the outcome; ``report.ok`` says whether all held.
    Backends are opened one at a time (``factory()``) and closed after their cases.
    """
    t0 = time.perf_counter()
    names = tuple(factories)
    if not names:
        raise ValueError("check_parity needs at least one backend factory")
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    outputs: dict[str, tuple[Generation, ...]] = {}
    chosen: list[tuple[int, ...]] | None = [tuple(p) for p in prompts] if prompts is not None else None
    for name in names:
        backend = await factories[name]()
        try:
            if chosen is None:
                chosen = default_parity_prompts(backend.capabilities.vocab_size)
            outputs[name] = tuple(await _run_cold(backend, chosen, sampling))
        finally:
            await backend.aclose()
    assert chosen is not None
    pairs = tuple(pair_parity(a, b, outputs[a], outputs[b], tolerance) for a, b in itertools.combinations(names, 2))
    hf: tuple[HFParity, ...] = ()
    if hf_model_path is not None:
        hf = tuple([await hf_parity(n, hf_model_path, chosen, outputs[n], hf_tolerance) for n in names])
    return ParityReport(
        names=names, cases=len(chosen), pairs=pairs, hf=hf, duration_s=time.perf_counter() - t0, outputs=outputs
    )


@check("parity")
@requires(logprobs=True, hooks=("hf_model_path",))
async def check_hf_logprob_parity(ctx: CheckContext) -> None:
    """Greedy logprobs (cold cache) equal a float32 transformers forward pass within ``hf_logprob_tolerance``."""
    path = ctx.harness.hf_model_path
    assert path is not None
    prompts = default_parity_prompts(ctx.vocab_size, low=ctx.harness.min_prompt_token)
    gens = await _run_cold(ctx.backend, prompts, ctx.greedy(16))
    result = await hf_parity("backend", path, prompts, gens, ctx.harness.hf_logprob_tolerance)
    ctx.measure("max_abs_dlogprob", result.max_abs_dlogprob)
    ctx.measure("mean_abs_dlogprob", result.mean_abs_dlogprob)
    ctx.measure("tokens", result.tokens)
    expect(result.tokens > 0, "no token to compare")
    expect(
        result.ok, f"max |Δlogprob| vs transformers {result.max_abs_dlogprob:.3g} > tolerance {result.tolerance:.3g}"
    )
