"""Profile the frontend and a worker under load: perf (native, the Rust frontend and Dynamo's
runtime in the worker), py-spy (the worker's Python), the frontend's ``/metrics``.

    .venv/bin/python bench/probes/prof.py --kind nocompute --seconds 10   # our Python worker
    .venv/bin/python bench/probes/prof.py --kind mocker --seconds 10

One frontend (ours), one worker; raw aiohttp keeps 64 requests of 128 tokens in flight with our
wire's body. While it runs: ``perf record -g`` on the frontend and the worker (needs
``/usr/bin/perf`` and root or ``perf_event_paranoid`` <= 1; ``_core.abi3.so`` keeps its symbol
table, so Rust functions are named) and ``py-spy record --format raw`` on the worker. Writes the
top functions (self and inclusive) of each to ``out/prof-<kind>-*.txt``, plus the frontend's
``/metrics`` before/after.
"""

from __future__ import annotations

import asyncio
import collections
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.probes._probe import OURS, Fleet, RawClient, args_common, cpu_many, drive, threads_cpu_s, wire_body


def top_raw(path: Path, n: int = 25) -> str:
    """Self and inclusive shares of a py-spy ``--format raw`` (collapsed stacks) file."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, k = line.rpartition(" ")
        if not stack:
            continue
        c = int(k)
        total += c
        frames = stack.split(";")
        own[frames[-1]] += c
        for fr in set(frames):
            incl[fr] += c
    out = [f"samples: {total}", "-- self"]
    out += [f"{v / total * 100:5.1f}%  {k}" for k, v in own.most_common(n)]
    out += ["-- inclusive"] + [f"{v / total * 100:5.1f}%  {k}" for k, v in incl.most_common(n)]
    return "\n".join(out)


def perf_report(data: Path, children: bool) -> str:
    args = [
        "perf",
        "report",
        "-i",
        str(data),
        "--stdio",
        "-g",
        "none",
        "--sort",
        "dso,symbol" if not children else "symbol",
    ]
    args.append("--children" if children else "--no-children")
    r = subprocess.run(args, capture_output=True, text=True, check=False)
    lines = [ln[:220] for ln in r.stdout.splitlines() if "%" in ln and not ln.startswith("#")]
    return "\n".join(lines[:60])


async def metrics(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        return await r.text()


async def main() -> None:
    p = args_common(__doc__ or "")
    p.add_argument("--kind", default="nocompute", choices=["mocker", "nocompute"])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tag = f"{a.kind}-chunk{a.tokens_per_chunk}{a.tag}"
    async with Fleet(
        kind=a.kind, workers=1, frontends=(OURS,), python=a.python, tokens_per_chunk=a.tokens_per_chunk
    ) as f:
        url = f.frontend_urls["ours"]
        client = RawClient(url, wire_body(f, 128), check=128)
        await drive(client, 128, 64)
        m0 = await metrics(url)
        fe, wk = f.pids["frontend-ours"], f.pids["worker-0"]
        stop = asyncio.Event()
        done = 0

        async def load() -> None:
            nonlocal done
            while not stop.is_set():
                await drive(client, 256, 64)
                done += 256

        task = asyncio.ensure_future(load())
        await asyncio.sleep(1.0)
        c0 = cpu_many({"frontend": [fe], "worker": [wk]})
        th0 = {"frontend": threads_cpu_s(fe), "worker": threads_cpu_s(wk)}
        n0, t0 = done, time.monotonic()
        procs = []
        secs = str(int(a.seconds))
        if shutil.which("perf"):
            for name, pid in (("frontend", fe), ("worker", wk)):
                procs.append(
                    subprocess.Popen(
                        [
                            "perf",
                            "record",
                            "-F",
                            "199",
                            "-g",
                            "-o",
                            str(a.out / f"perf-{tag}-{name}.data"),
                            "-p",
                            str(pid),
                            "--",
                            "sleep",
                            secs,
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
        pyspy = Path(sys.executable).with_name("py-spy")
        if pyspy.exists():
            procs.append(
                subprocess.Popen(
                    [
                        str(pyspy),
                        "record",
                        "-p",
                        str(wk),
                        "-d",
                        secs,
                        "-r",
                        "100",
                        "--nonblocking",
                        "--format",
                        "raw",
                        "-o",
                        str(a.out / f"pyspy-{tag}-worker.raw"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        while any(pr.poll() is None for pr in procs):
            await asyncio.sleep(0.5)
        c1 = cpu_many({"frontend": [fe], "worker": [wk]})
        th1 = {"frontend": threads_cpu_s(fe), "worker": threads_cpu_s(wk)}
        n1, t1 = done, time.monotonic()
        stop.set()
        await task
        m1 = await metrics(url)
        await client.aclose()
    n = max(1, n1 - n0)
    lines = [
        f"# profile {tag}: {n} requests x 128 tokens in {t1 - t0:.1f} s (counts of completed batches)",
        "CPU µs/request: " + ", ".join(f"{k} {(c1[k] - c0[k]) * 1e6 / n:,.0f}" for k in c1),
    ]
    for g in th1:
        lines.append(
            f"{g} by thread: " + ", ".join(f"{k} {(v - th0[g].get(k, 0)) * 1e6 / n:,.0f}" for k, v in th1[g].items())
        )
    for name in ("frontend", "worker"):
        data = a.out / f"perf-{tag}-{name}.data"
        if data.exists():
            lines += [
                f"\n## perf {name}: self",
                perf_report(data, False),
                f"\n## perf {name}: inclusive",
                perf_report(data, True),
            ]
    raw = a.out / f"pyspy-{tag}-worker.raw"
    if raw.exists():
        lines += ["\n## py-spy worker (Python threads)", top_raw(raw)]
    (a.out / f"metrics-{tag}-before.txt").write_text(m0)
    (a.out / f"metrics-{tag}-after.txt").write_text(m1)
    text = "\n".join(lines)
    (a.out / f"prof-{tag}.txt").write_text(text)
    print(text[:6000])


if __name__ == "__main__":
    asyncio.run(main())
