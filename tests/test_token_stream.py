"""``Fleet.stream`` over the public fake: exact chunks, the final Generation stamped as generate's,
and leaving early (break, exception, cancellation) aborts on the engine and leaves no task."""

from __future__ import annotations

import asyncio

import attrs
import pytest

import rollout_backends as rb
from rollout_backends.testing import FAKE_CAPABILITIES, fake_fleet
from tests.conformance.fake_backend import FakeBackend

GREEDY = rb.SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def request(rid: str = "s-1", sampling: rb.SamplingParams = GREEDY, **kw: object) -> rb.GenerateRequest:
    return rb.GenerateRequest(input_ids=(3, 4, 5), sampling=sampling, request_id=rid, **kw)  # type: ignore[arg-type]


async def collect(backend: rb.RolloutBackend, req: rb.GenerateRequest) -> tuple[list[rb.TokenChunk], rb.TokenStream]:
    async with backend.stream(req) as chunks:
        got = [c async for c in chunks]
    return got, chunks


async def test_chunks_add_up_to_generate_and_the_final_is_its_generation() -> None:
    fleet = fake_fleet()
    want = await fleet.generate(request("g", sampling=GREEDY.replace(top_logprobs=3)))
    got, stream = await collect(fleet, request(sampling=GREEDY.replace(top_logprobs=3)))
    assert len(got) >= 2 and all(c.final is None for c in got[:-1])
    assert [c.index for c in got] == [sum(len(c.output_ids) for c in got[:i]) for i in range(len(got))]
    final = got[-1].final
    assert final is not None and stream.generation is final
    assert tuple(t for c in got for t in c.output_ids) == final.output_ids == want.output_ids
    assert tuple(v for c in got for v in c.logprobs or ()) == final.logprobs == want.logprobs
    assert tuple(t for c in got for t in c.top_logprobs or ()) == final.top_logprobs == want.top_logprobs
    # the same Generation, but for the id and what the prefix cache made of a second run
    assert attrs.evolve(final, request_id="g", cached_tokens=0) == want
    assert (final.weight_version, final.worker) == ("v0", "fake-0")
    assert not fleet.fakes[0].running


async def test_the_final_generation_is_stamped_as_generate_stamps_it() -> None:
    # STAMPED versions: the fleet fills in the label and one span, for stream and generate alike.
    caps = attrs.evolve(
        FAKE_CAPABILITIES, version_source=rb.VersionSource.STAMPED, version_spans=rb.VersionSource.STAMPED
    )
    fleet = fake_fleet(capabilities=caps)
    await fleet.set_weight_version("v7")
    got, _ = await collect(fleet, request())
    final = got[-1].final
    assert final is not None
    want = await fleet.generate(request("g"))
    assert (final.weight_version, final.version_at_start, final.version_spans) == ("v7", "v7", ((0, "v7"),))
    assert (want.weight_version, want.version_at_start, want.version_spans) == ("v7", "v7", ((0, "v7"),))


async def test_undeclared_streaming_and_bad_input_are_refused_before_anything_runs() -> None:
    plain = fake_fleet(capabilities=attrs.evolve(FAKE_CAPABILITIES, streaming=False))
    with pytest.raises(rb.Unsupported, match="streaming"):
        plain.stream(request())
    fleet = fake_fleet()
    with pytest.raises(rb.InvalidRequest) as info:
        fleet.stream(rb.GenerateRequest(input_ids=(1, 99), request_id="oov"))
    assert info.value.field == "input_ids[1]"
    stream = fleet.stream(request())
    with pytest.raises(rb.InvalidRequest, match="inside `async with`"):
        stream.__aiter__()
    assert fleet.fakes[0].requests == []
    await fleet.aclose()
    with pytest.raises(rb.BackendClosed):
        fleet.stream(request())


async def test_an_id_in_flight_is_refused_and_free_again_once_the_block_is_left() -> None:
    fleet = fake_fleet()
    async with fleet.stream(request("dup")) as first:
        with pytest.raises(rb.InvalidRequest) as info:
            async with fleet.stream(request("dup")):
                pass
        assert info.value.field == "request_id" and "Duplicate request ID" in str(info.value)
        with pytest.raises(rb.InvalidRequest, match="Duplicate request ID"):
            await fleet.generate(request("dup"))  # one claim for generate and stream alike
        async for _ in first:
            break
    got, _ = await collect(fleet, request("dup"))
    assert got[-1].final is not None and len(got[-1].final.output_ids) == 12


@pytest.mark.parametrize("how", ["break", "raise", "cancel"])
async def test_leaving_early_aborts_on_the_engine_and_leaves_no_task(how: str) -> None:
    fleet = fake_fleet(token_delay=0.001)
    fake = fleet.fakes[0]
    long = request("long", GREEDY.replace(max_new_tokens=200))
    tasks_before = len(asyncio.all_tasks())
    seen = asyncio.Event()

    async def consume() -> None:
        async with fleet.stream(long) as chunks:
            async for _ in chunks:
                assert fake.running == ("long",)
                seen.set()
                if how == "break":
                    break
                if how == "raise":
                    raise KeyError("consumer failed")

    if how == "cancel":
        task = asyncio.ensure_future(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    elif how == "raise":
        with pytest.raises(KeyError):
            await consume()
    else:
        await consume()
    assert fake.running == ()
    assert len(asyncio.all_tasks()) == tasks_before
    got, _ = await collect(fleet, attrs.evolve(long, sampling=GREEDY))  # the id is free at once
    assert got[-1].final is not None and got[-1].final.finish_reason is rb.FinishReason.LENGTH


async def test_abort_by_id_ends_a_stream_with_its_partial_tokens() -> None:
    fleet = fake_fleet()
    long = request("ab", GREEDY.replace(max_new_tokens=200))
    got: list[rb.TokenChunk] = []
    async with fleet.stream(long) as chunks:
        async for c in chunks:
            got.append(c)
            if len(got) == 3:
                await fleet.abort("ab")
    final = got[-1].final
    assert final is not None and final.finish_reason is rb.FinishReason.ABORT
    assert 3 <= len(final.output_ids) < 200
    assert tuple(t for c in got for t in c.output_ids) == final.output_ids


async def test_a_driver_that_repeats_tokens_is_a_contract_violation_and_is_aborted() -> None:
    fleet = FakeBackend(bugs=frozenset({"stream_repeats_token"}))
    with pytest.raises(rb.ContractViolation, match="repeats tokens: a chunk at index 0 after 1 tokens"):
        await collect(fleet, request())
    assert fleet.fakes[0].running == ()
