"""``--engine-factory tests.sglang.slow_engine:factory``: the reference engine, each forward at least
``STEP_S`` long, so that a request of N tokens stays in flight for at least N * STEP_S seconds
whatever the machine's speed or load (the pause tests act on a request in flight: on two loaded
cores a 200-token request of the plain engine once finished in 0.21 s, before the pause landed)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rollout_backends.adapters.reference import ReferenceEngine

#: The shortest forward (seconds).
STEP_S = 0.01


class SlowReferenceEngine(ReferenceEngine):
    def _step(self, req: Any) -> Any:
        # The engine's worker thread: sleeping here delays this forward only, never the event loop.
        time.sleep(STEP_S)
        return super()._step(req)


def factory(args: argparse.Namespace) -> SlowReferenceEngine:
    return SlowReferenceEngine(
        args.model_path,
        worker_id=args.worker_id or f"{args.host}:{args.port}",
        weight_version=args.weight_version,
        page_size=args.page_size,
    )
