"""``rollout-backends make-model OUT [--seed N] [--size tiny]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rollout_backends.launch import HelpFormatter

from ._model import SIZES, make_tiny_model


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="rollout-backends make-model",
        description="Write a Qwen2-architecture model with seeded random weights and a BPE tokenizer.",
        formatter_class=HelpFormatter,
    )
    ap.add_argument("out", help="output directory (created if missing)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny", help="size preset")
    ap.add_argument("--init-std", type=float, default=None, help="weight init std (default: the size's)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = make_tiny_model(args.out, seed=args.seed, size=args.size, init_std=args.init_std)
    print(f"wrote {path} (size={args.size}, seed={args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
