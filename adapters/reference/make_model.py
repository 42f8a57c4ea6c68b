"""``python -m rollout_backends.adapters.reference.make_model OUT [--seed N] [--size tiny]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._model import SIZES, make_tiny_model


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m rollout_backends.adapters.reference.make_model",
        description="Write a Qwen2-architecture model with seeded random weights and a BPE tokenizer.",
    )
    ap.add_argument("out", help="output directory (created if missing)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--init-std", type=float, default=None, help="weight init std (default: the size's)")
    args = ap.parse_args(argv)
    path = make_tiny_model(args.out, seed=args.seed, size=args.size, init_std=args.init_std)
    print(f"wrote {path} (size={args.size}, seed={args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
