"""Session affinity through Dynamo (issue 27 item 3): Miles' session server sends every turn of a
session with ``X-SMG-Routing-Key``; the facade carries it as ``GenerateRequest.routing_key``, the
Dynamo wire as ``x-dynamo-session-id``, the header the frontend's session affinity keys on
(``--router-session-affinity-ttl-secs``, 1.4.2 and 1.6.1). Real frontend (round robin: without
affinity every session moves at each turn), two reference workers, the Miles facade in front.
Before, the wire dropped the key and sessions spread over the workers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from rollout_backends.adapters.dynamo import DynamoFleet, launch_dynamo_fleet
from rollout_backends.integrations.miles import MilesFacade, RunningFacade, start_facade
from tests.affinity_sessions import assert_sticky_and_cached, moved, run_sessions

from .conftest import HAS_DYNAMO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HAS_DYNAMO, reason="ai-dynamo is not installed"),
    pytest.mark.asyncio(loop_scope="module"),
]

PAGE = 16


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def facade(tiny_model: Path, no_orphans: None) -> AsyncIterator[RunningFacade]:
    from transformers import AutoTokenizer

    cfg = DynamoFleet(
        model_path=tiny_model,
        workers=2,
        worker_kind="reference",
        router_mode="round-robin",
        page_size=PAGE,
        session_affinity_ttl_secs=600,
    )
    async with launch_dynamo_fleet(cfg) as fleet:
        backend = await fleet.connect()
        w0, w1 = backend.workers
        # Which worker served a turn: each is given its own label, every answer carries it.
        await backend.set_weight_version("A", workers=[w0])
        await backend.set_weight_version("B", workers=[w1])
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
        running = await start_facade(MilesFacade(backend, tokenizer=tokenizer, model_path="tiny"), port=0)
        try:
            yield running
        finally:
            await running.stop()


async def test_a_session_stays_on_one_worker_and_finds_its_prefix_cached(facade: RunningFacade) -> None:
    keyed = await run_sessions(facade.url, keyed=True, base=10)
    assert_sticky_and_cached(keyed, PAGE)
    assert {rows[0][0] for rows in keyed.values()} == {"A", "B"}  # sessions still spread over workers
    unkeyed = await run_sessions(facade.url, keyed=False, base=11)
    assert moved(unkeyed), unkeyed  # the frontend's round robin, where no key is sent
