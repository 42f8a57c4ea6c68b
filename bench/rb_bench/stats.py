"""Ratios with intervals, and verdicts that wait for them.

A benchmark row is timed once per *block* (one step of the workload, every row once, in a
shuffled order), so row ``a``'s step ``k`` and the baseline's step ``k`` did the same work at
nearly the same time. The ratio of two rows is the ratio of their total wall-clock over the
blocks both finished; its 95 % interval is the ratio estimator's: the standard error from the
paired residuals ``values[k] - R * baseline[k]`` (the delta method, which keeps the pairing) times
Student's t with ``n - 1`` degrees of freedom. A target such as "<= 1.03x" is **met** only when the
whole interval is at or under the bound, **missed** only when it is wholly over it, and otherwise
*not decided*, with an estimate of the blocks still needed (the interval narrows about as
``1/sqrt(n)``).

Why not the percentile bootstrap over blocks used until 2026-12-06: with the few blocks a GPU
session affords it covers far less than it says, because its interval never reaches past the
ratios of the blocks it drew. Simulated (paired lognormal times, block spread 0.2, pair noise 0.12,
400 trials each; ``tests/test_bench_fanout.py`` keeps the check): 3 blocks 71 %, 5 blocks 88.5 %,
10 blocks 90.5 %, 20 blocks 93 %; this interval 93 %, 97 %, 96 %, 95 %.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

__all__ = ["Interval", "Verdict", "judge", "paired_ratio", "t_quantile"]


@attrs.frozen(slots=True)
class Interval:
    """``estimate`` (ratio of sums) with a ``level`` interval over ``blocks`` paired blocks."""

    estimate: float
    low: float
    high: float
    blocks: int
    level: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def format(self, digits: int = 3) -> str:
        if math.isnan(self.estimate):
            return "—"
        times = "\N{MULTIPLICATION SIGN}"
        return f"{self.estimate:.{digits}f}{times} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def paired_ratio(
    values: Sequence[float],
    baseline: Sequence[float],
    *,
    level: float = 0.95,
) -> Interval:
    """``sum(values) / sum(baseline)`` over paired blocks, with a ``level`` interval from the ratio
    estimator's standard error and Student's t (see the module's docstring).

    ``values[k]`` and ``baseline[k]`` are the same block. Fewer than two blocks give an interval
    as wide as the data allows (``[nan, nan]`` for none, the point itself for one is *not* an
    interval: ``low``/``high`` are ``-inf``/``inf``), so nothing is judged on one sample; with two
    the t quantile (12.7 at 95 %) makes it wide on purpose.
    """
    if len(values) != len(baseline):
        raise ValueError(f"paired samples differ in length: {len(values)} vs {len(baseline)}")
    n = len(values)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, level)
    if any(b <= 0 for b in baseline) or any(v < 0 for v in values):
        raise ValueError("times must be positive")
    estimate = sum(values) / sum(baseline)
    if n == 1:
        return Interval(estimate, -math.inf, math.inf, 1, level)
    mean_base = sum(baseline) / n
    residuals = [v - estimate * b for v, b in zip(values, baseline, strict=True)]
    se = math.sqrt(sum(r * r for r in residuals) / ((n - 1) * n)) / mean_base
    half = t_quantile(0.5 + level / 2, n - 1) * se
    # A ratio of times is never negative; the upper end is left as the t interval makes it.
    return Interval(estimate, max(0.0, estimate - half), estimate + half, n, level)


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile ``P(T <= x) = p`` for ``df`` degrees of freedom, by bisection on the CDF
    (the tables' 12.706 for df 1 at p = 0.975, 2.776 for df 4, 1.960 as df grows; test_bench_fanout)."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if _t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


def _t_cdf(x: float, df: int) -> float:
    """``P(T <= x)`` for ``x >= 0``: ``1 - I_{df/(df+x^2)}(df/2, 1/2) / 2``."""
    return 1.0 - 0.5 * _betainc(df / 2.0, 0.5, df / (df + x * x))


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function ``I_x(a, b)``, by its continued fraction (Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast below this point
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f


@attrs.frozen(slots=True)
class Verdict:
    """A target ``row / baseline ≤ bound`` judged on an interval."""

    goal: str
    bound: float
    interval: Interval
    #: ``met`` | ``missed`` | ``not decided``
    state: str
    #: not decided: about how many more blocks would decide it (``None``: too close to call).
    more_blocks: int | None = None

    def format(self) -> str:
        where = self.interval.format()
        if self.state == "met":
            return f"MET: {self.goal}: {where}"
        if self.state == "missed":
            return f"MISSED: {self.goal}: {where}"
        more = (
            f"about {self.more_blocks} more blocks needed"
            if self.more_blocks is not None
            else "the estimate sits on the bound: more blocks will not settle it soon"
        )
        return f"NOT DECIDED: {self.goal}: {where}; {more}"


#: An estimate this close to its bound (relative) is reported as too close to call.
_TOO_CLOSE = 0.002


def judge(goal: str, interval: Interval, bound: float) -> Verdict:
    """Met when the interval lies at or under ``bound``, missed when wholly over it; else not decided."""
    if interval.blocks >= 2 and interval.high <= bound:
        return Verdict(goal, bound, interval, "met")
    if interval.blocks >= 2 and interval.low > bound:
        return Verdict(goal, bound, interval, "missed")
    gap = abs(interval.estimate - bound)
    if interval.blocks < 2 or not math.isfinite(interval.half_width):
        return Verdict(goal, bound, interval, "not decided", 2 - interval.blocks)
    if gap <= _TOO_CLOSE * bound or interval.half_width <= 0:
        return Verdict(goal, bound, interval, "not decided", None)
    return Verdict(goal, bound, interval, "not decided", _blocks_to_decide(interval, gap))


def _blocks_to_decide(interval: Interval, gap: float) -> int:
    """More blocks until the half-width ``t(n-1) * s / sqrt(n)`` fits inside ``gap``, at the spread
    ``s`` seen so far (the t quantile falls as blocks come, so ``n * (hw / gap)^2`` overstates it)."""
    n = interval.blocks
    q = 0.5 + interval.level / 2
    # The upper side: the lower end may be clamped at 0.
    spread = (interval.high - interval.estimate) * math.sqrt(n) / t_quantile(q, n - 1)

    def too_wide(more: int) -> bool:
        return t_quantile(q, n + more - 1) * spread / math.sqrt(n + more) > gap

    hi = 1
    while too_wide(hi) and hi < 1_000_000:
        hi *= 2
    lo = hi // 2  # too wide (or 0), while hi is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if too_wide(mid) else (lo, mid)
    return hi
