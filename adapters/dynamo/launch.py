"""Launch a Dynamo fleet (frontend + workers), print its URLs, keep it up until Ctrl-C.

    rollout-backends launch dynamo --model-path DIR --workers 2 \
        --router-mode kv [--worker-kind reference] [--gpus 0 1] [-- <extra worker args>]

Workers run dynamo.sglang (GPU) unless --worker-kind says vllm (dynamo.vllm, vLLM 0.26; GPU),
reference (our Dynamo worker over the CPU reference engine) or mocker (dynamo.mocker, CPU); the
first line printed says which. The defaults are those of DynamoFleetConfig (Python), read from it.
Prints each URL and a connect: line that rollout_backends.open_backend opens. Everything it started
is stopped on Ctrl-C or SIGTERM, and the temporary run folder is removed unless --keep-run-dir, or
unless the start failed (its logs stay; the error names them); --log-dir logs always stay. -- ends
our flags; what follows is passed verbatim to every dynamo.sglang / dynamo.vllm / mocker worker.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable, Sequence

import attrs

from rollout_backends.launch import HelpFormatter, run_launcher_cli, split_passthrough, stderr_progress

from ._commands import MOCKER_ENGINE_TYPES
from ._launcher import ROUTER_MODES, WORKER_KIND_DESCRIPTIONS, DynamoFleetConfig, launch_dynamo_fleet

__all__ = ["build_parser", "config_from_args", "main", "parse_args"]


PROG = "rollout-backends launch dynamo"

#: The config's fields: every flag's default is the field's (one set of defaults, CLI and Python).
_F = attrs.fields(DynamoFleetConfig)


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
    p.add_argument(
        "--router-mode", choices=ROUTER_MODES, default=_F.router_mode.default, help="the frontend's --router-mode"
    )
    p.add_argument(
        "--page-size", type=int, default=_F.page_size.default, help="KV block size (tokens; >= 2 for the KV router)"
    )
    p.add_argument(
        "--mocker-engine-type", choices=MOCKER_ENGINE_TYPES, default="sglang", help="mocker: the scheduler it simulates"
    )
    p.add_argument(
        "--transfer-backend",
        choices=("nccl", "ipc"),
        default=None,
        help="vllm workers' --weight-transfer-config backend: nccl (distributed loads) or ipc (tensor loads); "
        "default: none (disk loads only)",
    )
    p.add_argument("--no-kv-events", action="store_true", help="approximate KV routing (--no-router-kv-events)")
    p.add_argument("--router-predicted-ttl-secs", type=float, default=None, help="predict-on-route TTL (default: off)")
    p.add_argument(
        "--session-affinity-ttl-secs",
        type=int,
        default=None,
        help="keep a routing key's requests (x-dynamo-session-id; Miles' sessions) on one worker until the key "
        "idles this long (the frontend's --router-session-affinity-ttl-secs; default: off)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=_F.stream_interval.default,
        help="SGLang --stream-interval of sglang workers (0: SGLang's own, 1)",
    )
    p.add_argument(
        "--gpus",
        nargs="+",
        default=None,
        help="CUDA_VISIBLE_DEVICES per sglang or vllm worker, e.g. 0 1 (default: 0, 1, ...)",
    )
    p.add_argument("--host", default=_F.host.default, help="address every process binds")
    p.add_argument("--http-port", type=int, default=None, help="the frontend's HTTP port (default: a free port)")
    p.add_argument("--discovery", choices=("file", "etcd"), default=_F.discovery.default, help="how workers are found")
    p.add_argument(
        "--etcd-endpoint",
        action="append",
        default=[],
        help="etcd endpoint for --discovery etcd, repeatable (default: none; --start-etcd starts one)",
    )
    p.add_argument("--start-etcd", action="store_true", help="start etcd for --discovery etcd with the fleet")
    p.add_argument(
        "--weight-version", default=_F.weight_version.default, help="the weight version every worker starts with"
    )
    p.add_argument(
        "--log-dir", default=None, help="where <process>.log files go (default: logs/ in the temporary run folder)"
    )
    p.add_argument(
        "--keep-run-dir",
        action="store_true",
        help="keep the temporary run folder (discovery files, logs) on exit; it is removed after a clean stop "
        "(a failed start keeps its logs)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv, extra = split_passthrough(argv)
    args = build_parser().parse_args(argv)
    args.extra_worker_args = extra
    return args


def config_from_args(args: argparse.Namespace) -> DynamoFleetConfig:
    return DynamoFleetConfig(
        model_path=args.model_path,
        workers=args.workers,
        worker_kind=args.worker_kind,
        router_mode=args.router_mode,
        page_size=args.page_size,
        kv_events=not args.no_kv_events,
        router_predicted_ttl_secs=args.router_predicted_ttl_secs,
        session_affinity_ttl_secs=args.session_affinity_ttl_secs,
        stream_interval=args.stream_interval or None,
        gpus=tuple(args.gpus or ()),
        host=args.host,
        http_port=args.http_port,
        discovery=args.discovery,
        etcd_endpoints=tuple(args.etcd_endpoint),
        start_etcd=args.start_etcd,
        weight_version=args.weight_version,
        mocker_engine_type=args.mocker_engine_type,
        transfer_backend=args.transfer_backend,
        # The arguments after ``--`` go to the workers of the kind launched.
        mocker_args=tuple(args.extra_worker_args) if args.worker_kind == "mocker" else (),
        vllm_args=tuple(args.extra_worker_args) if args.worker_kind == "vllm" else (),
        sglang_args=tuple(args.extra_worker_args) if args.worker_kind not in ("mocker", "vllm") else (),
    )


async def _run(
    config: DynamoFleetConfig, args: argparse.Namespace, until_signalled: Callable[[], Awaitable[None]]
) -> None:
    print(f"fleet:    {config.describe()}", flush=True)
    async with launch_dynamo_fleet(
        config, log_dir=args.log_dir, progress=stderr_progress, keep_run_dir=args.keep_run_dir
    ) as fleet:
        print(f"frontend: {fleet.frontend_url}  (namespace {fleet.namespace})", flush=True)
        for name, url in zip(fleet.worker_names, fleet.worker_urls, strict=True):
            print(f"worker:   {name}  control {url}", flush=True)
        print(f"logs:     {fleet.log_dir}", flush=True)
        if args.keep_run_dir:
            print(f"run dir:  {fleet.run_dir} (kept)", flush=True)
        print(f"connect:  {fleet.connect_url()}", flush=True)
        await until_signalled()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_launcher_cli(
        lambda: config_from_args(args),
        lambda config, until: _run(config, args, until),
        preflight=DynamoFleetConfig.preflight,
    )


if __name__ == "__main__":
    sys.exit(main())
