"""Weight updates on one engine: disk, tensors, gloo broadcast; refusals leave the old weights."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from refhelpers import GREEDY, PROMPTS, outputs, req, run_all, wait_for_tokens

from rollout_backends._types import PauseMode, WeightBucket
from rollout_backends.adapters.reference import EngineError, ReferenceEngine, WeightSender, free_port


def _tensors(model_dir: Path) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    return sorted(load_file(str(model_dir / "model.safetensors")).items())


async def test_disk_update_equals_fresh_engine(
    engine: ReferenceEngine, make_engine: Callable[..., ReferenceEngine], model_dir: Path, model_dir_b: Path
) -> None:
    before = await run_all(engine)
    await engine.flush_cache()
    await engine.update_weights_from_disk(str(model_dir_b), version="b", load_format="safetensors")
    assert engine.weight_version == "b"
    after = await run_all(engine)
    fresh = await run_all(make_engine(model_dir_b))
    assert outputs(after) == outputs(fresh)
    assert outputs(after) != outputs(before)
    assert {g.weight_version for g in after} == {"b"}
    # ... and back again.
    await engine.update_weights_from_disk(str(model_dir))
    assert outputs(await run_all(engine)) == outputs(before)
    assert engine.weight_version == "b"  # no version given: the label stays


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
async def test_tensor_update_equals_fresh_engine(
    engine: ReferenceEngine, make_engine: Callable[..., ReferenceEngine], model_dir_b: Path, dtype: str
) -> None:
    import torch

    named = [(n, t.to(getattr(torch, dtype))) for n, t in _tensors(model_dir_b)]
    half = len(named) // 2
    # Two buckets, like a trainer streaming its state dict.
    await engine.update_weights_from_tensors(named[:half], flush_cache=False)
    await engine.update_weights_from_tensors(named[half:], version="b")
    fresh = await run_all(make_engine(model_dir_b))
    assert outputs(await run_all(engine)) == outputs(fresh)
    assert engine.weight_version == "b"


async def test_float32_tensors_are_stored_as_bf16(engine: ReferenceEngine, model_dir: Path) -> None:
    """A float32 update serves what a bf16 engine would: the values rounded to bf16."""
    import torch

    checksum = engine.weight_checksum()
    named = [(n, t.float() + 1e-4) for n, t in _tensors(model_dir)]  # +1e-4 is lost in bf16 for |w| >= ~0.05
    await engine.update_weights_from_tensors(named)
    emb = engine._params["model.embed_tokens.weight"]
    assert torch.equal(emb, emb.to(torch.bfloat16).float())
    assert engine.weight_checksum() != checksum  # small weights did move


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda named: [*named, ("model.layers.9.mlp.up_proj.weight", named[0][1])], "unknown weight"),
        (lambda named: [(n, t[:-1] if i == len(named) - 1 else t) for i, (n, t) in enumerate(named)], "shape"),
        (lambda named: [*named, named[0]], "twice"),
        (lambda named: [(n, t.to(dtype=__import__("torch").int32)) for n, t in named], "non-float"),
    ],
    ids=["unknown-name", "shape", "duplicate", "int-dtype"],
)
async def test_bad_tensor_update_changes_nothing(
    engine: ReferenceEngine, model_dir_b: Path, mutate: Callable[[list[Any]], list[Any]], match: str
) -> None:
    before = await run_all(engine)
    checksum = engine.weight_checksum()
    # The bad tensor comes last: validation must happen before anything is installed.
    with pytest.raises(EngineError, match=match):
        await engine.update_weights_from_tensors(mutate(_tensors(model_dir_b)), version="bad")
    assert engine.weight_checksum() == checksum
    assert engine.weight_version == "default"
    assert outputs(await run_all(engine)) == outputs(before)


async def test_bad_disk_update_changes_nothing(engine: ReferenceEngine, model_dir_b: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    checksum = engine.weight_checksum()
    partial = tmp_path / "partial"
    partial.mkdir()
    save_file(dict(_tensors(model_dir_b)[:3]), str(partial / "model.safetensors"))
    with pytest.raises(EngineError, match="lacks"):
        await engine.update_weights_from_disk(str(partial), version="x")
    with pytest.raises(EngineError, match="not a checkpoint directory"):
        await engine.update_weights_from_disk(str(tmp_path / "missing"))
    with pytest.raises(EngineError, match="load_format"):
        await engine.update_weights_from_disk(str(model_dir_b), load_format="gguf")
    with pytest.raises(EngineError, match="load_format"):
        await engine.update_weights_from_tensors([], load_format="my.custom.loader")
    assert engine.weight_checksum() == checksum
    assert engine.weight_version == "default"


async def test_sharded_checkpoint_loads(
    engine: ReferenceEngine, make_engine: Callable[..., ReferenceEngine], model_dir_b: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    named = _tensors(model_dir_b)
    shard = tmp_path / "sharded"
    shard.mkdir()
    shutil.copy(model_dir_b / "config.json", shard / "config.json")
    save_file(dict(named[:10]), str(shard / "model-00001-of-00002.safetensors"))
    save_file(dict(named[10:]), str(shard / "model-00002-of-00002.safetensors"))
    await engine.update_weights_from_disk(str(shard))
    assert outputs(await run_all(engine)) == outputs(await run_all(make_engine(model_dir_b)))


async def test_update_with_flush_refused_while_running(engine: ReferenceEngine, model_dir_b: Path) -> None:
    checksum = engine.weight_checksum()
    task = asyncio.ensure_future(engine.generate(req(PROMPTS[0], GREEDY.replace(max_new_tokens=3000))))
    await wait_for_tokens(engine, 3)
    with pytest.raises(EngineError, match="flush"):
        await engine.update_weights_from_tensors(_tensors(model_dir_b), version="b")
    assert engine.weight_checksum() == checksum and engine.weight_version == "default"
    # Without the flush an update while running is allowed (it lands between two steps).
    await engine.update_weights_from_tensors(_tensors(model_dir_b), flush_cache=False, version="b")
    assert engine.weight_checksum() != checksum
    await engine.abort_all()
    assert (await task).weight_version == "b"


async def test_gloo_group_update_equals_fresh_engine(
    engine: ReferenceEngine, make_engine: Callable[..., ReferenceEngine], model_dir_b: Path
) -> None:
    import torch

    port = free_port()
    sender = WeightSender("127.0.0.1", port, world_size=2, timeout_s=30)
    try:
        # Both sides block until the other joins: run them concurrently.
        await asyncio.gather(asyncio.to_thread(sender.connect), engine.init_weight_group("127.0.0.1", port, 1, 2))
        assert engine.health().weight_groups == ("weight_update_group",)
        named = [(n, t if i % 2 else t.float()) for i, (n, t) in enumerate(_tensors(model_dir_b))]  # mixed dtypes
        bucket = WeightBucket.from_named_tensors(named)
        assert set(bucket.dtypes) == {"bfloat16", "float32"}
        await engine.pause(PauseMode.RETRACT)
        await asyncio.gather(
            asyncio.to_thread(sender.broadcast, named),
            engine.update_weights_from_distributed(
                bucket.names, bucket.dtypes, bucket.shapes, group_name="weight_update_group", version="b"
            ),
        )
        await engine.resume()
        assert engine.weight_version == "b"
        assert outputs(await run_all(engine)) == outputs(await run_all(make_engine(model_dir_b)))
        # A refused bucket (wrong shape) is still received, so the group stays usable.
        checksum = engine.weight_checksum()
        bad = [("model.norm.weight", torch.ones(7))]
        with pytest.raises(EngineError, match="shape"):
            await asyncio.gather(
                asyncio.to_thread(sender.broadcast, bad),
                engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[7]]),
            )
        assert engine.weight_checksum() == checksum
        good = [("model.norm.weight", torch.full((256,), 2.0))]
        await asyncio.gather(
            asyncio.to_thread(sender.broadcast, good),
            engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[256]]),
        )
        assert engine.weight_checksum() != checksum
    finally:
        await engine.destroy_weight_group()
        await engine.destroy_weight_group()  # idempotent
        sender.close()
    assert engine.health().weight_groups == ()
    with pytest.raises(EngineError, match="no weight group"):
        await engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[256]])


async def test_group_refusals(engine: ReferenceEngine) -> None:
    with pytest.raises(EngineError, match="gloo"):
        await engine.init_weight_group("127.0.0.1", free_port(), 1, 2, backend="nccl")
    with pytest.raises(EngineError, match="rank"):
        await engine.init_weight_group("127.0.0.1", free_port(), 2, 2)


async def test_sessions_and_version_labels(engine: ReferenceEngine) -> None:
    await engine.begin_weight_update("all")
    assert engine.health().update_session == "all"
    await engine.begin_weight_update("target")  # re-opening never wedges the engine
    await engine.end_weight_update()
    await engine.end_weight_update()  # no-op
    assert engine.health().update_session is None
    with pytest.raises(EngineError, match="selector"):
        await engine.begin_weight_update("draft")
    await engine.set_weight_version("step-3")
    assert engine.weight_version == "step-3"
    with pytest.raises(EngineError):
        await engine.set_weight_version("")
