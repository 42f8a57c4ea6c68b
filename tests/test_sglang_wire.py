"""SGLang wire format: request bodies, response parsing, errors — through the transport seam."""

from __future__ import annotations

import json
from typing import Any

import pytest

import rollout_backends as rb
from rollout_backends._http import _dumps
from rollout_backends.adapters.sglang import SGLangWire, sampling_params_body
from rollout_backends.kit import HttpClient, HttpFleetBackend, HttpRequest, HttpResponse, MockTransport, Worker


def _backend(handler: Any, n: int = 1, **wire: Any) -> tuple[HttpFleetBackend, MockTransport]:
    t = MockTransport(handler)
    urls = [f"http://127.0.0.1:{30000 + i}" for i in range(n)]
    backend = HttpFleetBackend(
        SGLangWire(entry_url="http://127.0.0.1:29000", **wire),
        [Worker(id=f"w{i}", control_url=u, generate_url=u) for i, u in enumerate(urls)],
        client=HttpClient(t),
    )
    return backend, t


def _ok(out: list[int], lps: list[Any] | None = None, **meta: Any) -> HttpResponse:
    entries = lps if lps is not None else [[-0.25, t, None] for t in out]
    m = {
        "id": "r",
        "finish_reason": {"type": "length", "length": len(out)},
        "prompt_tokens": 3,
        "cached_tokens": 2,
        "weight_version": "v7",
        "output_token_logprobs": entries,
    }
    m.update(meta)
    return HttpResponse.from_json({"output_ids": out, "meta_info": m})


def test_sampling_body_only_known_keys_and_seed_name() -> None:
    body = sampling_params_body(rb.SamplingParams(temperature=0.0, max_new_tokens=5, seed=7, stop_token_ids=[2]))
    assert body["sampling_seed"] == 7 and "seed" not in body
    assert body["stop_token_ids"] == [2] and body["max_new_tokens"] == 5 and body["temperature"] == 0.0
    assert "min_new_tokens" not in body  # needs a tokenizer on SGLang when > 0


async def test_generate_request_and_parse() -> None:
    seen: list[HttpRequest] = []

    def handler(req: HttpRequest) -> HttpResponse:
        seen.append(req)
        return _ok([5, 6, 7])

    backend, _ = _backend(handler)
    req = rb.GenerateRequest(input_ids=[1, 2, 3], sampling=rb.SamplingParams(max_new_tokens=3), routing_key="g1")
    gen = await backend.generate(req)
    assert seen[0].url == "http://127.0.0.1:29000/generate"
    sent = json.loads(_dumps(seen[0].json))  # what goes on the wire
    assert sent["input_ids"] == [1, 2, 3] and sent["return_logprob"] is True
    assert sent["sampling_params"] == sampling_params_body(req.sampling)
    assert seen[0].json["rid"] == req.request_id
    assert seen[0].headers["X-SMG-Routing-Key"] == "g1"
    assert gen.output_ids == (5, 6, 7) and gen.logprobs == (-0.25, -0.25, -0.25)
    assert gen.finish_reason is rb.FinishReason.LENGTH and gen.weight_version == "v7"
    assert gen.cached_tokens == 2 and gen.prompt_tokens == 3 and gen.worker == "w0"


async def test_stop_and_abort_finish_reasons() -> None:
    backend, _ = _backend(lambda r: _ok([5, 0], finish_reason={"type": "stop", "matched": 0}))
    gen = await backend.generate(rb.GenerateRequest(input_ids=[1]))
    assert gen.finish_reason is rb.FinishReason.STOP and gen.matched_stop == 0
    backend, _ = _backend(lambda r: _ok([5], finish_reason={"type": "abort", "message": "Abort"}))
    gen = await backend.generate(rb.GenerateRequest(input_ids=[1]))
    assert gen.aborted and gen.output_ids == (5,)


@pytest.mark.parametrize(
    "lps",
    [
        [[-0.1, 5, None]],  # fewer entries than tokens
        [[-0.1, 5, None], [-0.2, 9, None]],  # entry for another token
        [[-0.1, 5, None], [None, 6, None]],  # missing value
        [[-0.1, 5, None], "x"],  # not an entry
    ],
)
async def test_misaligned_logprobs_are_contract_violations(lps: list[Any]) -> None:
    backend, _ = _backend(lambda r: _ok([5, 6], lps))
    with pytest.raises(rb.ContractViolation):
        await backend.generate(rb.GenerateRequest(input_ids=[1]))


async def test_unknown_finish_reason_is_contract_violation() -> None:
    backend, _ = _backend(lambda r: _ok([5], finish_reason={"type": "eaten"}))
    with pytest.raises(rb.ContractViolation):
        await backend.generate(rb.GenerateRequest(input_ids=[1]))


async def test_400_maps_to_invalid_request_with_field() -> None:
    def handler(req: HttpRequest) -> HttpResponse:
        return HttpResponse.from_json({"error": "unknown field `seed`, expected one of ..."}, status=400)

    backend, _ = _backend(handler)
    with pytest.raises(rb.InvalidRequest) as info:
        await backend.generate(rb.GenerateRequest(input_ids=[1]))
    assert info.value.field == "sampling.seed"


@pytest.mark.parametrize(
    ("status", "body", "error", "nothing_generated"),
    [
        (400, {"error": "bad input_ids"}, rb.InvalidRequest, None),
        (422, {"detail": "bad"}, rb.InvalidRequest, None),
        (401, {}, rb.InvalidRequest, None),
        (403, {}, rb.InvalidRequest, None),
        (429, {}, rb.Overloaded, False),
        (503, {}, rb.Overloaded, False),
        (500, {"error": {"code": "call_upstream_connection_failed", "message": "x"}}, rb.ConnectionFailed, True),
        (502, {"error": {"code": "call_upstream_request_error", "message": "x"}}, rb.BackendUnavailable, None),
        (500, {}, rb.BackendUnavailable, None),
        (404, {"error": {"code": "model_not_found", "message": "no model"}}, rb.BackendUnavailable, None),
        (404, {"detail": "Not Found"}, rb.ContractViolation, None),
        (201, {}, rb.ContractViolation, None),
        (204, {}, rb.ContractViolation, None),
        (302, {}, rb.ContractViolation, None),
    ],
)
async def test_every_non_200_answer_is_a_typed_error(
    status: int, body: Any, error: type[Exception], nothing_generated: bool | None
) -> None:
    backend, _ = _backend(lambda r: HttpResponse.from_json(body, status=status))
    with pytest.raises(error) as info:
        await backend.generate(rb.GenerateRequest(input_ids=[1]))
    if nothing_generated is not None:
        assert isinstance(info.value, rb.TransientError) and info.value.nothing_generated is nothing_generated
    if status in (401, 403):
        assert isinstance(info.value, rb.InvalidRequest) and info.value.field == "api_key"


async def test_503_is_overloaded_and_not_retried_for_generate() -> None:
    """The transport never resends a 503; the fleet's worker-loss policy does, whole and backed off."""
    backend, t = _backend(lambda r: HttpResponse(503, b"busy"))
    backend.worker_loss = rb.WorkerLossPolicy(action=rb.WorkerLoss.FAIL)
    with pytest.raises(rb.Overloaded):
        await backend.generate(rb.GenerateRequest(input_ids=[1]))
    assert len(t.requests) == 1
    backend.worker_loss = rb.WorkerLossPolicy(resends=2, backoff_s=0.0)
    with pytest.raises(rb.Overloaded):
        await backend.generate(rb.GenerateRequest(input_ids=[1]))
    assert len(t.requests) == 1 + 3


async def test_client_side_vocab_and_context_checks() -> None:
    backend, t = _backend(lambda r: _ok([1]), vocab_size=10, max_context=4)
    with pytest.raises(rb.InvalidRequest) as info:
        await backend.generate(rb.GenerateRequest(input_ids=[1, 10]))
    assert info.value.field == "input_ids[1]"
    with pytest.raises(rb.InvalidRequest) as info:  # the first one out of range, not the largest
        await backend.generate(rb.GenerateRequest(input_ids=[3, 11, 2, 25]))
    assert info.value.field == "input_ids[1]" and "token id 11 >= vocab size 10" in str(info.value)
    with pytest.raises(rb.InvalidRequest) as info:
        await backend.generate(rb.GenerateRequest(input_ids=[1, 2, 3, 4]))
    assert info.value.field == "input_ids"
    # stop_token_ids under their own name (SGLang's refusal names input_ids; Dynamo's failed the fleet)
    with pytest.raises(rb.InvalidRequest) as info:
        await backend.generate(rb.GenerateRequest(input_ids=[1], sampling=rb.SamplingParams(stop_token_ids=[2, 10])))
    assert info.value.field == "sampling.stop_token_ids[1]" and "token id 10 >= vocab size 10" in str(info.value)
    assert t.requests == []


async def test_pinned_worker_goes_to_its_url() -> None:
    backend, t = _backend(lambda r: _ok([1]), n=2)
    gen = await backend.generate(rb.GenerateRequest(input_ids=[1], worker="w1"))
    assert t.requests[0].url == "http://127.0.0.1:30001/generate" and gen.worker == "w1"
    with pytest.raises(rb.InvalidRequest) as info:
        await backend.generate(rb.GenerateRequest(input_ids=[1], worker="nope"))
    assert info.value.field == "worker"


async def test_control_fans_out_and_names_failed_worker() -> None:
    def handler(req: HttpRequest) -> HttpResponse:
        if req.url.startswith("http://127.0.0.1:30001"):
            return HttpResponse.from_json({"success": False, "message": "group busy"})
        return HttpResponse.from_json({"success": True, "message": ""})

    backend, t = _backend(handler, n=3)
    with pytest.raises(rb.ControlFailed) as info:
        await backend.destroy_weight_group("g")
    assert info.value.workers == ("w1",) and "group busy" in str(info.value)
    assert len(t.requests) == 3  # every worker was asked, even after one failed


async def test_set_version_never_aborts_requests() -> None:
    backend, t = _backend(lambda r: HttpResponse.from_json({"success": True}), n=2)
    await backend.set_weight_version("v3")
    assert [r.json for r in t.requests] == [{"new_version": "v3", "abort_all_requests": False}] * 2


async def test_init_group_assigns_rank_offsets_per_worker() -> None:
    backend, t = _backend(lambda r: HttpResponse.from_json({"success": True}), n=3)
    await backend.init_weight_group(rb.WeightGroup(master_address="10.0.0.1", master_port=29500, world_size=4))
    assert sorted(r.json["rank_offset"] for r in t.requests) == [1, 2, 3]
    with pytest.raises(rb.InvalidRequest) as info:
        await backend.init_weight_group(rb.WeightGroup(master_address="h", master_port=29500, world_size=3))
    assert info.value.field == "group.world_size"


async def test_health_reports_dead_worker_and_staleness() -> None:
    from rollout_backends import ConnectionFailed

    def handler(req: HttpRequest) -> HttpResponse:
        if req.url.startswith("http://127.0.0.1:30001"):
            raise ConnectionFailed("cannot connect (refused)")
        if req.url.endswith("/model_info"):
            return HttpResponse.from_json({"weight_version": "v1" if "30000" in req.url else "v0"})
        return HttpResponse(200, b"")

    backend, _ = _backend(handler, n=3)
    backend.expect_version("v1")
    report = await backend.health()
    assert report.worker("w1").live is False and report.worker("w1").error
    assert report.worker("w0").ready and not report.worker("w0").stale
    assert report.worker("w2").stale and report.stale_workers == ("w2",)
    with pytest.raises(rb.BackendUnavailable) as info:
        await backend.wait_ready(timeout=0.2)
    assert "w1" in str(info.value)


async def test_memory_release_needs_the_capability() -> None:
    backend, t = _backend(lambda r: HttpResponse(200, b"null"))
    with pytest.raises(rb.Unsupported):
        await backend.release_memory(["weights"])
    backend, t = _backend(lambda r: HttpResponse(200, b"null"), memory_saver=True)
    await backend.release_memory(["kv_cache"])
    assert t.requests[0].json == {"tags": ["kv_cache"]}
    with pytest.raises(rb.InvalidRequest) as info:
        await backend.release_memory(["gpu"])
    assert info.value.field == "tags[0]"


async def test_api_key_header_is_sent_and_never_in_repr() -> None:
    t = MockTransport(lambda r: _ok([1]))
    client = HttpClient(t, api_key="s3cret-key")
    backend = HttpFleetBackend(
        SGLangWire(entry_url="http://h:1"), [Worker(id="w", control_url="http://h:1")], client=client
    )
    await backend.generate(rb.GenerateRequest(input_ids=[1]))
    assert t.requests[0].headers["Authorization"] == "Bearer s3cret-key"
    assert "s3cret" not in repr(client) and "s3cret" not in repr(backend)


def test_worker_named_by_smgs_routed_worker_header() -> None:
    # smg 1.13 answers with the routed worker's URL in x-smg-routed-worker-id (measured).
    wire = SGLangWire(entry_url="http://router:1", url_workers={"http://10.0.0.1:30000": "10.0.0.1:30000"})
    req = rb.GenerateRequest(input_ids=[1, 2, 3])
    ok = _ok([5])
    routed = HttpResponse(200, ok.body, {"x-smg-routed-worker-id": "http://10.0.0.1:30000/"})
    assert wire.parse_generation(req, routed, 0.0).worker == "10.0.0.1:30000"
    unknown = HttpResponse(200, ok.body, {"x-smg-routed-worker-id": "http://elsewhere:1"})
    assert wire.parse_generation(req, unknown, 0.0).worker is None
    # A worker the fleet already knows (pinned) is not overridden.
    assert wire.parse_generation(req, routed, 0.0, worker="pinned").worker == "pinned"


def test_refusals_name_the_field() -> None:
    wire = SGLangWire(entry_url="http://h:1")
    req = rb.GenerateRequest(input_ids=[1])
    ours = HttpResponse.from_json({"error": {"message": "x", "param": "sampling_params.stop_token_ids[0]"}}, status=400)
    with pytest.raises(rb.InvalidRequest) as e:
        wire.parse_generation(req, ours, 0.0)
    assert e.value.field == "sampling.stop_token_ids[0]"
    sglang = HttpResponse.from_json(
        {"error": {"message": "Requested token count exceeds the model's maximum context length of 64 tokens."}},
        status=400,
    )
    with pytest.raises(rb.InvalidRequest) as e:
        wire.parse_generation(req, sglang, 0.0)
    assert e.value.field == "sampling.max_new_tokens"


async def test_calls_after_aclose_raise_backend_closed() -> None:
    """Issue 16: a closed fleet generated through a fresh pool; now every engine call is refused."""
    seen: list[str] = []

    def handler(req: HttpRequest) -> HttpResponse:
        seen.append(req.url)
        return HttpResponse.from_json({"success": True})

    backend, _ = _backend(handler)
    await backend.aclose()
    with pytest.raises(rb.BackendClosed, match="generate after aclose"):
        await backend.generate(rb.GenerateRequest(input_ids=[1, 2]))
    with pytest.raises(rb.BackendClosed, match="pause after aclose"):
        await backend.pause()
    assert isinstance(rb.BackendClosed("x"), rb.BackendUnavailable)
    assert seen == []


async def test_health_of_a_paused_stock_server_is_live_without_the_generating_probe() -> None:
    """Stock SGLang generates a token on /health while paused (20 s, then 503); health() must not ask it."""
    from tests.fake_sglang import FakeSGLangFleet

    fleet = FakeSGLangFleet(2)
    backend = fleet.backend()
    await backend.pause(rb.PauseMode.RETRACT)
    fleet.calls.clear()
    report = await backend.health()
    assert all(w.live and not w.ready for w in report.workers), report
    assert not [p for _, p, _ in fleet.calls if p in ("/health", "/health_generate")]
    await backend.resume()
    report = await backend.health()
    assert all(w.live and w.ready for w in report.workers), report


def test_flush_waits_for_idle_through_sglangs_timeout_query() -> None:
    """An immediate flush right after a request answered can be refused (the request is still in
    the running batch for a scheduler step); SGLang's ``/flush_cache?timeout=`` defers it."""
    from rollout_backends.kit import FLUSH_WAIT_S, FlushCache

    w = SGLangWire(entry_url="http://h:1")
    worker = Worker(id="w0", control_url="http://h:1", generate_url="http://h:1")
    default = w.control(FlushCache(), worker)
    assert default is not None and default.url == f"http://h:1/flush_cache?timeout={FLUSH_WAIT_S:g}"
    now = w.control(FlushCache(wait_s=0.0), worker)
    assert now is not None and now.url == "http://h:1/flush_cache?timeout=0"


async def test_the_progress_probe_skips_the_workers_this_fleet_paused() -> None:
    """health(probe=True) asked a paused stock server to generate (20 s, then 503): not any more."""
    from tests.fake_sglang import FakeSGLangFleet

    fleet = FakeSGLangFleet(2)
    backend = fleet.backend()
    paused_url, running_url = list(fleet.workers)
    await backend.pause(rb.PauseMode.RETRACT, workers=["w0"])
    fleet.calls.clear()
    report = await backend.health(probe=True)
    assert not [p for b, p, _ in fleet.calls if b == paused_url and p in ("/health", "/health_generate")]
    assert "/health_generate" in fleet.paths(running_url)
    paused, running = report.worker("w0"), report.worker("w1")
    assert paused.live and not paused.ready and paused.making_progress is False and "paused" in (paused.error or "")
    assert running.ready and running.making_progress is True
    await backend.resume(workers=["w0"])
    report = await backend.health(probe=True)
    assert all(w.ready and w.making_progress for w in report.workers), report


async def test_a_bad_tensor_is_the_callers_invalid_request_not_a_worker_failure() -> None:
    backend, t = _backend(lambda r: HttpResponse.from_json({"success": True}), n=2)
    with pytest.raises(rb.InvalidRequest) as info:
        await backend.update_weights_from_tensors([("w", "not a tensor")])
    assert info.value.field == "named_tensors[0]"
    with pytest.raises(rb.InvalidRequest) as info:
        await backend.update_weights_from_tensors([["w", 1]])  # type: ignore[list-item]
    assert info.value.field == "named_tensors[0]"
    with pytest.raises(rb.InvalidRequest) as info:
        await backend.pause(workers=[])
    assert info.value.field == "workers"
    assert t.requests == []
