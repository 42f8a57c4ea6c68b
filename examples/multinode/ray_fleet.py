"""A fleet across Ray nodes: place engines, generate through the entry, tear down.

    # on a Ray cluster (RAY_ADDRESS set, or --address): GPU SGLang engines behind smg
    python examples/multinode/ray_fleet.py --address auto --engine sglang --model-path /shared/Qwen3-0.6B \
        --engines 4 --gpus-per-engine 1
    # on this machine: a local two-node cluster, CPU reference engines (what tests/multinode does)
    python examples/multinode/ray_fleet.py --local --engine reference

Prints where each engine landed and one generation per engine, then stops everything.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from typing import Any

from rollout_backends import GenerateRequest, SamplingParams
from rollout_backends.launch import EngineCommand, Supervisor


def engine_command(args: argparse.Namespace, model_path: str) -> EngineCommand:
    if args.engine == "reference":
        from rollout_backends.adapters.reference import ReferenceServerCommand

        return ReferenceServerCommand(model_path=model_path)
    from rollout_backends.adapters.sglang import SGLangServerCommand

    return SGLangServerCommand(model_path=model_path, tp=int(args.gpus_per_engine or 1))


async def run(args: argparse.Namespace) -> None:
    import ray

    from rollout_backends.adapters.sglang import SmgRouter
    from rollout_backends.ray import RayFleetConfig, RunningRayFleet, start_local_cluster

    async with Supervisor(tempfile.mkdtemp(prefix="ray-fleet-demo-"), grace=5.0) as sup:
        if args.local:
            await start_local_cluster(sup, nodes=2, num_cpus=1)
        else:
            ray.init(address=args.address, log_to_driver=False)
        model_path = args.model_path
        if model_path is None:
            from rollout_backends.adapters.reference import make_tiny_model

            model_path = str(make_tiny_model(tempfile.mkdtemp(prefix="tiny-"), seed=0))
        spec = RayFleetConfig(
            engine=engine_command(args, model_path),
            num_engines=args.engines,
            cpus_per_engine=args.cpus_per_engine,
            gpus_per_engine=args.gpus_per_engine,
            strategy="STRICT_SPREAD" if args.local else args.strategy,
            entry=SmgRouter(policy="round_robin"),
            bind_host="127.0.0.1" if args.local else None,
        )
        async with await RunningRayFleet.launch(spec) as fleet:
            for e in fleet.engines:
                where = f"node {e.node_id} ({e.node_ip}) pid {e.pid}"
                print(f"engine {e.index}: {where} url {e.generate_url} gpus {list(e.gpu_ids)}")
            backend = await fleet.connect()
            sampling = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
            for w in backend.workers:
                gen: Any = await backend.generate(GenerateRequest(input_ids=(5, 6, 7, 8), sampling=sampling, worker=w))
                print(f"{w}: {list(gen.output_ids)}")
            routed = await backend.generate(GenerateRequest(input_ids=(5, 6, 7, 8), sampling=sampling))
            print(f"through {fleet.entry_url}: {list(routed.output_ids)}")
        if ray.is_initialized():
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local", action="store_true", help="start a two-node Ray cluster on this machine")
    p.add_argument("--address", default="auto", help="Ray address (without --local)")
    p.add_argument("--engine", choices=["reference", "sglang"], default="reference")
    p.add_argument("--model-path", default=None, help="default: a tiny seeded model (reference only)")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--cpus-per-engine", type=float, default=1.0)
    p.add_argument("--gpus-per-engine", type=float, default=0.0)
    p.add_argument("--strategy", default="SPREAD")
    asyncio.run(run(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
