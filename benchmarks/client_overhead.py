"""Client overhead per /generate: raw aiohttp, raw httpx, Miles' httpx pattern and ours.

A thin script over ``rollout_backends._bench.overhead`` (installed, so ``rollout-backends bench
overhead`` runs the same code)::

    python -m benchmarks.client_overhead --json out.json --plot docs/img/client_overhead.png
    python -m benchmarks.client_overhead --smoke
"""

from __future__ import annotations

import sys

from rollout_backends._bench.overhead import main

if __name__ == "__main__":
    sys.exit(main())
