"""Fuzzed bad input over HTTP: raw aiohttp posts of malformed bodies to ``/generate`` and every
control route of a real reference server (its own process, real tiny engine).

Every answer is a 4xx with a message (or a 2xx for a body that happens to be valid), never a 5xx,
never a hang; afterwards the server is healthy and a normal request returns the same tokens.
CI: 200 examples; ``RB_RELIABILITY_FULL=1``: 3,000 (with the 7,000 of ``test_fuzz_api.py``: 10,000).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_backends._supervisor import ProcessSpec, Supervisor, free_port

from .conftest import FULL, size

pytestmark = pytest.mark.slow

EXAMPLES = size(200, 3000)
ANSWER_TIMEOUT_S = 10.0
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=not FULL,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
GREEDY = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}

#: Every POST route and the keys its body takes (a fuzzed body mixes these with junk).
ROUTES: dict[str, list[str]] = {
    "/generate": ["input_ids", "sampling_params", "rid", "return_logprob", "stream", "text", "logprob_start_len",
                  "return_prompt_token_ids", "top_logprobs_num"],
    "/abort_request": ["rid", "abort_all"],
    "/pause_generation": ["mode"],
    "/continue_generation": [],
    "/flush_cache": [],
    "/update_weight_version": ["new_version", "abort_all_requests"],
    "/update_weights_from_disk": ["model_path", "load_format", "weight_version", "flush_cache", "abort_all_requests"],
    "/update_weights_from_tensor": ["serialized_named_tensors", "load_format", "weight_version", "flush_cache"],
    "/init_weights_update_group": ["master_address", "master_port", "rank_offset", "world_size", "group_name",
                                   "backend"],
    "/update_weights_from_distributed": ["names", "dtypes", "shapes", "group_name", "weight_version", "flush_cache"],
    "/destroy_weights_update_group": ["group_name"],
    "/begin_weight_update": ["selector"],
    "/end_weight_update": [],
    "/release_memory_occupation": ["tags"],
    "/resume_memory_occupation": ["tags"],
}  # fmt: skip
SAMPLING_KEYS = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos",
                 "min_new_tokens", "sampling_seed", "n", "stop", "repetition_penalty", "logit_bias",
                 "bogus"]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),  # any unicode, surrogates excluded by JSON encoding below
    st.sampled_from(["retract", "abort", "in_place", "weights", "kv_cache", "all", "", "\u202e\x00", "../../etc"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=5), inner, max_size=4)),
    max_leaves=12,
)
huge = st.sampled_from(
    [
        list(range(5000)),  # longer than the context
        [0] * 20000,
        "x" * 200_000,
        [[1, 2]] * 50,
        {"k" * 100: 1},
    ]
)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(sorted(ROUTES)))
    kind = draw(st.sampled_from(["object", "object", "object", "raw", "json-not-object"]))
    if kind == "raw":
        raw = draw(st.one_of(st.binary(max_size=64), st.sampled_from([b"{", b"[1,", b"\xff\xfe", b"{}}", b"NaN"])))
        return route, raw
    if kind == "json-not-object":
        return route, json.dumps(draw(values)).encode()
    keys = ROUTES[route] + ["unknown_key"]
    body: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(keys), max_size=len(keys), unique=True)):
        body[key] = draw(st.one_of(values, huge))
    if route == "/generate" and draw(st.booleans()):
        sp = {k: draw(values) for k in draw(st.lists(st.sampled_from(SAMPLING_KEYS), max_size=4, unique=True))}
        body["sampling_params"] = sp
        body.setdefault("input_ids", draw(st.lists(st.integers(-5, 2000), min_size=0, max_size=8)))
    if route == "/init_weights_update_group":
        body["master_port"] = "not-a-port"  # never a real rendezvous (it would wait for a trainer)
    return route, json.dumps(body).encode()


class Loop:
    """An event loop in a thread with one aiohttp session: hypothesis examples stay synchronous."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.session: aiohttp.ClientSession = self.run(self._session())

    async def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def close(self) -> None:
        self.run(self.session.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Loop]]:
    port = free_port()
    argv = [sys.executable, "-m", "rollout_backends.adapters.reference.serve", "--model-path", str(tiny_model),
            "--port", str(port), "--weight-version", "v0", "--with-begin-end"]  # fmt: skip
    lp = Loop()
    sup = Supervisor(tmp_path_factory.mktemp("fuzz-logs"), grace=5)
    try:
        lp.run(sup.start(ProcessSpec(name="ref", argv=argv, ready=f"http://127.0.0.1:{port}/health", ports=[port],
                                     env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"})))  # fmt: skip
        lp.run(sup.wait_ready(timeout=120), timeout=130)
        yield f"http://127.0.0.1:{port}", lp
    finally:
        lp.run(sup.aclose())
        lp.close()


async def _post(session: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, bytes]:
    timeout = aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S)
    headers = {"Content-Type": "application/json"}
    async with session.post(url, data=data, headers=headers, timeout=timeout) as r:
        return r.status, await r.read()


async def _reset(session: aiohttp.ClientSession, base: str) -> None:
    """Undo what a body that happened to be valid may have done (pause, released memory, session)."""
    for path in ("/continue_generation", "/resume_memory_occupation", "/end_weight_update"):
        async with session.post(base + path, json={}) as r:
            await r.read()


STATS: Counter[str] = Counter()


@SETTINGS
@given(case=bodies())
def test_malformed_bodies_get_4xx_never_5xx_or_hang(server: tuple[str, Loop], case: tuple[str, bytes]) -> None:
    base, lp = server
    route, data = case
    t0 = time.monotonic()
    status, body = lp.run(_post(lp.session, base + route, data), timeout=ANSWER_TIMEOUT_S + 5)
    elapsed = time.monotonic() - t0
    STATS[f"{status // 100}xx"] += 1
    STATS["max_ms"] = max(STATS["max_ms"], int(elapsed * 1000))
    assert status < 500, (route, data[:300], status, body[:300])
    if status >= 400:
        assert body.strip(), (route, status)  # a message, not an empty 4xx
    if status < 300 and route != "/generate":
        lp.run(_reset(lp.session, base))


def test_server_still_healthy_and_exact(server: tuple[str, Loop], tiny_model: Path, figures: dict[str, Any]) -> None:
    """Runs after the fuzzing (file order): health and tokens are unchanged."""
    base, lp = server

    async def check() -> tuple[int, Any, Any]:
        s = lp.session
        async with s.get(base + "/health") as r:
            health = r.status
        async with s.post(base + "/update_weight_version", json={"new_version": "v0"}) as r:
            await r.read()
        async with s.post(base + "/generate", json=GREEDY) as r:
            a = await r.json()
        async with s.post(base + "/generate", json=GREEDY) as r:
            b = await r.json()
        return health, a, b

    health, a, b = lp.run(check())
    assert health == 200
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 6
    # the tokens of a fresh engine for this prompt (greedy, tiny model seed 0)
    from rollout_backends.adapters.reference import ReferenceBackend

    async def fresh() -> tuple[int, ...]:
        from rollout_backends import GenerateRequest, SamplingParams

        async with ReferenceBackend.create(tiny_model) as rb:
            g = await rb.generate(
                GenerateRequest(input_ids=GREEDY["input_ids"], sampling=SamplingParams(**GREEDY["sampling_params"]))
            )
            return g.output_ids

    assert tuple(a["output_ids"]) == asyncio.run(fresh())
    figures["fuzz_http"] = {"examples": EXAMPLES, "answers": dict(STATS), "routes": len(ROUTES)}
    print(f"\nhttp fuzz: {dict(STATS)}")
