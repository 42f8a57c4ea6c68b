"""Launch vLLM servers, print their URLs, keep them up until Ctrl-C.

    rollout-backends launch vllm --model-path DIR --workers 2 --gpus 0 1 \
        [--transfer-backend nccl|ipc] [--sleep-mode] [-- <extra vllm serve args>]

Each server is ``vllm serve`` (0.26) with ``VLLM_SERVER_DEV_MODE=1`` (the RL routes the adapter
drives); there is no router: the backend hands unpinned requests to each server in turn. Prints a
``connect:`` line that ``rollout_backends.open_backend`` opens. Everything it started is stopped on
Ctrl-C or SIGTERM. ``--`` ends our flags; what follows goes verbatim to every server. Behind Dynamo:
``rollout-backends launch dynamo --worker-kind vllm``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable, Sequence

from rollout_backends.launch import HelpFormatter, run_launcher_cli, split_passthrough, stderr_progress

from ._launcher import VllmFleetConfig, launch_vllm_fleet

__all__ = ["build_parser", "config_from_args", "main", "parse_args"]

PROG = "rollout-backends launch vllm"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model-path", required=True, help="model directory every server loads")
    p.add_argument("--workers", type=int, default=1, help="number of servers")
    p.add_argument(
        "--gpus", nargs="+", default=None, help="CUDA_VISIBLE_DEVICES per server, e.g. 0 1 (default: all on 0)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address every server binds")
    p.add_argument("--served-model-name", default=None, help="the model name the servers report (default: the path)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size of each server")
    p.add_argument(
        "--transfer-backend",
        choices=("nccl", "ipc"),
        default=None,
        help="--weight-transfer-config backend: nccl (distributed updates) or ipc (tensor updates); default: none",
    )
    p.add_argument("--sleep-mode", action="store_true", help="--enable-sleep-mode (memory release and resume)")
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=None, help="per server (default: vLLM's, split when shared)"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--attention-backend", default="TRITON_ATTN", help="--attention-backend ('' leaves it out)")
    p.add_argument("--cuda-graphs", action="store_true", help="do not pass --enforce-eager (slower start-up)")
    p.add_argument("--batch-invariant", action="store_true", help="VLLM_BATCH_INVARIANT=1 (batch-invariant kernels)")
    p.add_argument("--seed", type=int, default=None, help="--seed (default: vLLM's)")
    p.add_argument("--log-dir", default=None, help="where <process>.log files go (default: a temporary folder)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the servers")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv, extra = split_passthrough(argv)
    args = build_parser().parse_args(argv)
    args.extra_server_args = extra
    return args


def config_from_args(args: argparse.Namespace) -> VllmFleetConfig:
    return VllmFleetConfig(
        model_path=args.model_path,
        workers=args.workers,
        host=args.host,
        gpus=tuple(args.gpus or ()),
        served_model_name=args.served_model_name,
        tp=args.tp,
        transfer_backend=args.transfer_backend,
        sleep_mode=args.sleep_mode,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend or None,
        enforce_eager=not args.cuda_graphs,
        batch_invariant=args.batch_invariant,
        seed=args.seed,
        extra_args=tuple(args.extra_server_args),
        log_dir=args.log_dir,
        startup_timeout_s=args.startup_timeout,
    )


async def _run(config: VllmFleetConfig, until_signalled: Callable[[], Awaitable[None]]) -> None:
    async with launch_vllm_fleet(config, progress=stderr_progress) as fleet:
        for url in fleet.worker_urls:
            print(f"server:  {url}", flush=True)
        print(f"logs:    {fleet.log_dir}", flush=True)
        print(f"connect: {fleet.connect_url()}", flush=True)
        await until_signalled()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_launcher_cli(lambda: config_from_args(args), _run)


if __name__ == "__main__":
    sys.exit(main())
