"""NCCL between two GPUs on the GPU machine: the default group, then our SGLang-style group.

PYTHONPATH=bench python3 -m rb_bench.nccl_diag     (run with NCCL_DEBUG=WARN to see why a case hangs)
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
import traceback


def worker(rank: int, case: str, port: int, q: mp.Queue[str]) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        t = torch.full((1024,), float(rank + 1), device=f"cuda:{rank}")
        t0 = time.time()
        if case == "default":
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
            dist.broadcast(t, src=0)
        else:
            from .weightsync import broadcast, open_group

            pg = open_group("nccl", "127.0.0.1", port, rank, 2, "diag", 30.0)
            broadcast(pg, [t], torch.device(f"cuda:{rank}"))
        torch.cuda.synchronize()
        q.put(f"{case} rank {rank}: ok value {t[0].item()} in {time.time() - t0:.2f}s")
    except Exception:
        q.put(f"{case} rank {rank}: {traceback.format_exc()[-800:]}")


def main() -> int:
    ctx = mp.get_context("spawn")
    for i, case in enumerate(("default", "custom")):
        q: mp.Queue[str] = ctx.Queue()
        ps = [ctx.Process(target=worker, args=(r, case, 29600 + i, q)) for r in range(2)]
        for p in ps:
            p.start()
        for p in ps:
            p.join(45)
        for p in ps:
            if p.is_alive():
                p.kill()
                print(f"{case}: rank process {p.pid} hung (killed after 45 s)", flush=True)
        while not q.empty():
            print(q.get(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
