"""Command line: launch an SGLang fleet, print its URLs, and keep it up until Ctrl-C.

    python -m rollout_backends.adapters.sglang.launch --model-path DIR --workers 2 \
        --router smg --policy cache_aware [--worker-kind reference] [--cuda-visible-devices 0 1] ...

Everything it started is stopped on Ctrl-C or SIGTERM (SIGTERM to each process group, SIGKILL
after the grace). ``--`` ends our flags; what follows is passed verbatim to every worker.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rollout_backends.launch import run_launcher_cli, split_passthrough, stderr_progress

from ._launcher import ROUTERS, WORKER_KINDS, SGLangFleetConfig, launch_sglang_fleet

__all__ = ["config_from_args", "main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv, extra = split_passthrough(argv)
    p = argparse.ArgumentParser(prog="python -m rollout_backends.adapters.sglang.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model-path", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--worker-kind", choices=WORKER_KINDS, default="sglang")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--worker-ports", type=int, nargs="+", default=None)
    p.add_argument("--worker-base-port", type=int, default=None)
    p.add_argument("--cuda-visible-devices", nargs="+", default=None, help="one value per worker, e.g. 0 1")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--sampling-backend", default="pytorch")
    p.add_argument("--enable-cuda-graph", action="store_true", help="do not pass --disable-cuda-graph")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--admin-api-key", default=None)
    p.add_argument("--router", choices=ROUTERS, default="smg")
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--router-port", type=int, default=None)
    p.add_argument("--router-prometheus-port", type=int, default=None)
    p.add_argument("--health-check-interval", type=int, default=10, help="seconds between router health probes")
    p.add_argument("--disable-retries", action="store_true")
    router_arg_help = "one extra router argument, repeatable: --router-arg=--worker-warmup-secs --router-arg=0"
    p.add_argument("--router-arg", action="append", default=[], help=router_arg_help)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--startup-timeout", type=float, default=None)
    args = p.parse_args(argv)
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
    async with launch_sglang_fleet(config, progress=stderr_progress) as fleet:
        print(f"router:  {fleet.router_url or '(none)'}", flush=True)
        for wid, url in zip(fleet.worker_ids, fleet.worker_urls, strict=True):
            print(f"worker:  {url}  (id {wid})", flush=True)
        print(f"logs:    {fleet.log_dir}", flush=True)
        entry = fleet.entry_url.split("://", 1)[1]
        print(f"connect: sglang://{entry}?workers={','.join(fleet.worker_ids)}", flush=True)
        await until_signalled()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_launcher_cli(lambda: config_from_args(args), _run)


if __name__ == "__main__":
    sys.exit(main())
