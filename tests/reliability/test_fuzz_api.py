"""Fuzzed bad input at the Python API: every malformed value is an ``InvalidRequest`` naming its field
(or ``Unsupported``), never a ``TypeError``/``AttributeError`` from deep inside.

CI: ~100 examples per test; ``RB_RELIABILITY_FULL=1``: 1,000 per test.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_backends import (
    ControlFailed,
    GenerateRequest,
    InvalidRequest,
    SamplingParams,
    TensorSpec,
    Unsupported,
    WeightBucket,
    WeightGroup,
)
from tests.fake_sglang import FakeSGLangFleet

from .conftest import FULL, size

EXAMPLES = size(100, 1000)
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=not FULL,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=6),
    st.lists(st.integers(-3, 10**6), max_size=12),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.tuples(st.integers(-3, 5), st.text(max_size=2)),
    st.just(object()),
)
plausible_int = st.one_of(st.integers(-5, 300), junk)
plausible_float = st.one_of(st.floats(-3, 3), st.sampled_from([0.0, 1.0, math.inf, -0.0]), junk)
SAMPLING_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_new_tokens": plausible_int,
    "temperature": plausible_float,
    "top_p": plausible_float,
    "top_k": plausible_int,
    "min_p": plausible_float,
    "min_new_tokens": plausible_int,
    "stop_token_ids": st.one_of(st.lists(st.integers(-3, 10**9), max_size=5), junk),
    "ignore_eos": st.one_of(st.booleans(), junk),
    "seed": st.one_of(st.integers(-5, 2**64), junk),
    "repetition_penalty": plausible_float,
    "frequency_penalty": plausible_float,
    "presence_penalty": plausible_float,
}


def _fields(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


def _expect(call: Any, prefix: str | tuple[str, ...]) -> Any:
    """Run ``call``: a value, or ``InvalidRequest`` whose field starts with ``prefix``."""
    try:
        return call()
    except InvalidRequest as exc:
        assert exc.field.startswith(prefix), (exc.field, prefix, str(exc))
        assert str(exc).startswith(exc.field) and exc.reason
        return None


@SETTINGS
@given(_fields(SAMPLING_FIELDS))
def test_sampling_params(kwargs: dict[str, Any]) -> None:
    sp = _expect(lambda: SamplingParams(**kwargs), "sampling.")
    if sp is not None:  # what was accepted is sane
        # 0 is a zero-budget re-scoring budget: GenerateRequest refuses it without prompt_logprobs_start.
        assert isinstance(sp.max_new_tokens, int) and sp.max_new_tokens >= 0
        assert all(isinstance(t, int) and t >= 0 for t in sp.stop_token_ids)
        assert math.isfinite(sp.temperature) and sp.temperature >= 0


@SETTINGS
@given(st.dictionaries(st.one_of(st.sampled_from(sorted(SAMPLING_FIELDS)), st.text(max_size=8)), junk, max_size=5))
def test_sampling_from_mapping(data: dict[str, Any]) -> None:
    _expect(lambda: SamplingParams.from_mapping(data), "sampling.")


@SETTINGS
@given(
    _fields(
        {
            "input_ids": st.one_of(st.lists(st.integers(-2, 2**40), max_size=30), junk),
            "request_id": st.one_of(st.text(max_size=40), junk),
            "return_logprobs": st.one_of(st.booleans(), junk),
            "worker": st.one_of(st.sampled_from(["w0", "w1"]), junk),
            "routing_key": st.one_of(st.text(max_size=10), junk),
            "sampling": st.one_of(st.just(SamplingParams(max_new_tokens=2)), junk),
        }
    )
)
def test_generate_request_through_a_backend(kwargs: dict[str, Any]) -> None:
    fields = ("input_ids", "request_id", "return_logprobs", "worker", "routing_key", "sampling")
    kwargs.setdefault("input_ids", [1, 2])
    req = _expect(lambda: GenerateRequest(**kwargs), fields)
    if req is None:
        return
    fleet = FakeSGLangFleet(2)
    backend = fleet.backend()
    try:
        gen = asyncio.run(backend.generate(req))
    except InvalidRequest as exc:
        assert exc.field.startswith(("input_ids", "worker")), exc
    except Unsupported:
        pass
    else:
        assert len(gen.output_ids) == req.sampling.max_new_tokens


@SETTINGS
@given(
    _fields(
        {
            "master_address": st.one_of(st.text(max_size=10), junk),
            "master_port": plausible_int,
            "world_size": plausible_int,
            "rank_offset": plausible_int,
            "group_name": st.one_of(st.text(max_size=10), junk),
            "backend": st.one_of(st.sampled_from(["nccl", "gloo"]), junk),
        }
    )
)
def test_weight_group(kwargs: dict[str, Any]) -> None:
    kwargs.setdefault("master_address", "127.0.0.1")
    kwargs.setdefault("master_port", 29500)
    kwargs.setdefault("world_size", 2)
    _expect(lambda: WeightGroup(**kwargs), "group.")


@SETTINGS
@given(
    st.lists(
        st.tuples(
            st.one_of(st.text(max_size=6), junk),
            st.one_of(st.sampled_from(["bfloat16", "float32"]), junk),
            st.one_of(st.lists(st.integers(-2, 8), max_size=3), junk),
        ),
        max_size=4,
    ),
    st.one_of(st.none(), junk),
)
def test_weight_bucket(specs: list[tuple[Any, Any, Any]], raw: Any) -> None:
    def build() -> WeightBucket:
        return WeightBucket(tuple(TensorSpec(n, d, s) for n, d, s in specs))

    _expect(build, ("tensor", "bucket"))
    _expect(lambda: WeightBucket(raw), ("tensor", "bucket"))


CONTROL_CALLS = [
    "pause",
    "resume",
    "flush_cache",
    "abort",
    "abort_all",
    "set_weight_version",
    "update_weights_from_disk",
    "update_weights_from_distributed",
    "init_weight_group",
    "release_memory",
    "begin_weight_update",
    "weight_update",
]


@SETTINGS
@given(st.sampled_from(CONTROL_CALLS), junk, junk, st.one_of(st.none(), st.just(["w0"]), junk))
def test_control_payloads(call: str, a: Any, b: Any, workers: Any) -> None:
    """Junk arguments to every control call: typed errors only, and the fleet is left unchanged."""
    fleet = FakeSGLangFleet(2)
    backend = fleet.backend()

    async def run() -> None:
        if call == "pause":
            await backend.pause(a, workers=workers)
        elif call == "resume":
            await backend.resume(workers=workers)
        elif call == "flush_cache":
            await backend.flush_cache(workers=workers)
        elif call == "abort":
            await backend.abort(a)
        elif call == "abort_all":
            await backend.abort_all(workers=workers)
        elif call == "set_weight_version":
            await backend.set_weight_version(a, workers=workers)
        elif call == "update_weights_from_disk":
            await backend.update_weights_from_disk(a, version=b, workers=workers)
        elif call == "update_weights_from_distributed":
            await backend.update_weights_from_distributed(a, version=b, workers=workers)
        elif call == "init_weight_group":
            await backend.init_weight_group(a, workers=workers)
        elif call == "release_memory":
            await backend.release_memory(a, workers=workers)
        elif call == "begin_weight_update":
            await backend.begin_weight_update(a, workers=workers)
        else:
            async with backend.weight_update(a) as tx:
                await tx.update_from_disk(b)

    versions = {w.url: w.version for w in fleet.workers.values()}
    try:
        asyncio.run(run())
    except (InvalidRequest, Unsupported, ControlFailed) as exc:
        assert str(exc)
        if isinstance(exc, InvalidRequest):
            assert exc.field
    for w in fleet.workers.values():
        assert isinstance(w.version, str), f"{call} stored a non-string version {w.version!r}"
        assert w.paused is None or call == "pause", f"{call} left {w.url} paused"
    if call not in (
        "set_weight_version",
        "update_weights_from_disk",
        "update_weights_from_distributed",
        "weight_update",
    ):
        assert {w.url: w.version for w in fleet.workers.values()} == versions


def test_fuzz_sizes_are_reported(figures: dict[str, Any]) -> None:
    figures["fuzz_api"] = {"tests": 7, "examples_per_test": EXAMPLES, "total_examples": 7 * EXAMPLES}
    assert attrs.has(SamplingParams)
