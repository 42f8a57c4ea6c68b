"""Command line: launch a Dynamo fleet (frontend + workers), print its URLs, keep it up until Ctrl-C.

    python -m rollout_backends.adapters.dynamo.launch --model-path DIR --workers 2 \
        --worker-kind sglang --router-mode kv [--gpus 0 1] [-- <extra dynamo.sglang args>]

Everything it started is stopped on Ctrl-C or SIGTERM. ``--`` ends our flags; what follows is
passed verbatim to every ``dynamo.sglang`` worker.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable, Sequence

from rollout_backends.launch import run_launcher_cli, split_passthrough, stderr_progress

from ._commands import DEFAULT_STREAM_INTERVAL
from ._launcher import ROUTER_MODES, WORKER_KINDS, DynamoFleet, launch_dynamo_fleet

__all__ = ["config_from_args", "main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv, extra = split_passthrough(argv)
    p = argparse.ArgumentParser(
        prog="rollout-backends launch dynamo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--worker-kind", choices=WORKER_KINDS, default="sglang")
    p.add_argument("--router-mode", choices=ROUTER_MODES, default="kv")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--no-kv-events", action="store_true", help="approximate KV routing (--no-router-kv-events)")
    p.add_argument("--router-predicted-ttl-secs", type=float, default=None, help="predict-on-route")
    p.add_argument(
        "--stream-interval",
        type=int,
        default=DEFAULT_STREAM_INTERVAL,
        help=f"SGLang --stream-interval of sglang workers (default {DEFAULT_STREAM_INTERVAL}; 0: SGLang's own, 1)",
    )
    p.add_argument("--gpus", nargs="+", default=None, help="CUDA_VISIBLE_DEVICES per worker, e.g. 0 1")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=None)
    p.add_argument("--discovery", choices=("file", "etcd"), default="file")
    p.add_argument("--etcd-endpoint", action="append", default=[], help="etcd endpoint (repeatable)")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    args.extra_worker_args = extra
    return args


def config_from_args(args: argparse.Namespace) -> DynamoFleet:
    return DynamoFleet(
        model_path=args.model_path,
        workers=args.workers,
        worker_kind=args.worker_kind,
        router_mode=args.router_mode,
        page_size=args.page_size,
        kv_events=not args.no_kv_events,
        router_predicted_ttl_secs=args.router_predicted_ttl_secs,
        stream_interval=args.stream_interval or None,
        gpus=tuple(args.gpus or ()),
        host=args.host,
        http_port=args.http_port,
        discovery=args.discovery,
        etcd_endpoints=tuple(args.etcd_endpoint),
        weight_version=args.weight_version,
        sglang_args=tuple(args.extra_worker_args),
    )


async def _run(config: DynamoFleet, log_dir: str | None, until_signalled: Callable[[], Awaitable[None]]) -> None:
    async with launch_dynamo_fleet(config, log_dir=log_dir, progress=stderr_progress) as fleet:
        print(f"frontend: {fleet.frontend_url}  (namespace {fleet.namespace})", flush=True)
        for name, url in zip(fleet.worker_names, fleet.worker_urls, strict=True):
            print(f"worker:   {name}  control {url}", flush=True)
        print(f"logs:     {fleet.run_dir}", flush=True)
        hostport = fleet.frontend_url.split("://", 1)[1]
        workers = ",".join(u.split("://", 1)[1] for u in fleet.worker_urls)
        print(f"connect:  dynamo://{hostport}?workers={workers}", flush=True)
        await until_signalled()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_launcher_cli(lambda: config_from_args(args), lambda config, until: _run(config, args.log_dir, until))


if __name__ == "__main__":
    sys.exit(main())
