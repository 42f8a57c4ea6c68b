"""Soak: requests through a Dynamo mocker fleet; none lost, client memory and descriptors flat.

CI: 3,000 requests; ``RB_RELIABILITY_FULL=1``: 100,000 (also ``python -m rb_bench.soak``).
"""

from __future__ import annotations

from typing import Any

import pytest

from rb_bench.soak import main, soak

from .conftest import HAS_DYNAMO, size

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_DYNAMO, reason="ai-dynamo is not installed")]


async def test_soak(no_orphans: None, figures: dict[str, Any]) -> None:
    n = size(3000, 100_000)
    out = await soak(requests=n, workers=2, concurrency=64, progress=False)
    run, client = out["run"], out["client"]
    print(f"\nsoak: {run}\nclient: {client}")
    assert run["sent"] == n and run["completed"] == n and run["lost"] == 0 and not run["failed"]
    assert run["max_latency_s"] < 10
    # Flat: no socket or fd growth while the pool is warm; sockets released on close.
    assert client["socket_growth"] <= 0 and client["fd_growth"] <= 0, client
    assert client["after_close"]["sockets"] <= client["baseline"]["sockets"] + 2, client
    assert client["rss_growth_kib"] < 8 * 1024, client
    figures["soak"] = out


def test_soak_cli_parses() -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
