"""Ratios with intervals, and verdicts that wait for them.

A benchmark row is timed once per *block* (one step of the workload, every row once, in a
shuffled order), so row ``a``'s step ``k`` and the baseline's step ``k`` did the same work at
nearly the same time. The ratio of two rows is the ratio of their total wall-clock over the
blocks both finished; its 95 % interval comes from a bootstrap over blocks (resampling whole
blocks keeps the pairing). A target such as "<= 1.03x" is **met** only when the whole interval is at
or under the bound, **missed** only when it is wholly over it, and otherwise *not decided*, with an
estimate of the blocks still needed (the interval narrows about as ``1/sqrt(n)``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import attrs

__all__ = ["Interval", "Verdict", "judge", "paired_ratio"]

#: Resamples per interval: the bounds move by well under 0.5 % between seeds at this count.
RESAMPLES = 4000


@attrs.frozen(slots=True)
class Interval:
    """``estimate`` (ratio of sums) with a ``level`` bootstrap interval over ``blocks`` paired blocks."""

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
    seed: int | str = 0,
    resamples: int = RESAMPLES,
    level: float = 0.95,
) -> Interval:
    """``sum(values) / sum(baseline)`` over paired blocks, with a percentile bootstrap interval.

    ``values[k]`` and ``baseline[k]`` are the same block. Fewer than two blocks give an interval
    as wide as the data allows (``[nan, nan]`` for none, the point itself for one is *not* an
    interval: ``low``/``high`` are ``-inf``/``inf``), so nothing is judged on one sample.
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
    rng = random.Random(seed)
    idx = range(n)
    draws = []
    for _ in range(resamples):
        pick = rng.choices(idx, k=n)
        draws.append(sum(values[i] for i in pick) / sum(baseline[i] for i in pick))
    draws.sort()
    tail = (1.0 - level) / 2
    lo = draws[max(0, math.floor(tail * resamples))]
    hi = draws[min(resamples - 1, math.ceil((1.0 - tail) * resamples) - 1)]
    return Interval(estimate, lo, hi, n, level)


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
    # The half-width shrinks about as 1/sqrt(n): n * (hw / gap)^2 blocks make it fit inside the gap.
    needed = math.ceil(interval.blocks * (interval.half_width / gap) ** 2)
    return Verdict(goal, bound, interval, "not decided", max(1, needed - interval.blocks))
