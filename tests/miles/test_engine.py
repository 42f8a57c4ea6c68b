"""``RolloutEngine`` driven as Miles' trainer and RolloutManager drive SGLangEngine, on the reference engine.

The engines are called synchronously, as Ray runs actor methods; the backend's coroutines run on
the integration's process-wide loop thread.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

import rollout_backends as rb
from rollout_backends.integrations.miles import EngineCrashed, RolloutEngine, close_backends
from rollout_backends.integrations.miles._engine import _LoopThread
from tests.miles.miles_shapes import make_args

_URLS = itertools.count()


def _payload(obj: Any) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture
def engines(model_dir: Any) -> Iterator[list[RolloutEngine]]:
    # A unique URL per test: the backend is cached per process by URL.
    url = f"reference://{model_dir}?workers=2&weight_version=start{next(_URLS)}"
    args = make_args(rollout_backend_url=url)
    engs = [RolloutEngine(args, rank=i, worker_type="regular", base_gpu_id=i, num_gpus_per_engine=1) for i in range(2)]
    for e in engs:
        e.init(dist_init_addr="127.0.0.1:0", port=0, nccl_port=0, host="127.0.0.1", router_ip=None)
    yield engs
    _LoopThread.get().run(close_backends())


def _gen(engine: RolloutEngine, worker: str, n: int = 6, **kw: Any) -> rb.Generation:
    sampling = rb.SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    req = rb.GenerateRequest(input_ids=[5, 6, 7], sampling=sampling, worker=worker, **kw)
    return engine._run(engine.backend.generate(req), 60)


def test_one_backend_per_process_and_one_worker_per_engine(engines: list[RolloutEngine]) -> None:
    a, b = engines
    assert a.backend is b.backend
    assert (a.worker, b.worker) == ("ref-0", "ref-1")
    assert a.health_generate(timeout=10) is True and b.health_generate() is True
    assert a.get_weight_version().startswith("start")  # type: ignore[union-attr]
    info = a.get_server_info()
    assert info["worker"] == "ref-0" and info["enable_memory_saver"] is True
    assert a.get_topology_info()["node_rank"] == 0


def test_colocated_tensor_update_sequence(engines: list[RolloutEngine], tmp_path: Any) -> None:
    """UpdateWeightFromTensor: pause(mode) → flush → begin(selector) → chunks (version in each) → end →
    continue; no separate update_weight_version call."""
    from safetensors.torch import load_file

    from rollout_backends.adapters.reference import make_tiny_model

    other = make_tiny_model(tmp_path / "m1", seed=1)
    new = load_file(str(other / "model.safetensors"))
    names = sorted(new)
    for e in engines:
        assert e.pause_generation(mode="retract")["status"] == "ok"
        e.flush_cache()
        assert e.begin_weight_update(selector="all")["success"]  # type: ignore[index]
    for e in engines:
        for chunk in (names[: len(names) // 2], names[len(names) // 2 :]):
            result = e.update_weights_from_tensor(
                serialized_named_tensors=[_payload([(n, new[n]) for n in chunk])],
                load_format=None,
                weight_version="1",
                selector="all",
            )
            assert result is not None and result["success"] is True
    for e in engines:
        e.end_weight_update()
        e.continue_generation()
    assert [e.get_weight_version() for e in engines] == ["1", "1"]
    got = [_gen(e, e.worker) for e in engines]
    assert {g.weight_version for g in got} == {"1"}
    fresh = rb.GenerateRequest(
        input_ids=[5, 6, 7], sampling=rb.SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    )
    from rollout_backends.adapters.reference import ReferenceBackend

    ref = ReferenceBackend.create(other, workers=1)
    try:
        expected = engines[0]._run(ref.generate(fresh), 60)
    finally:
        engines[0]._run(ref.aclose())
    assert [g.output_ids for g in got] == [expected.output_ids] * 2


def test_distributed_update_sequence(engines: list[RolloutEngine], tmp_path: Any) -> None:
    """Megatron's broadcast updater over gloo: connect (init groups, rank offsets by GPU count) →
    pause → flush → begin → buckets (version in each) → update_weight_version → end → continue."""
    import torch
    from safetensors.torch import load_file

    from rollout_backends.adapters.reference import WeightSender, free_port, make_tiny_model

    other = make_tiny_model(tmp_path / "m2", seed=2)
    new = load_file(str(other / "model.safetensors"))
    port = free_port()
    world = 1 + len(engines)
    sender = WeightSender("127.0.0.1", port, world_size=world, group_name="miles-pp_0")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [
            pool.submit(e.init_weights_update_group, "127.0.0.1", port, 1 + i, world, "miles-pp_0", "gloo")
            for i, e in enumerate(engines)
        ]
        sender.connect()
        assert all(f.result(60)["success"] for f in futs)  # type: ignore[index]
        for e in engines:
            e.pause_generation(mode="in_place")
            e.begin_weight_update(selector="all")  # in_place: Miles skips flush_cache
        names = sorted(new)
        for bucket in (names[:3], names[3:]):
            named = [(n, new[n]) for n in bucket]
            futs = [
                pool.submit(
                    e.update_weights_from_distributed,
                    names=[n for n, _ in named],
                    dtypes=[t.dtype for _, t in named],  # torch dtypes, as Miles passes them
                    shapes=[t.shape for _, t in named],  # torch.Size
                    group_name="miles-pp_0",
                    selector="all",
                    weight_version="7",
                )
                for e in engines
            ]
            sender.broadcast(named)
            assert all(f.result(60)["success"] for f in futs)  # type: ignore[index]
    for e in engines:
        assert e.update_weight_version(weight_version="7")["new_version"] == "7"  # type: ignore[index]
        e.end_weight_update()
        e.continue_generation()
    for e in engines:
        e.destroy_weights_update_group("miles-pp_0")
        assert e.destroy_weights_update_group("never-created") is not None  # idempotent / swallowed
    sender.close()
    g = _gen(engines[1], "ref-1")
    assert g.weight_version == "7"
    backend = engines[0].backend
    engine0 = backend.engine("ref-0")  # type: ignore[attr-defined]
    assert torch.equal(engine0._params[names[0]].detach().to(new[names[0]].dtype), new[names[0]])


def test_memory_release_resume_really_acts_and_keeps_routing(engines: list[RolloutEngine]) -> None:
    a, b = engines
    before = _gen(a, "ref-0")
    a.release_memory_occupation(tags=None)
    h = a._run(a.backend.health()).worker("ref-0")
    assert not h.ready and "weights released" in (h.error or "")
    assert a.released_memory == frozenset(rb.MemoryTag)
    # While released, a request for it waits (it does not fail) ...
    sampling = rb.SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    req = rb.GenerateRequest(input_ids=[5, 6, 7], sampling=sampling, worker="ref-0")
    waiting = asyncio.run_coroutine_threadsafe(a.backend.generate(req), _LoopThread.get().loop)
    with pytest.raises(concurrent.futures.TimeoutError):
        waiting.result(0.5)
    # ... and resumes in Miles' two stages (weights, then KV cache + CUDA graphs).
    a.resume_memory_occupation(tags=["weights"])
    a.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
    assert waiting.result(30).output_ids == before.output_ids
    assert a.released_memory == frozenset()
    assert a._run(a.backend.health()).worker("ref-0").ready
    # Still in routing: round-robin reaches both workers.
    rr = [
        a._run(a.backend.generate(rb.GenerateRequest(input_ids=[5], sampling=rb.SamplingParams(max_new_tokens=2))), 60)
        for _ in range(4)
    ]
    assert {g.worker for g in rr} == {"ref-0", "ref-1"}
    assert b.health_generate() is True


def test_abort_request_and_simulate_crash(engines: list[RolloutEngine]) -> None:
    a, _ = engines
    a.abort_request(abort_all=True)  # nothing in flight: a no-op
    a.simulate_crash()
    with pytest.raises(EngineCrashed):
        a.health_generate()
    with pytest.raises(EngineCrashed):
        a.get_weight_version()


@pytest.mark.parametrize(
    ("method", "kwargs"),
    [
        ("check_weights", {"action": "checksum"}),
        ("pull_weights", {"target_version": 1}),
        ("unload_lora_adapter", {"lora_name": "x"}),
        ("get_parallelism_info", {"rank": 0}),
    ],
)
def test_outside_the_protocol_raises_unsupported(
    engines: list[RolloutEngine], method: str, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(rb.Unsupported):
        getattr(engines[0], method)(**kwargs)


def test_failures_raise_like_sglang_engine(engines: list[RolloutEngine]) -> None:
    a, _ = engines
    with pytest.raises(rb.ControlFailed, match="not a checkpoint"):
        a.update_weights_from_disk("/nonexistent", weight_version="9")
    assert a.get_weight_version() != "9"
    with pytest.raises(rb.InvalidRequest):
        a.pause_generation(mode="sideways")


def test_flush_retries_then_times_out(model_dir: Any) -> None:
    """SGLangEngine.flush_cache retries a refused flush, then raises TimeoutError."""
    url = f"reference://{model_dir}?workers=1&weight_version=flush{next(_URLS)}"
    engine = RolloutEngine(make_args(rollout_backend_url=url), rank=0, flush_retries=3, flush_retry_interval=0.01)
    engine.init()
    try:
        ref = engine.backend.engine(engine.worker)  # type: ignore[attr-defined]
        req = rb.GenerateRequest(input_ids=[5, 6], sampling=rb.SamplingParams(max_new_tokens=300, ignore_eos=True))
        task = asyncio.run_coroutine_threadsafe(engine.backend.generate(req), _LoopThread.get().loop)
        while ref.health().tokens_generated < 2:
            time.sleep(0.01)
        engine.pause_generation(mode="in_place")  # the request keeps its KV: flushing is refused
        with pytest.raises(TimeoutError, match="flushing cache"):
            engine.flush_cache()
        engine.continue_generation()
        assert task.result(60).finish_reason is rb.FinishReason.LENGTH
        engine.flush_cache()  # idle now: accepted
    finally:
        _LoopThread.get().run(close_backends())


def test_non_zero_node_rank_is_a_no_op(model_dir: Any) -> None:
    """A 2-node engine has two actors; only node rank 0 talks to the engine (SGLangEngine._make_request)."""
    url = f"reference://{model_dir}?workers=1&weight_version=nodes{next(_URLS)}"
    args = make_args(rollout_backend_url=url, rollout_num_gpus_per_engine=16, num_gpus_per_node=8)
    head, tail = RolloutEngine(args, rank=0), RolloutEngine(args, rank=1)
    try:
        head.init()
        tail.init()
        assert (head.node_rank, tail.node_rank) == (0, 1) and head.worker == tail.worker == "ref-0"
        assert tail.update_weight_version("x") is None and tail.get_weight_version() is None
        assert tail.health_generate() is True
        assert head.get_weight_version() != "x"
    finally:
        _LoopThread.get().run(close_backends())
