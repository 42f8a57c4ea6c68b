"""Engine control plane: abort, pause modes, flush, prefix accounting, memory, validation."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from refhelpers import GREEDY, PROMPTS, req, wait_for_tokens

from rollout_backends._errors import InvalidRequest
from rollout_backends._types import FinishReason, Generation, PauseMode
from rollout_backends.adapters.reference import EngineError, ReferenceEngine

LONG = GREEDY.replace(max_new_tokens=3000)


async def _started(engine: ReferenceEngine, prompt: tuple[int, ...], n: int = 5) -> asyncio.Task[Generation]:
    """Start a long greedy request and wait until it has produced ``n`` tokens."""
    before = engine.health().tokens_generated
    task = asyncio.ensure_future(engine.generate(req(prompt, LONG, request_id="long")))
    await wait_for_tokens(engine, before + n)
    return task


async def test_abort_returns_partial_tokens(engine: ReferenceEngine) -> None:
    task = await _started(engine, PROMPTS[0])
    assert await engine.abort("long") is True
    gen = await task
    assert gen.finish_reason is FinishReason.ABORT
    n = len(gen.output_ids)
    assert 5 <= n < LONG.max_new_tokens
    full = await engine.generate(req(PROMPTS[0], GREEDY.replace(max_new_tokens=n)))
    assert gen.output_ids == full.output_ids
    assert gen.logprobs == full.logprobs
    assert await engine.abort("long") is False  # finished: unknown now
    assert engine.num_running == 0


async def test_abort_all_counts_and_returns_each(engine: ReferenceEngine) -> None:
    tasks = [asyncio.ensure_future(engine.generate(req(p, LONG))) for p in PROMPTS]
    await wait_for_tokens(engine, 8)
    assert await engine.abort_all() == len(PROMPTS)
    gens = await asyncio.gather(*tasks)
    assert all(g.finish_reason is FinishReason.ABORT for g in gens)
    assert all(g.logprobs is not None and len(g.logprobs) == len(g.output_ids) for g in gens)


async def test_cancelling_the_caller_aborts_the_request(engine: ReferenceEngine) -> None:
    task = await _started(engine, PROMPTS[0])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.num_running == 0


async def test_pause_abort_ends_inflight_and_new_requests_wait(engine: ReferenceEngine) -> None:
    task = await _started(engine, PROMPTS[0])
    await engine.pause(PauseMode.ABORT)
    gen = await asyncio.wait_for(task, 5)
    assert gen.finish_reason is FinishReason.ABORT
    waiting = asyncio.ensure_future(engine.generate(req(PROMPTS[1])))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    assert engine.num_waiting == 1
    assert not engine.health().ready
    await engine.resume()
    await engine.resume()  # idempotent
    got = await asyncio.wait_for(waiting, 10)
    fresh = await engine.generate(req(PROMPTS[1]))
    assert (got.output_ids, got.logprobs) == (fresh.output_ids, fresh.logprobs)


async def test_pause_in_place_keeps_kv_and_refuses_flush(engine: ReferenceEngine) -> None:
    n = 60
    reference = await engine.generate(req(PROMPTS[0], GREEDY.replace(max_new_tokens=n)))
    task = asyncio.ensure_future(engine.generate(req(PROMPTS[0], GREEDY.replace(max_new_tokens=n))))
    await wait_for_tokens(engine, n + 5)
    await engine.pause(PauseMode.IN_PLACE)
    frozen = engine.health().tokens_generated
    await asyncio.sleep(0.1)
    assert engine.health().tokens_generated == frozen  # nothing runs while paused
    with pytest.raises(EngineError, match="in_place"):
        await engine.flush_cache()
    with pytest.raises(EngineError, match="kv_cache"):
        await engine.release_memory(["kv_cache"])
    await engine.resume()
    gen = await task
    # The KV was kept: the run is exactly an uninterrupted one.
    assert (gen.output_ids, gen.logprobs) == (reference.output_ids, reference.logprobs)


async def test_pause_retract_continues_with_new_weights(
    engine: ReferenceEngine, make_engine: Callable[..., ReferenceEngine], model_dir: Path, model_dir_b: Path
) -> None:
    n = 40
    task = asyncio.ensure_future(engine.generate(req(PROMPTS[0], GREEDY.replace(max_new_tokens=n))))
    await wait_for_tokens(engine, 5)
    await engine.pause(PauseMode.RETRACT)
    k = engine.health().tokens_generated  # tokens made before the pause (the only request)
    assert engine.num_running == 1
    await engine.flush_cache()  # allowed: retracted requests hold no KV
    await engine.update_weights_from_disk(str(model_dir_b), version="b")
    await engine.resume()
    gen = await task
    assert gen.finish_reason is FinishReason.LENGTH
    assert gen.weight_version == "b"
    assert 5 <= k < n and len(gen.output_ids) == n
    # Tokens made before the pause come from the old weights (bit-for-bit) ...
    old = await make_engine(model_dir).generate(req(PROMPTS[0], GREEDY.replace(max_new_tokens=k)))
    assert gen.output_ids[:k] == old.output_ids and gen.logprobs[:k] == old.logprobs
    # ... the rest equal a fresh engine on the new weights continuing from prompt + kept tokens.
    fresh_b = make_engine(model_dir_b)
    cont = await fresh_b.generate(req(PROMPTS[0] + gen.output_ids[:k], GREEDY.replace(max_new_tokens=n - k)))
    assert gen.output_ids[k:] == cont.output_ids
    assert gen.logprobs[k:] == cont.logprobs


async def test_flush_refused_while_running_unpaused(engine: ReferenceEngine) -> None:
    task = await _started(engine, PROMPTS[0])
    with pytest.raises(EngineError, match="running"):
        await engine.flush_cache()
    await engine.abort("long")
    await task
    await engine.flush_cache()  # idle: fine


async def test_flush_waits_for_idle_up_to_wait_s(engine: ReferenceEngine) -> None:
    """SGLang's deferred flush (``timeout_s``): refused only if the engine stays busy that long."""
    task = await _started(engine, PROMPTS[0])
    with pytest.raises(EngineError, match="running"):
        await engine.flush_cache(wait_s=0.1)  # still running after the wait
    assert not task.done()
    flush = asyncio.ensure_future(engine.flush_cache(wait_s=30.0))
    await asyncio.sleep(0.05)
    assert not flush.done()  # waiting, not refused
    await engine.abort("long")
    await task
    await asyncio.wait_for(flush, 5.0)  # done once idle
    held = await _started(engine, PROMPTS[1])
    await engine.pause(PauseMode.IN_PLACE)
    with pytest.raises(EngineError, match="hold KV"):
        await engine.flush_cache(wait_s=0.1)  # frozen with its KV: the wait ends in a refusal
    await engine.resume()
    await engine.abort("long")
    await held


async def test_cached_tokens_are_page_granular_and_flushed(engine: ReferenceEngine) -> None:
    prompt = tuple(range(100, 140))  # 40 tokens: 2 full pages of 16 (the last token is never cached)
    first = await engine.generate(req(prompt))
    second = await engine.generate(req(prompt))
    third = await engine.generate(req(prompt[:20] + (7,) * 20))  # shares one page
    assert (first.cached_tokens, second.cached_tokens, third.cached_tokens) == (0, 32, 16)
    assert first.output_ids == second.output_ids  # the engine recomputes; only the report differs
    exact = await engine.generate(req(prompt[:32]))  # 32 tokens: the last page is not reusable
    assert exact.cached_tokens == 16
    await engine.flush_cache()
    assert (await engine.generate(req(prompt))).cached_tokens == 0


async def test_release_and_resume_memory(engine: ReferenceEngine) -> None:
    before = await engine.generate(req(PROMPTS[0]))
    checksum = engine.weight_checksum()
    task = await _started(engine, PROMPTS[1])
    with pytest.raises(EngineError, match="running"):
        await engine.release_memory(["weights"])
    await engine.pause(PauseMode.ABORT)
    await task
    await engine.release_memory(None)
    emb = engine._params["model.embed_tokens.weight"]
    assert emb.numel() == 0  # storage really dropped
    with pytest.raises(EngineError, match="released"):
        await engine.update_weights_from_tensors([])
    await engine.resume()
    waiting = asyncio.ensure_future(engine.generate(req(PROMPTS[0])))
    await asyncio.sleep(0.1)
    assert not waiting.done() and not engine.health().ready  # waits while memory is released
    await engine.resume_memory(["weights", "kv_cache", "cuda_graph"])
    got = await asyncio.wait_for(waiting, 10)
    assert engine.weight_checksum() == checksum
    assert (got.output_ids, got.logprobs) == (before.output_ids, before.logprobs)


@pytest.mark.parametrize(
    ("prompt", "field"),
    [((1, 2, 512), "input_ids[2]"), ((1, 2, 10_000, 3), "input_ids[2]")],
)
async def test_out_of_vocab_is_invalid(engine: ReferenceEngine, prompt: tuple[int, ...], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        await engine.generate(req(prompt))
    assert info.value.field == field
    assert engine.num_running == 0


async def test_stop_token_out_of_vocab_is_invalid(engine: ReferenceEngine) -> None:
    with pytest.raises(InvalidRequest) as info:
        await engine.generate(req(PROMPTS[0], GREEDY.replace(stop_token_ids=(3, 600))))
    assert info.value.field == "sampling.stop_token_ids[1]"


async def test_duplicate_request_id_is_invalid(engine: ReferenceEngine) -> None:
    task = await _started(engine, PROMPTS[0])
    with pytest.raises(InvalidRequest) as info:
        await engine.generate(req(PROMPTS[1], request_id="long"))
    assert info.value.field == "request_id"
    await engine.abort("long")
    await task


async def test_context_limits(make_engine: Callable[..., ReferenceEngine], short_context_dir: Path) -> None:
    engine = make_engine(short_context_dir)
    assert engine.max_context == 32
    with pytest.raises(InvalidRequest) as info:
        await engine.generate(req(tuple(range(1, 33))))
    assert info.value.field == "input_ids"
    gen = await engine.generate(req(tuple(range(1, 30)), GREEDY.replace(max_new_tokens=10)))
    assert gen.finish_reason is FinishReason.LENGTH
    assert len(gen.output_ids) == 3  # stopped at the context, not at max_new_tokens
    assert gen.prompt_tokens == 29


async def test_generation_metadata(engine: ReferenceEngine) -> None:
    await engine.set_weight_version("v7")
    gen = await engine.generate(req(PROMPTS[0], request_id="meta", return_logprobs=False))
    assert gen.request_id == "meta"
    assert gen.worker == engine.worker_id == "ref-0"
    assert gen.weight_version == "v7"
    assert gen.logprobs is None
    assert gen.prompt_tokens == len(PROMPTS[0])
    assert gen.latency_s > 0
