"""Soak: many requests through a Dynamo mocker fleet; requests lost, latency, client RSS and fds.

    python -m rb_bench.soak --requests 100000 [--workers 2] [--concurrency 64]

Starts ``dynamo.frontend`` and ``--workers`` ``dynamo.mocker`` workers on 127.0.0.1 (every process
stopped at the end), sends ``--requests`` ``generate`` calls, at most ``--concurrency`` at a time,
each bounded by ``--timeout`` seconds, and prints:

* requests sent, completed, failed by error type, **lost** (an untyped exception, or no answer
  within the timeout plus a grace: a hang), max / p50 / p99 latency;
* this process's RSS and open file descriptors (sockets among them, from ``/proc/self/fd``)
  before the run (pool warm), after the run, and after the backend is closed.

``run_load`` and ``process_stats`` are shared with ``tests/reliability``.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import collections
import gc
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollout_backends import GenerateRequest, Generation, RolloutBackendError

__all__ = ["LoadReport", "ProcessStats", "main", "process_stats", "run_load", "soak"]

#: Seconds past a request's own timeout after which it counts as hung (lost).
HANG_GRACE_S = 5.0


@attrs.frozen(slots=True)
class ProcessStats:
    """This process's memory and descriptors, from ``/proc/self``."""

    rss_kib: int
    fds: int
    sockets: int

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


def process_stats() -> ProcessStats:
    """RSS (``VmRSS``) and open fds / sockets of this process (Linux ``/proc``)."""
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
                break
    fds = sockets = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed while listing (the listing's own fd)
            continue
        fds += 1
        sockets += target.startswith("socket:")
    return ProcessStats(rss_kib=rss, fds=fds, sockets=sockets)


@attrs.define
class LoadReport:
    """What happened to every request of one ``run_load``."""

    sent: int = 0
    completed: int = 0
    #: Typed failures (``RolloutBackendError`` subclasses) by class name.
    errors: collections.Counter[str] = attrs.field(factory=collections.Counter)
    #: Untyped exceptions by ``"Type: message"`` (each is a lost request: a bug).
    untyped: collections.Counter[str] = attrs.field(factory=collections.Counter)
    #: Requests with no answer within their timeout plus ``HANG_GRACE_S``.
    hung: int = 0
    by_worker: collections.Counter[str] = attrs.field(factory=collections.Counter)
    #: Seconds per request (a compact array: a soak of 100,000 keeps 0.8 MB, not a list of floats).
    latencies: array.array[float] = attrs.field(factory=lambda: array.array("d"), repr=False)
    wall_s: float = 0.0
    #: Per request, in order: ``(start_s, end_s, outcome)`` relative to the run's start (only with
    #: ``run_load(keep_timeline=True)``: it grows with the run and would count as client memory).
    timeline: list[tuple[float, float, str]] = attrs.field(factory=list, repr=False)

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    @property
    def lost(self) -> int:
        """Requests that neither completed nor failed with a typed error."""
        return self.sent - self.completed - self.failed

    @property
    def max_latency_s(self) -> float:
        return max(self.latencies, default=0.0)

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return 0.0
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    def summary(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "completed": self.completed,
            "failed": dict(self.errors),
            "lost": self.lost,
            "hung": self.hung,
            "untyped": dict(self.untyped),
            "max_latency_s": round(self.max_latency_s, 3),
            "p50_latency_s": round(self.percentile(0.5), 4),
            "p99_latency_s": round(self.percentile(0.99), 4),
            "wall_s": round(self.wall_s, 2),
            "requests_per_s": round(self.sent / self.wall_s, 1) if self.wall_s else 0.0,
            "by_worker": dict(self.by_worker),
        }


async def run_load(
    generate: Callable[[GenerateRequest], Awaitable[Generation]],
    make_request: Callable[[int], GenerateRequest],
    n: int,
    *,
    concurrency: int = 32,
    timeout_s: float = 30.0,
    on_done: Callable[[int, str], None] | None = None,
    deadline_s: float | None = None,
    keep_timeline: bool = True,
) -> LoadReport:
    """Send ``n`` requests (``make_request(i)``), at most ``concurrency`` in flight.

    Each call is bounded by ``timeout_s + HANG_GRACE_S`` (past that it counts as ``hung``).
    ``on_done(i, outcome)`` is called as each ends (outcome: ``"ok"`` or the error's class name).
    ``deadline_s`` bounds the whole run: requests not yet sent by then are not sent.
    """
    report = LoadReport()
    t0 = time.monotonic()
    queue: collections.deque[int] = collections.deque(range(n))

    async def one(i: int) -> None:
        req = make_request(i)
        start = time.monotonic()
        report.sent += 1
        outcome = "ok"
        try:
            gen = await asyncio.wait_for(generate(req), timeout_s + HANG_GRACE_S)
        except RolloutBackendError as exc:
            outcome = type(exc).__name__
            report.errors[outcome] += 1
        except asyncio.TimeoutError:
            outcome = "hung"
            report.hung += 1
        except Exception as exc:  # a lost request: an error the library should have typed
            outcome = "untyped"
            report.untyped[f"{type(exc).__name__}: {exc}"[:200]] += 1
        else:
            report.completed += 1
            report.by_worker[str(gen.worker)] += 1
        end = time.monotonic()
        report.latencies.append(end - start)
        if keep_timeline:
            report.timeline.append((start - t0, end - t0, outcome))
        if on_done is not None:
            on_done(i, outcome)

    async def lane() -> None:
        while queue:
            if deadline_s is not None and time.monotonic() - t0 > deadline_s:
                return
            await one(queue.popleft())

    await asyncio.gather(*(lane() for _ in range(max(1, min(concurrency, n)))))
    report.wall_s = time.monotonic() - t0
    return report


async def soak(
    *,
    requests: int,
    workers: int = 2,
    concurrency: int = 64,
    max_new_tokens: int = 4,
    timeout_s: float = 30.0,
    model_path: str | None = None,
    log_dir: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the soak and return its figures (see the module docstring)."""
    from rollout_backends import SamplingParams
    from rollout_backends.adapters.dynamo import DynamoFleetConfig, launch_dynamo_fleet
    from rollout_backends.kit import HttpClient

    if model_path is None:
        from rollout_backends.adapters.reference import cached_tiny_model

        model_path = str(cached_tiny_model(0))
    cfg = DynamoFleetConfig(model_path=model_path, workers=workers, worker_kind="mocker", router_mode="round-robin")
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)

    def make(i: int) -> GenerateRequest:
        return GenerateRequest(input_ids=(1 + i % 97, 2 + i % 89, 3 + i % 83, 4), sampling=sampling)

    gc.collect()
    baseline = process_stats()
    async with launch_dynamo_fleet(cfg, log_dir=log_dir) as fleet:
        backend = await fleet.connect(client=HttpClient(timeout=timeout_s))
        # Warm: the pool opens its connections, imports and caches settle.
        warm = await run_load(
            backend.generate, make, min(2000, max(200, requests // 50)), concurrency=concurrency, keep_timeline=False
        )
        gc.collect()
        before = process_stats()
        step = max(1, requests // 10)
        t_start = time.monotonic()
        done = [0]

        def on_done(i: int, outcome: str) -> None:
            done[0] += 1
            if progress and done[0] % step == 0:
                rate = done[0] / max(1e-9, time.monotonic() - t_start)
                print(f"soak: {done[0]}/{requests} ({rate:.0f} req/s)", file=sys.stderr, flush=True)

        # The runner keeps 8 bytes of latency per request (0.8 MB per 100,000): part of the growth.
        report = await run_load(
            backend.generate,
            make,
            requests,
            concurrency=concurrency,
            timeout_s=timeout_s,
            on_done=on_done,
            keep_timeline=False,
        )
        gc.collect()
        after = process_stats()
        await backend.aclose()
        gc.collect()
        closed = process_stats()
    config = {
        "requests": requests,
        "workers": workers,
        "worker_kind": "mocker",
        "concurrency": concurrency,
        "max_new_tokens": max_new_tokens,
        "timeout_s": timeout_s,
    }
    return {"config": config, "warmup": warm.summary(), "run": report.summary(),
            "client": _client_growth(baseline, before, after, closed)}  # fmt: skip


def _client_growth(
    baseline: ProcessStats, before: ProcessStats, after: ProcessStats, closed: ProcessStats
) -> dict[str, Any]:
    """The client process's figures at each point, and what the measured run added."""
    return {
        "baseline": baseline.as_dict(),
        "before": before.as_dict(),
        "after": after.as_dict(),
        "after_close": closed.as_dict(),
        "rss_growth_kib": after.rss_kib - before.rss_kib,
        "fd_growth": after.fds - before.fds,
        "socket_growth": after.sockets - before.sockets,
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rb_bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    p.add_argument("--model-path", default=None, help="default: the cached tiny reference model")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None, help="also write the figures here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parse(argv)
    figures = asyncio.run(
        soak(
            requests=ns.requests,
            workers=ns.workers,
            concurrency=ns.concurrency,
            max_new_tokens=ns.max_new_tokens,
            timeout_s=ns.timeout,
            model_path=ns.model_path,
            log_dir=ns.log_dir,
        )
    )
    run, client = figures["run"], figures["client"]
    print(
        f"soak: {run['sent']} sent, {run['completed']} completed, failed {run['failed']}, lost {run['lost']} "
        f"(hung {run['hung']}); latency max {run['max_latency_s']}s p50 {run['p50_latency_s']}s "
        f"p99 {run['p99_latency_s']}s; {run['requests_per_s']} req/s over {run['wall_s']}s"
    )
    for key in ("before", "after", "after_close"):
        s = client[key]
        print(f"client {key:<11}: RSS {s['rss_kib'] / 1024:.1f} MiB, {s['fds']} fds ({s['sockets']} sockets)")
    print(
        f"client growth: RSS {client['rss_growth_kib']} KiB, fds {client['fd_growth']}, "
        f"sockets {client['socket_growth']}"
    )
    if ns.json:
        Path(ns.json).write_text(json.dumps(figures, indent=2))
    return 0 if run["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
