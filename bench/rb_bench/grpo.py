"""The GRPO loop of ``examples/grpo/grpo.py`` (colocated) on SGLang direct, smg, Dynamo round-robin
and Dynamo KV: per-step wall-clock split into rollout / train / sync, interleaved, with 95 %
intervals; each backend's reward curve; GPU memory.

* **Rows.** A row is a fleet of its own (one worker each, all on one GPU) and the loop over it:
  ``sglang direct`` (an SGLang server, no router), ``smg`` (an SGLang server behind ``smg
  --policy round_robin``), ``dynamo rr`` / ``dynamo kv`` (``dynamo.sglang`` through our shim behind
  a ``dynamo.frontend`` with that router mode). Each row's loop has its own policy (the same
  starting weights, seeds and prompts), so every row trains the same model on the same data.
* **Same engine settings.** The recipe (triton attention, pytorch sampling, no CUDA graphs, page
  16), ``--max-total-tokens`` (the pools share the GPU), ``--sleep-on-idle``, ``--stream-interval
  50`` and, with ``--deterministic`` (default on GPU), ``--enable-deterministic-inference`` (SGLang
  honours per-request sampling seeds only then: without it the rows sample differently from step 0).
* **Blocks.** A block is one GRPO step of every row, in a seeded random order; block 0 is a
  warm-up (kernel compiling) and leaves the timing, not the reward curve. A row's ratio to
  ``sglang direct`` is its total over the blocks both finished, with a 95 % t interval
  over blocks (``stats.paired_ratio``), per part (rollout, train, sync) and for the whole step.
  The sync share is a row's sync time over its step time (same interval). With ``--per-tensor``
  (default on) each row also pushes the same weights again per tensor after its step (the path
  before flat buckets; untimed in the step): the sync share *before*.
* **Targets** (issue 28): each Dynamo row's step ≤ 1.00 times ``sglang direct``'s with the interval's
  upper end ≤ 1.03; each row's sync ≤ 5 % of its step. Judged only when the interval says so.

CPU smoke (``--engine reference --smoke``): reference workers behind the same launchers, the tiny
model, two rows; the same code (``tests/test_bench_grpo.py``). GPU: ``tools/gpu/session.sh grpo``.
Several saved runs of the same workload and rows pool into one report, blocks paired within each run
(``--combine a/results.json b/results.json [--out DIR]``; runs nothing, needs no GPU, torch or SGLang).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs

from . import REPO_ROOT, report
from .fanout import MEM_FRACTION, RECIPE_FLAGS, _ready_printer, gpu_memory
from .stats import Interval, judge, paired_ratio

__all__ = [
    "BASELINE",
    "ROWS",
    "LaneResult",
    "RunResult",
    "combine",
    "first_difference",
    "load_example",
    "load_result",
    "main",
    "part_ratio",
    "pool",
    "sync_share",
    "tables",
    "verdicts",
]

KEY = "grpo"
ROWS = ("sglang direct", "smg", "dynamo rr", "dynamo kv")
BASELINE = "sglang direct"
PARTS = ("rollout", "train", "sync", "step")
PACKAGES = ("torch", "sglang", "ai-dynamo", "ai-dynamo-runtime", "smg", "transformers")
#: Issue 28: a Dynamo row's step against SGLang direct's (estimate, and the interval's upper end).
STEP_BOUND, STEP_UPPER = 1.00, 1.03
#: Issue 28: sync at most this share of a colocated step.
SYNC_SHARE = 0.05
TIMES = "\N{MULTIPLICATION SIGN}"
_TEARDOWN_S = 40.0


def load_example() -> ModuleType:
    """``examples/grpo/grpo.py``, loaded from the checkout (an example is a script, not a package)."""
    name = "rb_examples_grpo"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "examples" / "grpo" / "grpo.py")
    if spec is None or spec.loader is None:
        raise ImportError("examples/grpo/grpo.py not found in this checkout")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


# -- fleets: one per row -----------------------------------------------------------------------------


@attrs.frozen
class Settings:
    engine: str  #: sglang | reference
    model_path: str
    gpu: str
    kv_tokens: int
    deterministic: bool
    startup_timeout_s: float
    log_root: Path

    @property
    def on_gpu(self) -> bool:
        return self.engine == "sglang"

    def pool_flags(self) -> list[str]:
        """What every GPU worker gets besides the launchers' recipe: a capped KV pool (all share
        the GPU) and a scheduler that sleeps while another row runs."""
        return ["--max-total-tokens", str(self.kv_tokens), "--sleep-on-idle"]


class Side:
    """One row's fleet (one worker behind the row's entry) and the backend the loop drives."""

    def __init__(self, row: str, s: Settings) -> None:
        self.row, self.s = row, s
        self.backend: Any = None
        self._fleet: Any = None  # SGLang: the running fleet; Dynamo: the launcher's context
        self._running: Any = None

    async def start(self, progress: report.Progress) -> None:
        if self.row.startswith("dynamo"):
            await self._start_dynamo(progress)
        else:
            await self._start_sglang(progress)

    async def _start_sglang(self, progress: report.Progress) -> None:
        from rollout_backends.adapters.sglang import SGLangFleetConfig, start_sglang_fleet

        s = self.s
        cfg = SGLangFleetConfig(
            model_path=s.model_path,
            workers=1,
            worker_kind="sglang" if s.on_gpu else "reference",
            router="smg" if self.row == "smg" else "none",
            router_policy="round_robin",
            cuda_visible_devices=(s.gpu,) if s.on_gpu else None,
            mem_fraction_static=MEM_FRACTION if s.on_gpu else None,
            kv_events=s.on_gpu,  # every GPU fleet alike (the KV router needs them)
            deterministic_inference=s.deterministic and s.on_gpu,
            extra_server_args=[*s.pool_flags(), "--stream-interval", "50"] if s.on_gpu else (),
            log_dir=str(s.log_root / self.row.replace(" ", "-")),
            startup_timeout_s=s.startup_timeout_s,
        )
        self._fleet = await start_sglang_fleet(cfg, progress=_ready_printer(progress, self.row))
        self.backend = self._fleet.backend

    async def _start_dynamo(self, progress: report.Progress) -> None:
        from rollout_backends.adapters.dynamo import DynamoFleetConfig, launch_dynamo_fleet

        s = self.s
        cfg = DynamoFleetConfig(
            model_path=s.model_path,
            workers=1,
            worker_kind="sglang" if s.on_gpu else "reference",
            router_mode="kv" if self.row == "dynamo kv" else "round-robin",
            page_size=16,
            kv_events=s.on_gpu,  # our reference worker publishes none (approximate KV routing)
            gpus=(s.gpu,) if s.on_gpu else (),
            stream_interval=50 if s.on_gpu else None,
            sglang_args=[
                *RECIPE_FLAGS,
                *("--mem-fraction-static", str(MEM_FRACTION), *s.pool_flags()),
                *(["--enable-deterministic-inference"] if s.deterministic else []),
            ]
            if s.on_gpu
            else [],
            ready_timeout=s.startup_timeout_s,
        )
        self._fleet = launch_dynamo_fleet(
            cfg, log_dir=s.log_root / self.row.replace(" ", "-"), progress=_ready_printer(progress, self.row)
        )
        self._running = await self._fleet.__aenter__()
        self.backend = await self._running.connect()

    async def aclose(self) -> None:
        fleet, self._fleet = self._fleet, None
        if fleet is None:
            return
        with contextlib.suppress(Exception):
            if self._running is not None:
                await fleet.__aexit__(None, None, None)
            else:
                await fleet.aclose()


# -- the run: lanes stepping in blocks ---------------------------------------------------------------


@attrs.define
class Lane:
    """One row: its fleet, its loop and what each of its steps measured."""

    row: str
    side: Side
    loop: Any = None  # the example's GRPO
    steps: list[dict[str, Any]] = attrs.field(factory=list)
    error: str | None = None


def _digest(ids: Sequence[int]) -> str:
    return hashlib.blake2b(repr(tuple(ids)).encode(), digest_size=6).hexdigest()


async def per_tensor_push(loop: Any) -> float:
    """The same weights again, the way a loop pushed before flat buckets: the parameters cast to the
    engines' dtype and sent per tensor (one handle each), inside the transaction. Seconds."""
    t0 = time.perf_counter()
    dtype = loop.policy.engine_dtype
    named = [(n, t.detach().to(dtype)) for n, t in loop.policy.named_weights()]
    async with loop.backend.weight_update(loop.version) as tx:
        await tx.update_from_tensors(named)
    return time.perf_counter() - t0


def latency_spread(latencies: Sequence[float]) -> dict[str, float]:
    """The first, median and last answer of a rollout's requests (client-side latency, all sent at
    once): a router that admits a burst's requests late shows in the last, not the first."""
    xs = sorted(latencies)
    if not xs:
        return {}
    return {"latency_first_s": xs[0], "latency_median_s": statistics.median(xs), "latency_last_s": xs[-1]}


async def step_lane(lane: Lane, per_tensor: bool) -> None:
    record = await lane.loop.step()
    row: dict[str, Any] = {
        "step": record.step,
        "version": record.version,
        "rollout_s": record.rollout_s,
        "train_s": record.train_s,
        "sync_s": record.sync_s,
        "memory_s": record.memory_s,
        "step_s": record.step_s,
        "mean_reward": record.mean_reward,
        "loss": record.loss,
        "logprob_gap": record.logprob_gap,
        "digests": [_digest(s.output) for s in lane.loop.samples],
        **latency_spread([s.latency_s for s in lane.loop.samples]),
    }
    if per_tensor:
        row["per_tensor_sync_s"] = await per_tensor_push(lane.loop)
    lane.steps.append(row)


async def run_blocks(
    lanes: Sequence[Lane], blocks: int, deadline: float, per_tensor: bool, seed: int, progress: report.Progress
) -> int:
    """Block after block, each lane once in a seeded random order, while the budget lasts; a lane
    that fails leaves (its error is kept). Returns the blocks every remaining lane finished."""
    rng = random.Random(seed)
    done, last_block_s = 0, 0.0
    for b in range(blocks):
        alive = [x for x in lanes if x.error is None]
        if not alive or time.monotonic() + last_block_s * 1.2 + _TEARDOWN_S > deadline:
            progress(f"block {b}: stopping ({'no lane left' if not alive else 'time budget'})")
            break
        t0 = time.monotonic()
        rng.shuffle(alive)
        for lane in alive:
            try:
                await asyncio.wait_for(step_lane(lane, per_tensor), max(5.0, deadline - time.monotonic()))
            except Exception as exc:
                lane.error = f"block {b}: {report.summarise_error(exc)}"
                progress(f"{lane.row}: {lane.error}")
        last_block_s = time.monotonic() - t0
        done = b + 1
        summary = ", ".join(
            f"{x.row} {x.steps[-1]['step_s']:.2f}s r={x.steps[-1]['mean_reward']:.3f}" for x in alive if x.steps
        )
        progress(f"block {b} ({last_block_s:.1f} s): {summary}")
    return done


# -- results ----------------------------------------------------------------------------------------


@attrs.frozen
class LaneResult:
    row: str
    steps: tuple[dict[str, Any], ...]
    error: str | None = None
    #: Set where the lane pools several runs (``pool``): every run's timed steps in order, each
    #: run's warm-up left out; ``steps`` is then the first run's (reward curve, first sample unlike).
    timed_steps: tuple[dict[str, Any], ...] | None = None

    def series(self, part: str, *, timed: bool = True) -> list[float]:
        """``part`` (rollout, train, sync, step, per_tensor_sync) per step; ``timed`` drops block 0
        (pooled: the timed steps of every run; untimed: the first run's steps)."""
        key = f"{part}_s"
        if timed and self.timed_steps is not None:
            return [float(s[key]) for s in self.timed_steps if key in s]
        values = [float(s[key]) for s in self.steps if key in s]
        return values[1:] if timed else values


@attrs.frozen
class RunResult:
    lanes: tuple[LaneResult, ...]
    info: dict[str, Any] = attrs.field(factory=dict)
    #: The run's ``report.meta`` where it was read back from a ``results.json`` (``load_result``).
    meta: dict[str, Any] = attrs.field(factory=dict)

    def lane(self, row: str) -> LaneResult | None:
        return next((x for x in self.lanes if x.row == row), None)

    @property
    def pooled(self) -> bool:
        return any(x.timed_steps is not None for x in self.lanes)


def _paired(a: Sequence[float], b: Sequence[float]) -> Interval | None:
    n = min(len(a), len(b))
    return paired_ratio(a[:n], b[:n]) if n else None


def part_ratio(result: RunResult, row: str, part: str) -> Interval | None:
    """``row``'s ``part`` over the baseline's, paired by block (timed blocks only)."""
    a, b = result.lane(row), result.lane(BASELINE)
    if a is None or b is None:
        return None
    return _paired(a.series(part), b.series(part))


def sync_share(result: RunResult, row: str, *, before: bool = False) -> Interval | None:
    """Sync over step time; ``before``: the per-tensor push in place of the flat one."""
    lane = result.lane(row)
    if lane is None:
        return None
    step, sync = lane.series("step"), lane.series("sync")
    if not before:
        return _paired(sync, step)
    old = lane.series("per_tensor_sync")
    steps = [s - x + y for s, x, y in zip(step, sync, old, strict=False)]
    return _paired(old, steps)


def first_difference(result: RunResult, row: str) -> str:
    """Where ``row``'s samples first differ from the baseline's (same seeds: same tokens expected)."""
    a, b = result.lane(row), result.lane(BASELINE)
    if a is None or b is None or not a.steps or not b.steps:
        return "—"
    n = min(len(a.steps), len(b.steps))
    for k in range(n):
        da, db = a.steps[k]["digests"], b.steps[k]["digests"]
        if da != db:
            i = next(i for i, (x, y) in enumerate(zip(da, db, strict=False)) if x != y)
            return f"step {k}, sample {i} (of {len(da)})"
    return f"identical through step {n - 1}"


def verdicts(result: RunResult) -> list[tuple[str, str]]:
    """(goal, verdict line) for each target that could be judged or not."""
    out: list[tuple[str, str]] = []
    for row in ("dynamo rr", "dynamo kv"):
        iv = part_ratio(result, row, "step")
        goal = f"{row} step ≤ {STEP_BOUND:.2f}{TIMES} {BASELINE} (upper end ≤ {STEP_UPPER:.2f})"
        if iv is None:
            out.append((goal, "NOT RUN"))
            continue
        upper = judge(goal, iv, STEP_UPPER)
        if iv.blocks >= 2 and iv.estimate <= STEP_BOUND and upper.state == "met":
            out.append((goal, f"MET: {iv.format()}"))
        elif iv.blocks >= 2 and iv.low > STEP_BOUND:
            out.append((goal, f"MISSED: {iv.format()}"))
        else:
            out.append((goal, f"NOT DECIDED: {iv.format()}"))
    for lane in result.lanes:
        iv = sync_share(result, lane.row)
        goal = f"{lane.row}: sync ≤ {SYNC_SHARE:.0%} of the step"
        if iv is None:
            out.append((goal, "NOT RUN"))
            continue
        v = judge(goal, iv, SYNC_SHARE)
        out.append((goal, f"{v.state.upper()}: {_pct(iv)}"))
    return out


def _pct(iv: Interval | None) -> str:
    if iv is None:
        return "—"
    return f"{iv.estimate:.1%} [{iv.low:.1%}, {iv.high:.1%}]" if iv.blocks >= 2 else f"{iv.estimate:.1%}"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def tables(result: RunResult) -> str:
    """Seconds per step by part, ratios to the baseline, sync shares before/after, rewards."""
    rows = []
    for lane in result.lanes:
        cells = [lane.row, str(len(lane.series("step")))]
        for part in PARTS:
            cells.append(f"{_mean(lane.series(part)):.3f}")
        iv = part_ratio(result, lane.row, "step") if lane.row != BASELINE else None
        cells += [
            "baseline" if lane.row == BASELINE else (iv.format() if iv else "—"),
            _pct(sync_share(result, lane.row)),
            _pct(sync_share(result, lane.row, before=True)),
            f"{_mean(lane.series('per_tensor_sync')):.3f}" if lane.series("per_tensor_sync") else "—",
            " ".join(f"{s['mean_reward']:.3f}" for s in lane.steps),
            first_difference(result, lane.row) if lane.row != BASELINE else "—",
            lane.error or "",
        ]
        rows.append(cells)
    run1 = " (run 1)" if result.pooled else ""
    head = ["row", "timed steps", "rollout s", "train s", "sync s", "step s", f"step vs {BASELINE} [95 % CI]",
            "sync share (flat)", "sync share before (per tensor)", "per-tensor sync s", f"reward per step{run1}",
            f"first sample unlike {BASELINE}{run1}", "error"]  # fmt: skip
    part_rows = []
    for lane in result.lanes:
        if lane.row == BASELINE:
            continue
        part_rows.append([lane.row, *[_fmt(part_ratio(result, lane.row, p)) for p in PARTS]])
    parts = report.md_table(["row", *(f"{p} vs {BASELINE}" for p in PARTS)], part_rows)
    return report.md_table(head, rows, "l" + "r" * 9 + "lll") + "\n\n" + parts + latency_table(result)


def latency_table(result: RunResult) -> str:
    """A rollout's answers in time (timed steps, mean): first, median, last, and last minus first, with
    the last against the baseline's; empty where the run did not record them (before 2026-12-06)."""
    rows = []
    for lane in result.lanes:
        first, mid, last = (lane.series(f"latency_{k}") for k in ("first", "median", "last"))
        if not last:
            continue
        iv = None if lane.row == BASELINE else _fmt(part_ratio(result, lane.row, "latency_last"))
        spread = _mean([b - a for a, b in zip(first, last, strict=True)])
        rows.append([lane.row, f"{_mean(first):.3f}", f"{_mean(mid):.3f}", f"{_mean(last):.3f}", f"{spread:.3f}",
                     iv or "baseline"])  # fmt: skip
    if not rows:
        return ""
    head = ["row", "first answer s", "median answer s", "last answer s", "last - first s",
            f"last answer vs {BASELINE}"]  # fmt: skip
    return "\n\n" + report.md_table(head, rows)


def _fmt(iv: Interval | None) -> str:
    return iv.format() if iv is not None else "—"


def plot(result: RunResult, path: str, title: str) -> bool:
    """Reward per step of each row, and mean seconds per step split into parts."""
    import matplotlib  # type: ignore[import-not-found,unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    shown = [x for x in result.lanes if x.steps]
    if not shown:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for lane in shown:
        axes[0].plot([s["mean_reward"] for s in lane.steps], marker="o", label=lane.row)
    run1 = ", run 1 of the pooled runs" if result.pooled else ""
    axes[0].set_title(f"mean reward per step (same seeds on every row{run1})", fontsize=9)
    axes[0].set_xlabel("step")
    axes[0].legend(fontsize=8)
    bottom = [0.0] * len(shown)
    for part, color in (("rollout", "#3b75af"), ("train", "#ef8636"), ("sync", "#c53a32")):
        means = [_mean(x.series(part)) for x in shown]
        axes[1].bar([x.row for x in shown], means, bottom=bottom, color=color, label=part)
        bottom = [a + b for a, b in zip(bottom, means, strict=True)]
    axes[1].set_title("seconds per step (timed blocks, mean)", fontsize=9)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def markdown(m: dict[str, Any], result: RunResult, png: str | None) -> str:
    info = result.info
    lines = ["## GRPO loop", "", *report.meta_lines(m)]
    lines += [
        f"- **Loop:** `examples/grpo/grpo.py`, colocated; {info.get('workload', '')}",
        f"- **Fleets:** {info.get('fleets', '')}",
        f"- **GPU memory:** {info.get('memory', '—')}",
        f"- **Notes:** {'; '.join(info.get('notes', [])) or '—'}",
        "",
        tables(result),
        "",
    ]
    lines += [f"- {v}: {goal}" if ":" not in v else f"- {v.split(':')[0]}: {goal}: {v.split(': ', 1)[1]}"
              for goal, v in verdicts(result)]  # fmt: skip
    if png:
        lines += ["", f"![grpo]({png})"]
    return "\n".join(lines) + "\n"


# -- several runs as one ----------------------------------------------------------------------------


def load_result(path: str | Path) -> RunResult:
    """A run (or a pooled one) back from its ``results.json``; ``info["source"]`` names the file."""
    try:
        data = json.loads(Path(path).read_text())[KEY]
        lanes = tuple(
            LaneResult(str(x["row"]), tuple(x["steps"]), x.get("error"),
                       None if x.get("timed_steps") is None else tuple(x["timed_steps"]))
            for x in data["lanes"]
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a GRPO results.json ({report.summarise_error(exc)})") from exc
    info = {**(data.get("info") or {}), "source": str(path)}
    return RunResult(lanes, info, dict(data.get("meta") or {}))


def _timed(lane: LaneResult) -> tuple[dict[str, Any], ...]:
    """A lane's timed steps: the pooled ones where it pools runs, else every step after the warm-up."""
    return lane.timed_steps if lane.timed_steps is not None else lane.steps[1:]


def _source(result: RunResult, k: int) -> str:
    return str(result.info.get("source") or f"run {k + 1}")


def _per_tensor(result: RunResult) -> bool:
    return any("per_tensor_sync_s" in s for x in result.lanes for s in (*x.steps, *_timed(x)))


def _runs(result: RunResult, src: str) -> list[dict[str, Any]]:
    """The runs a result holds (a pooled one lists them in its meta): file, date, commit, command, duration."""
    if result.meta.get("runs"):
        return [dict(x) for x in result.meta["runs"]]
    return [{"file": src, **{k: result.meta.get(k) for k in ("date", "commit", "command", "duration_s")}}]


def _check_alike(results: Sequence[RunResult]) -> None:
    """The runs measured the same thing: the same workload, the same rows, per-tensor pushes in all
    or none (else a row's sync share before would pair steps of one run with pushes of another);
    and no run comes twice (the same date and command)."""
    first, src0 = results[0], _source(results[0], 0)
    rows0 = {x.row for x in first.lanes}
    seen = {(r["date"], r["command"]): src0 for r in _runs(first, src0) if r.get("date")}
    for k, res in enumerate(results[1:], 1):
        src, rows = _source(res, k), {x.row for x in res.lanes}
        for r in (r for r in _runs(res, src) if r.get("date")):
            if (r["date"], r["command"]) in seen:
                raise ValueError(f"{src}: holds the run of {r['date']} that {seen[r['date'], r['command']]} holds")
            seen[r["date"], r["command"]] = src
        if res.info.get("workload") != first.info.get("workload"):
            raise ValueError(
                f"{src}: workload {res.info.get('workload')!r} differs from {src0}'s {first.info.get('workload')!r}"
            )
        if rows != rows0:
            missing, extra = sorted(rows0 - rows), sorted(rows - rows0)
            raise ValueError(f"{src}: rows differ from {src0}'s (missing: {missing or '—'}, extra: {extra or '—'})")
        if _per_tensor(res) != _per_tensor(first):
            had = "has" if _per_tensor(res) else "has no"
            raise ValueError(f"{src} {had} per-tensor pushes, unlike {src0}: run both with or without --per-tensor")


def pool(results: Sequence[RunResult]) -> RunResult:
    """Several runs of the same workload and rows as one. A row's timed blocks are those of every
    run in order, each run's warm-up left out and every row of a run cut to the blocks all rows of
    that run finished, so block k of a row stays paired with block k of the baseline of the same
    run. Steps (the reward curve, the first sample unlike), info and meta are the first run's; the
    notes say so, and name each run's file and timed blocks. ``ValueError`` where runs differ."""
    if not results:
        raise ValueError("no runs to pool")
    _check_alike(results)
    first = results[0]
    timed: dict[str, list[dict[str, Any]]] = {x.row: [] for x in first.lanes}
    errors: dict[str, list[str]] = {x.row: [] for x in first.lanes}
    counts: list[int] = []
    for k, res in enumerate(results):
        n = min((len(_timed(x)) for x in res.lanes), default=0)
        counts.append(n)
        for lane in res.lanes:
            timed[lane.row] += _timed(lane)[:n]
            if lane.error:
                errors[lane.row].append(f"run {k + 1}: {lane.error}")
    lanes = tuple(
        attrs.evolve(x, error="; ".join(errors[x.row]) or None, timed_steps=tuple(timed[x.row])) for x in first.lanes
    )
    info = {**first.info, "notes": _pooled_notes(results, counts)}
    for key in ("fleets", "memory"):
        info[key] = _per_run([str(r.info.get(key, "—")) for r in results])
    return RunResult(lanes, info, dict(first.meta))


def _per_run(values: Sequence[str]) -> str:
    return values[0] if len(set(values)) == 1 else "; ".join(f"run {k + 1}: {v}" for k, v in enumerate(values))


def _pooled_notes(results: Sequence[RunResult], counts: Sequence[int]) -> list[str]:
    each = []
    for k, (r, n) in enumerate(zip(results, counts, strict=True)):
        ran = max((len(x.steps) for x in r.lanes), default=0)
        each.append(f"{_source(r, k)} ({r.meta.get('date', 'date unknown')}: {n} timed of {ran} blocks)")
    runs = ", ".join(each)
    notes = [
        f"pooled from {len(results)} run(s): {runs}; {sum(counts)} timed blocks, paired within each run (each "
        "run's warm-up left out, its rows cut to the blocks all of them finished); reward curve and first "
        "sample unlike from run 1"
    ]
    differ = [key for key in ("gpu", "versions", "commit") if len({repr(r.meta.get(key)) for r in results}) > 1]
    if differ:
        notes.append(f"the runs differ in {', '.join(differ)} (the header shows run 1's; each run's JSON has its own)")
    for k, r in enumerate(results):
        notes += [f"run {k + 1}: {note}" for note in r.info.get("notes", [])]
    return notes


def _combined_meta(results: Sequence[RunResult], paths: Sequence[str], argv: Sequence[str] | None) -> dict[str, Any]:
    """The first run's meta, its command noted after the one that pooled the runs; each run listed."""
    first = results[0].meta
    m: dict[str, Any] = {"date": "?", "machine": "?", "gpu": "?", "versions": {}, **first}
    pooled_by = report.command_line("python -m rb_bench.grpo", argv)
    m["runs"] = [run for p, r in zip(paths, results, strict=True) for run in _runs(r, p)]
    m["command"] = f"{pooled_by}  # pools runs of: {m['runs'][0].get('command') or '?'}"
    m["duration_s"] = " + ".join(str(run.get("duration_s") or "?") for run in m["runs"])
    return m


def combine(paths: Sequence[str], out: str | None, argv: Sequence[str] | None = None) -> int:
    """``--combine``: saved runs pooled (``pool``), their tables and verdicts printed and, with
    ``out``, written as a run writes them (no logs). Runs nothing: no GPU, torch or SGLang."""
    if out is not None:
        target = (Path(out) / report.JSON_NAME).resolve()
        clash = [p for p in paths if Path(p).resolve() == target]
        if clash:
            raise SystemExit(f"grpo --combine: --out {out} holds {clash[0]}, one of the runs: pick another folder")
    try:
        results = [load_result(p) for p in paths]
        result = pool(results)
    except ValueError as exc:
        raise SystemExit(f"grpo --combine: {exc}") from exc
    m = _combined_meta(results, paths, argv)
    where = m["gpu"] if m["gpu"] not in ("none", "?") else m["machine"]
    _emit(m, result, out, f"{where}; {m['date']}; pooled from {len(paths)} runs", [])
    return 0 if all(x.series("step") for x in result.lanes) else 1


# -- main --------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rb_bench.grpo", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("sglang", "reference"), default="reference")
    p.add_argument("--rows", nargs="+", choices=ROWS, default=None, help=f"default: all ({', '.join(ROWS)})")
    p.add_argument("--model-size", default=None, help="qwen2.5-0.5b (GPU default) or tiny (CPU default)")
    p.add_argument("--model-path", help="an existing model folder (default: make one)")
    p.add_argument("--gpu", default="0", help="the GPU every worker and trainer shares")
    p.add_argument("--blocks", type=int, default=10, help="blocks (GRPO steps per row), the first a warm-up")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=None, help="default: 1e-4 on GPU, the example's on CPU")
    p.add_argument("--bucket-mib", type=float, default=512.0)
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="--enable-deterministic-inference on every worker (default: on with GPUs)")  # fmt: skip
    p.add_argument("--per-tensor", action=argparse.BooleanOptionalAction, default=True,
                   help="also time a per-tensor push after each step (the sync share before flat buckets)")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=330.0, help="the whole run, start-up and teardown included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output folder (benchmarks.md, results.json, grpo.png, grpo-logs.tar.gz)")
    p.add_argument("--smoke", action="store_true", help="CPU: reference workers, tiny model, 2 rows, 3 small blocks")
    p.add_argument("--combine", nargs="+", metavar="RESULTS_JSON",
                   help="pool saved runs of the same workload and rows (blocks paired within each run) into "
                   "one report; runs nothing")  # fmt: skip
    return p


def _configure(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    gpu = args.engine == "sglang"
    if args.smoke:
        if gpu:
            p.error("--smoke is for --engine reference")
        args.rows = args.rows or ["sglang direct", "dynamo rr"]
        args.blocks, args.prompts, args.group = min(args.blocks, 3), 2, 4
        args.prompt_len, args.max_new_tokens, args.budget_s = 8, 8, min(args.budget_s, 150.0)
    args.rows = list(args.rows or ROWS)
    if BASELINE not in args.rows:
        args.rows.insert(0, BASELINE)
    if args.deterministic is None:
        args.deterministic = gpu
    args.model_size = args.model_size or ("qwen2.5-0.5b" if gpu else "tiny")
    return args


def memory_release_note(released: Mapping[str, bool]) -> str:
    """Which rows release engine memory around training (the example does where the backend
    declares ``memory_release``). Rows that differ do different work each step: until c10caec the
    Dynamo rows' ``dynamo.sglang`` workers declared it without a memory saver and SGLang's did not
    (the H100 run of 2026-12-06 19:49, docs/benchmarks.md)."""
    said = ", ".join(f"{row} {'yes' if r else 'no'}" for row, r in released.items())
    differ = " (rows differ: their steps are not like for like)" if len(set(released.values())) > 1 else ""
    return f"engine memory released around training: {said}{differ}"


async def _run(args: argparse.Namespace, s: Settings, progress: report.Progress, started: float) -> RunResult:
    grpo = load_example()
    deadline = started + args.budget_s
    lanes = [Lane(row, Side(row, s)) for row in args.rows]
    notes: list[str] = []
    try:
        t0 = time.monotonic()
        got = await asyncio.gather(
            *(asyncio.wait_for(x.side.start(progress), max(1.0, deadline - time.monotonic() - _TEARDOWN_S))
              for x in lanes),
            return_exceptions=True,
        )  # fmt: skip
        for lane, r in zip(lanes, got, strict=True):
            if isinstance(r, BaseException):
                lane.error = f"start: {report.summarise_error(r)}"
        notes.append(f"fleets started in {time.monotonic() - t0:.1f} s (all at once)")
        device = f"cuda:{s.gpu}" if s.on_gpu else "cpu"  # this process sees every GPU; the workers one
        cfg_lr = args.lr if args.lr is not None else (1e-4 if s.on_gpu else grpo.Config.lr)
        for lane in (x for x in lanes if x.error is None):
            cfg = grpo.Config(
                backend="(launched)", model=s.model_path, steps=args.blocks, prompts=args.prompts,
                group=args.group, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
                lr=cfg_lr, seed=args.seed, device=device, bucket_mib=args.bucket_mib,
            )  # fmt: skip
            try:
                lane.loop = grpo.GRPO(lane.side.backend, cfg)
                await lane.loop.setup()
            except Exception as exc:
                lane.error = f"setup: {report.summarise_error(exc)}"
        running = {x.row: bool(x.side.backend.capabilities.memory_release) for x in lanes if x.error is None}
        if running:
            notes.append(memory_release_note(running))
        blocks = await run_blocks(lanes, args.blocks, deadline, args.per_tensor, args.seed, progress)
        notes.append(f"{blocks} block(s) run")
        info = {
            "workload": f"{args.prompts} prompts {TIMES} {args.group} samples {TIMES} {args.max_new_tokens} new tokens "
            f"(prompts {args.prompt_len} tokens, ignore_eos), temperature 1, AdamW lr {cfg_lr:g}, flat buckets "
            f"≤ {args.bucket_mib:g} MiB; reward = share of sampled ids that are multiples of 8",
            "fleets": "one worker each; " + ("all on GPU " + s.gpu if s.on_gpu else "reference workers on CPU")
            + (", deterministic inference" if args.deterministic else ""),
            "memory": _memory(s.on_gpu),
            "notes": notes,
        }  # fmt: skip
        return RunResult(tuple(LaneResult(x.row, tuple(x.steps), x.error) for x in lanes), info)
    finally:
        for lane in lanes:
            with contextlib.suppress(Exception):
                if lane.loop is not None:
                    await lane.loop.close()
        await asyncio.gather(*(x.side.aclose() for x in lanes), return_exceptions=True)


def _memory(gpu: bool) -> str:
    if not gpu:
        return "—"
    import torch

    peak = torch.cuda.max_memory_allocated() / 2**30
    return "; ".join([f"trainers (this process: every row's policy and AdamW) peak {peak:.1f} GiB", *gpu_memory()])


def _lane_data(lane: LaneResult) -> dict[str, Any]:
    data = attrs.asdict(lane)
    if data["timed_steps"] is None:  # a single run's JSON stays as it was
        del data["timed_steps"]
    return data


def _emit(m: dict[str, Any], result: RunResult, out: str | None, title: str, log_dirs: Sequence[Path]) -> None:
    """Print the tables and verdicts; with ``out``, write benchmarks.md, results.json, grpo.png and the logs."""
    print(f"\nGRPO loop, {m['date']}, GPU: {m['gpu']}\n")
    print(tables(result))
    for goal, v in verdicts(result):
        print(f"- {goal}: {v}")
    if out:
        data = {"meta": m, "info": result.info, "lanes": [_lane_data(x) for x in result.lanes],
                "verdicts": [{"goal": g, "verdict": v} for g, v in verdicts(result)]}  # fmt: skip
        report.write_outputs(
            out, KEY, plot=lambda path: plot(result, path, title),
            markdown=lambda png: markdown(m, result, png), data=data, log_dirs=log_dirs,
        )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = _configure(_parser(), argv)
    if args.combine:
        return combine(args.combine, args.out, argv)
    gpu = args.engine == "sglang"
    if gpu:
        report.safe_multicast_env()
    progress = report.Progress("grpo: ")
    started_wall, started = time.time(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rb-grpo-") as tmp:
        run_dir = Path(tmp)
        (run_dir / "logs").mkdir()
        model_path = args.model_path
        if model_path is None:
            from rollout_backends.adapters.reference import make_tiny_model

            progress(f"making the {args.model_size} model")
            model_path = str(make_tiny_model(run_dir / "model", seed=args.seed, size=args.model_size))
        s = Settings(args.engine, model_path, args.gpu, args.kv_tokens, args.deterministic,
                     max(10.0, args.budget_s - _TEARDOWN_S - 30.0), run_dir / "logs")  # fmt: skip
        result = asyncio.run(_run(args, s, progress, started))
        m = report.meta("python -m rb_bench.grpo", argv, PACKAGES, started_wall)
        m["duration_s"] = round(time.monotonic() - started, 1)
        _emit(m, result, args.out, f"{m['gpu'] if gpu else m['machine']}; {m['date']}", [run_dir / "logs"])
    ran = [x for x in result.lanes if x.error is None and len(x.steps) >= 2]
    return 0 if len(ran) == len(result.lanes) else 1


if __name__ == "__main__":
    sys.exit(main())
