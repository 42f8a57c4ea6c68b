"""Launch an SGLang fleet, print its URLs, and keep it up until Ctrl-C.

    rollout-backends launch sglang --model-path DIR --workers 2 \
        --router smg --policy cache_aware [--worker-kind reference] [--cuda-visible-devices 0 1] ...

Workers run SGLang (GPU) unless --worker-kind reference runs the CPU reference engine, which
serves SGLang's native API; the first line printed says which. The defaults are those of
SGLangFleetConfig (Python), read from it. Prints each URL and a connect: line that
rollout_backends.open_backend opens (add api_key= there: keys are never printed). Everything it
started is stopped on Ctrl-C or SIGTERM (SIGTERM to each process group, SIGKILL after the grace).
The temporary log folder goes with it unless --keep-run-dir, or unless the start failed (then its
path is printed); --log-dir logs always stay. -- ends our flags; what follows is passed verbatim to
every worker.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollout_backends.launch import HelpFormatter, run_launcher_cli, split_passthrough, stderr_progress

from ._launcher import ROUTER_POLICIES, ROUTERS, WORKER_KIND_DESCRIPTIONS, SGLangFleetConfig, launch_sglang_fleet

__all__ = ["build_parser", "config_from_args", "main", "parse_args"]

PROG = "rollout-backends launch sglang"


#: The config's fields: every flag's default is the field's (one set of defaults, CLI and Python).
_F = attrs.fields(SGLangFleetConfig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model-path", required=True, help="model directory every worker loads")
    p.add_argument("--workers", type=int, default=_F.workers.default, help="number of workers")
    p.add_argument(
        "--worker-kind",
        choices=tuple(WORKER_KIND_DESCRIPTIONS),
        default=_F.worker_kind.default,
        help="; ".join(f"{k}: {d}" for k, d in WORKER_KIND_DESCRIPTIONS.items()),
    )
    p.add_argument("--host", default=_F.host.default, help="address every process binds")
    p.add_argument(
        "--worker-ports", type=int, nargs="+", default=None, help="one port per worker (default: free ports)"
    )
    p.add_argument("--worker-base-port", type=int, default=None, help="worker i on BASE+i (default: free ports)")
    p.add_argument(
        "--cuda-visible-devices",
        nargs="+",
        default=None,
        help="CUDA_VISIBLE_DEVICES of each worker, e.g. 0 1 (default: inherited)",
    )
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="sglang --mem-fraction-static (default: SGLang's alone on a GPU, 0.8/n for n workers sharing one)",
    )
    p.add_argument("--page-size", type=int, default=_F.page_size.default, help="KV page size (tokens)")
    p.add_argument(
        "--attention-backend",
        default=_F.attention_backend.default,
        help="sglang --attention-backend ('' leaves it out)",
    )
    p.add_argument(
        "--sampling-backend", default=_F.sampling_backend.default, help="sglang --sampling-backend ('' leaves it out)"
    )
    p.add_argument("--enable-cuda-graph", action="store_true", help="sglang: do not pass --disable-cuda-graph")
    p.add_argument("--disable-radix-cache", action="store_true", help="sglang --disable-radix-cache")
    p.add_argument("--enable-memory-saver", action="store_true", help="sglang --enable-memory-saver")
    p.add_argument(
        "--enable-deterministic-inference", action="store_true", help="sglang --enable-deterministic-inference"
    )
    p.add_argument("--skip-tokenizer-init", action="store_true", help="sglang --skip-tokenizer-init")
    p.add_argument("--random-seed", type=int, default=None, help="sglang --random-seed (default: SGLang's)")
    p.add_argument(
        "--weight-version", default=_F.weight_version.default, help="the weight version every worker starts with"
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model name the workers report (default: the model path)"
    )
    p.add_argument(
        "--api-key", default=None, help="bearer key of every worker and the router (default: none; never printed)"
    )
    p.add_argument(
        "--admin-api-key", default=None, help="key of the workers' control routes (default: none; never printed)"
    )
    p.add_argument("--router", choices=ROUTERS, default=_F.router.default, help="the router in front of the workers")
    policies = sorted({q for qs in ROUTER_POLICIES.values() for q in qs})
    p.add_argument("--policy", default=_F.router_policy.default, help=f"router policy, one of {', '.join(policies)}")
    p.add_argument("--router-port", type=int, default=None, help="router HTTP port (default: a free port)")
    p.add_argument(
        "--router-prometheus-port", type=int, default=None, help="router metrics port (default: a free port)"
    )
    p.add_argument(
        "--health-check-interval",
        type=int,
        default=_F.health_check_interval_s.default,
        help="seconds between router health probes",
    )
    p.add_argument("--disable-retries", action="store_true", help="the router does not resend failed requests")
    router_arg_help = (
        "one extra router argument, repeatable: --router-arg=--worker-warmup-secs --router-arg=0 (default: none)"
    )
    p.add_argument("--router-arg", action="append", default=[], help=router_arg_help)
    p.add_argument("--log-dir", default=None, help="where <process>.log files go (default: a temporary folder)")
    p.add_argument(
        "--keep-run-dir",
        action="store_true",
        help="keep the temporary log folder on exit (it is removed after a clean stop; kept, and its path "
        "printed, when the start failed; --log-dir is always kept)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=None,
        help="seconds to wait for the workers (default: 900 for sglang, 180 for reference)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv, extra = split_passthrough(argv)
    args = build_parser().parse_args(argv)
    args.extra_server_args = extra
    return args


def config_from_args(args: argparse.Namespace) -> SGLangFleetConfig:
    kw: dict[str, Any] = dict(
        model_path=args.model_path,
        workers=args.workers,
        worker_kind=args.worker_kind,
        host=args.host,
        worker_ports=args.worker_ports,
        worker_base_port=args.worker_base_port,
        cuda_visible_devices=args.cuda_visible_devices,
        mem_fraction_static=args.mem_fraction_static,
        page_size=args.page_size,
        attention_backend=args.attention_backend or None,
        sampling_backend=args.sampling_backend or None,
        disable_cuda_graph=not args.enable_cuda_graph,
        disable_radix_cache=args.disable_radix_cache,
        enable_memory_saver=args.enable_memory_saver,
        deterministic_inference=args.enable_deterministic_inference,
        skip_tokenizer_init=args.skip_tokenizer_init,
        random_seed=args.random_seed,
        weight_version=args.weight_version,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        extra_server_args=args.extra_server_args,
        router=args.router,
        router_policy=args.policy,
        router_port=args.router_port,
        router_prometheus_port=args.router_prometheus_port,
        health_check_interval_s=args.health_check_interval,
        router_retries=not args.disable_retries,
        extra_router_args=args.router_arg,
        log_dir=args.log_dir,
        startup_timeout_s=args.startup_timeout,
    )
    return SGLangFleetConfig(**kw)


async def _run(config: SGLangFleetConfig, until_signalled: Callable[[], Awaitable[None]]) -> None:
    print(f"fleet:   {config.describe()}", flush=True)
    async with launch_sglang_fleet(config, progress=stderr_progress) as fleet:
        print(f"router:  {fleet.router_url or '(none)'}", flush=True)
        for wid, url in zip(fleet.worker_ids, fleet.worker_urls, strict=True):
            print(f"worker:  {url}  (id {wid})", flush=True)
        print(f"logs:    {fleet.log_dir}", flush=True)
        print(f"connect: {fleet.connect_url()}", flush=True)
        await until_signalled()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = None
    if args.log_dir is None:  # ours to remove on exit (unless --keep-run-dir)
        run_dir = tempfile.mkdtemp(prefix="rollout-backends-sglang-")
        args.log_dir = run_dir
    status = 1
    try:
        status = run_launcher_cli(lambda: config_from_args(args), _run, preflight=SGLangFleetConfig.preflight)
        return status
    finally:
        if run_dir is not None:
            # A failed start's logs are what explains it: they stay (where anything wrote one).
            if args.keep_run_dir or (status == 1 and any(Path(run_dir).iterdir())):
                print(f"kept:    {run_dir}", file=sys.stderr, flush=True)
            else:
                shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
