"""The rollout-backends command.

commands:
  demo                   a small rollout + weight update on the CPU reference engine
  demo --backend URL     the same against any backend URL (sglang://, dynamo://)
  launch sglang ...      start SGLang workers (+ smg router) and wait (Ctrl-C stops)
  launch dynamo ...      start a Dynamo frontend + workers and wait (Ctrl-C stops)
  launch vllm ...        start vLLM servers and wait (Ctrl-C stops)
  serve-reference ...    the CPU reference engine behind SGLang's native HTTP API
  make-model OUT ...     write a seeded tiny Qwen2 model + tokenizer (nothing downloaded)
  facade ...             SGLang-compatible facade for Miles over any backend

Benchmarks and the conformance suite's GPU tier are not part of the library: they run from a
checkout (bench/README.md), e.g. PYTHONPATH=bench python -m rb_bench.fanout --help.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _fmt_row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False))


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    print(_fmt_row(headers, widths))
    print(_fmt_row(["-" * w for w in widths], widths))
    for r in rows:
        print(_fmt_row(r, widths))


def _short(ids: Sequence[int], n: int = 8) -> str:
    s = " ".join(str(t) for t in ids[:n])
    return s + (" …" if len(ids) > n else "")


async def _demo(args: argparse.Namespace) -> int:
    import rollout_backends as rb

    prompts = [[11, 42, 7, 99], [5, 6, 7, 8, 9], [300, 12], [77, 78, 79, 80, 81, 82]]
    sampling = rb.SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=1234)
    url = args.backend or f"reference://?workers={args.workers}&seed=0"
    print(f"backend: {url}")
    t0 = time.perf_counter()
    backend = await rb.open_backend(url)
    async with backend:  # type: ignore[attr-defined]
        await backend.wait_ready(timeout=args.timeout)
        caps = backend.capabilities
        version = await backend.weight_version()
        print(f"workers: {', '.join(backend.workers)}   routing: {caps.routing.value}   version: {version}")
        print(f"\nrollout: {len(prompts)} prompts x {args.samples} samples (temperature {args.temperature})\n")
        groups = await asyncio.gather(*(rb.generate_group(backend, p, args.samples, sampling) for p in prompts))
        rows = []
        for pi, group in enumerate(groups):
            for si, g in enumerate(group):
                lp = g.logprobs or ()
                rows.append(
                    [
                        f"{pi}.{si}",
                        _short(g.output_ids),
                        " ".join(f"{x:.2f}" for x in lp[:4]) + (" …" if len(lp) > 4 else ""),
                        g.finish_reason.value,
                        str(g.weight_version),
                        str(g.worker),
                    ]
                )
        _print_table(["sample", "tokens", "logprobs", "finish", "version", "worker"], rows)
        skipped = _why_no_update(args, caps)
        if skipped is None:
            with tempfile.TemporaryDirectory(prefix="rb-demo-") as tmp:
                await _weight_update(backend, args.weights or _new_tiny_weights(tmp), prompts[0])
        else:
            print(f"\nweight update: SKIPPED: {skipped}", file=sys.stderr, flush=True)
    done = f"\ndone in {time.perf_counter() - t0:.1f}s"
    print(done if skipped is None else f"{done} (without the weight update: see above)")
    return 0


def _why_no_update(args: argparse.Namespace, caps: Any) -> str | None:
    """Why the demo cannot show a weight update on this backend (``None``: it can)."""
    from rollout_backends import WeightTransport

    if not caps.supports_transport(WeightTransport.DISK):
        declared = ", ".join(sorted(t.value for t in caps.weight_transports)) or "none"
        return f"the backend does not declare weight updates from disk (its transports: {declared})"
    if args.backend is not None and args.weights is None:
        # Only the demo's own engine is known to load the tiny model it would make; another
        # engine needs a checkpoint of its own architecture, readable where it runs.
        return (
            "--backend needs --weights DIR: a checkpoint of the served model's architecture that the "
            "engines can read (the one they serve will do: the update then relabels the same weights)"
        )
    return None


def _new_tiny_weights(folder: str) -> str:
    """Other weights for the demo's own reference engines (same architecture, another seed)."""
    from rollout_backends.adapters.reference import make_tiny_model

    return str(make_tiny_model(folder, seed=1))


async def _weight_update(backend: Any, weights: str, prompt: Sequence[int]) -> None:
    """One weight-update transaction to ``step-1`` from ``weights``, with greedy tokens before and after."""
    import rollout_backends as rb

    greedy = rb.SamplingParams(temperature=0.0, max_new_tokens=8)
    before = await backend.generate(rb.GenerateRequest(input_ids=prompt, sampling=greedy))
    print(f"\nweight update transaction -> 'step-1' from {weights} (pause retract, flush, load, label, resume)")
    async with backend.weight_update("step-1") as tx:
        await tx.update_from_disk(weights)
    after = await backend.generate(rb.GenerateRequest(input_ids=prompt, sampling=greedy))
    _print_table(
        ["when", "greedy tokens (prompt 0)", "version"],
        [
            ["before", _short(before.output_ids), str(before.weight_version)],
            ["after", _short(after.output_ids), str(after.weight_version)],
        ],
    )
    print(f"fleet version now: {await backend.weight_version()}")


def _build_parser() -> argparse.ArgumentParser:
    import rollout_backends
    from rollout_backends._launch import HelpFormatter

    p = argparse.ArgumentParser(prog="rollout-backends", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("-V", "--version", action="version", version=f"rollout-backends {rollout_backends.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        help="a small rollout and a weight update on the CPU reference engine",
        description="A small rollout and a weight update, on the CPU reference engine or any backend URL.",
        formatter_class=HelpFormatter,
    )
    d.add_argument("--backend", help="backend URL (default: the in-process reference engine)")
    d.add_argument(
        "--weights",
        default=None,
        metavar="DIR",
        help="checkpoint the weight update loads, readable by the engines (default: without --backend, a tiny "
        "model made for the demo; with --backend, none: the update is skipped, and the demo says so)",
    )
    d.add_argument("--workers", type=int, default=2, help="reference engines (without --backend)")
    d.add_argument("--samples", type=int, default=4, help="samples per prompt")
    d.add_argument("--max-new-tokens", type=int, default=12, help="tokens per sample")
    d.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    d.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the backend")
    d.set_defaults(func=_demo)
    for key in _DELEGATES:  # listed for --help; parsed by the delegate
        if " " not in key:
            sub.add_parser(key, help=f"see: rollout-backends {key} --help", add_help=False)
    launch = sub.add_parser(
        "launch",
        help="start a fleet and wait (Ctrl-C stops it): launch sglang|dynamo|vllm ...",
        description="Start a fleet, print its URLs (and a connect: URL for open_backend), and wait until "
        "Ctrl-C or SIGTERM stops everything it started.",
        formatter_class=HelpFormatter,
    )
    engines = launch.add_subparsers(dest="engine", metavar="ENGINE")
    for key in _DELEGATES:  # parsed by the delegate; listed here for `launch --help`
        if key.startswith("launch "):
            name = key.split(" ", 1)[1]
            engines.add_parser(name, help=f"see: rollout-backends launch {name} --help", add_help=False)

    async def launch_usage(args: argparse.Namespace) -> int:
        launch.print_help()
        return 0

    launch.set_defaults(func=launch_usage)
    return p


#: Subcommands that hand their arguments to another module's ``main(argv)``.
_DELEGATES: dict[str, str] = {
    "launch sglang": "rollout_backends.adapters.sglang.launch:main",
    "launch dynamo": "rollout_backends.adapters.dynamo.launch:main",
    "launch vllm": "rollout_backends.adapters.vllm.launch:main",
    "serve-reference": "rollout_backends.adapters.reference.serve:main",
    "make-model": "rollout_backends.adapters.reference.make_model:main",
    "facade": "rollout_backends.integrations.miles.facade:main",
}

#: Subcommands that left the installed package for the checkout's ``bench/`` (issue 15): asked for,
#: they say where they went instead of argparse's "invalid choice".
_MOVED: dict[str, str] = {
    "bench": "PYTHONPATH=bench python -m rb_bench.<overhead|fanout|weightsync|soak> ...",
    "gpu-tier": "PYTHONPATH=bench python -m rb_bench.gpu_tier ...",
}


def _delegate(argv: Sequence[str]) -> int | None:
    """Run a delegated subcommand, or return None if ``argv`` names none."""
    import importlib

    for words in (2, 1):
        key = " ".join(argv[:words])
        target = _DELEGATES.get(key) if len(argv) >= words else None
        if target is None:
            continue
        module, _, func = target.partition(":")
        try:
            entry = getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError) as exc:
            print(f"error: {key!r} is not available in this installation ({exc})", file=sys.stderr)
            return 2
        return _run_reporting(functools.partial(entry, list(argv[words:])))
    return None


def _run_reporting(call: Any) -> int:
    """Run a command's body: its exit status, or an error as one line (no traceback) with status 2
    for the caller's own mistake (``InvalidRequest``), 1 for anything else, 130 on Ctrl-C."""
    from rollout_backends import InvalidRequest
    from rollout_backends.launch import one_line_error

    try:
        return int(call() or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        print(one_line_error(exc), file=sys.stderr)
        return 2 if isinstance(exc, InvalidRequest) else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _MOVED:
        print(
            f"error: 'rollout-backends {argv[0]}' is not part of the installed library; from a checkout of "
            f"rollout-backends run: {_MOVED[argv[0]]} (see bench/README.md)",
            file=sys.stderr,
        )
        return 2
    delegated = _delegate(argv)
    if delegated is not None:
        return delegated
    args = _build_parser().parse_args(argv)
    func: Any = args.func
    return _run_reporting(lambda: asyncio.run(func(args)))


if __name__ == "__main__":
    sys.exit(main())
