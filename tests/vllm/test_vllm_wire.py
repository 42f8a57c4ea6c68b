"""The vLLM wire without a server: the calls it builds, the answers it reads (vLLM 0.26's shapes,
from the wheel), and the HTTP driver's multi-call commands and round robin it relies on."""

from __future__ import annotations

import json
from typing import Any

import pytest

import rollout_backends as rb
from rollout_backends import (
    FinishReason,
    GenerateRequest,
    MemoryTag,
    PauseMode,
    SamplingParams,
    TensorSpec,
    WeightBucket,
)
from rollout_backends.adapters.vllm import VllmWire
from rollout_backends.kit import (
    AbortAll,
    AbortRequest,
    DestroyWeightGroup,
    FlushCache,
    GetVersion,
    HttpClient,
    HttpFleetBackend,
    HttpRequest,
    HttpResponse,
    InitWeightGroup,
    MockTransport,
    Pause,
    Progress,
    ReleaseMemory,
    ResumeMemory,
    SetVersion,
    UpdateFromDisk,
    UpdateFromDistributed,
    Worker,
)

W = Worker(id="h:1", control_url="http://h:1", generate_url="http://h:1")


def paths(calls: Any) -> list[str]:
    calls = calls if isinstance(calls, tuple) else (calls,)
    return [c.url.removeprefix("http://h:1") for c in calls]


def test_pause_modes_map_onto_vllm_pause_queries() -> None:
    wire = VllmWire(entry_url="http://h:1")
    assert paths(wire.control(Pause(PauseMode.ABORT), W)) == ["/pause?mode=abort&clear_cache=false"]
    # keep + clear_cache: the frozen requests are preempted (KV freed, recomputed on resume).
    assert paths(wire.control(Pause(PauseMode.RETRACT), W)) == ["/pause?mode=keep&clear_cache=true"]
    assert paths(wire.control(Pause(PauseMode.IN_PLACE), W)) == ["/pause?mode=keep&clear_cache=false"]
    assert wire.capabilities().pause_modes == set(PauseMode)
    # Without the dev routes nothing is declared.
    assert not VllmWire(entry_url="http://h:1", dev_routes=False).capabilities().pause_modes


@pytest.mark.parametrize("router", [False, True], ids=["servers", "router"])
def test_progress_probe_is_a_generation_on_the_server_itself(router: bool) -> None:
    # Declared (Capabilities.progress_probe is off unless declared): the probe goes to the worker's
    # own URL, never to a router in front, so each server answers for itself.
    wire = VllmWire(entry_url="http://router:9" if router else "http://h:1", router=router)
    caps = wire.capabilities()
    assert caps.progress_probe and caps.worker_pinning
    probe = wire.control(Progress(), W)
    assert isinstance(probe, HttpRequest) and probe.url == "http://h:1/inference/v1/generate"
    assert probe.json["sampling_params"]["max_tokens"] == 1


def test_abort_by_vllm_request_id_and_all() -> None:
    wire = VllmWire(entry_url="http://h:1")
    one = wire.control(AbortRequest("r1"), W)
    assert isinstance(one, HttpRequest) and one.json == {"request_ids": ["generate-tokens-r1"]}
    every = wire.control(AbortAll(), W)
    assert isinstance(every, HttpRequest) and every.json == {"request_ids": []}


def test_disk_update_is_a_reload_then_a_flush_where_asked() -> None:
    wire = VllmWire(entry_url="http://h:1")
    calls = wire.control(UpdateFromDisk(path="/ckpt", version="v1", load_format=None, flush_cache=True), W)
    assert paths(calls) == ["/collective_rpc", "/reset_prefix_cache"]
    assert isinstance(calls, tuple)
    assert calls[0].json == {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt"}}
    single = wire.control(UpdateFromDisk(path="/ckpt", version=None, load_format=None, flush_cache=False), W)
    assert paths(single) == ["/collective_rpc"]
    with pytest.raises(rb.InvalidRequest) as exc:
        wire.control(UpdateFromDisk(path="/c", version=None, load_format="dummy", flush_cache=False), W)
    assert exc.value.field == "load_format"


def test_distributed_update_is_one_transfer_session() -> None:
    wire = VllmWire(entry_url="http://h:1", transfer_backend="nccl")
    assert rb.WeightTransport.DISTRIBUTED in wire.capabilities().weight_transports
    bucket = WeightBucket((TensorSpec("a", "bfloat16", (2, 3)), TensorSpec("b", "float32", (4,))))
    calls = wire.control(UpdateFromDistributed(bucket=bucket, group_name="g", version=None, flush_cache=False), W)
    assert paths(calls) == ["/start_weight_update", "/update_weights", "/finish_weight_update"]
    assert isinstance(calls, tuple)
    info = calls[1].json["update_info"]
    assert info == {
        "names": ["a", "b"],
        "dtype_names": ["bfloat16", "float32"],
        "shapes": [[2, 3], [4]],
        "packed": False,
    }
    group = rb.WeightGroup(master_address="10.0.0.1", master_port=29500, world_size=3)
    init = wire.control(InitWeightGroup(group, 2), W)
    assert isinstance(init, HttpRequest) and init.url.endswith("/init_weight_transfer_engine")
    assert init.json == {
        "init_info": {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 2, "world_size": 3}
    }
    with pytest.raises(rb.InvalidRequest) as exc:
        wire.control(
            InitWeightGroup(rb.WeightGroup(master_address="a", master_port=1, world_size=2, backend="gloo"), 1), W
        )
    assert exc.value.field == "group.backend"
    assert wire.control(DestroyWeightGroup("g"), W) is None  # 0.26 has no route


def test_transports_follow_the_transfer_backend() -> None:
    def transports(backend: str | None) -> set[rb.WeightTransport]:
        return set(VllmWire(entry_url="http://h:1", transfer_backend=backend).capabilities().weight_transports)

    assert transports(None) == {rb.WeightTransport.DISK}
    assert transports("nccl") == {rb.WeightTransport.DISK, rb.WeightTransport.DISTRIBUTED}
    assert transports("ipc") == {rb.WeightTransport.DISK, rb.WeightTransport.TENSOR}


def test_memory_release_is_sleep_level_1() -> None:
    wire = VllmWire(entry_url="http://h:1", sleep_mode=True)
    assert wire.capabilities().memory_release
    assert paths(wire.control(ReleaseMemory(None), W)) == ["/sleep?level=1&mode=keep"]
    both = (MemoryTag.WEIGHTS, MemoryTag.KV_CACHE)
    assert paths(wire.control(ReleaseMemory(both), W)) == ["/sleep?level=1&mode=keep"]
    with pytest.raises(rb.InvalidRequest) as exc:
        wire.control(ReleaseMemory((MemoryTag.KV_CACHE,)), W)  # vLLM cannot release the KV cache alone
    assert exc.value.field == "tags"
    # One call per tag, weights first: vLLM 0.26 skips a call naming a tag that is awake, and fails
    # a plain /wake_up after a partial one (tests/vllm/test_captured_answers.py).
    each = ["/wake_up?tags=weights", "/wake_up?tags=kv_cache"]
    assert paths(wire.control(ResumeMemory(None), W)) == each
    assert paths(wire.control(ResumeMemory((MemoryTag.KV_CACHE, MemoryTag.WEIGHTS)), W)) == each
    assert paths(wire.control(ResumeMemory((MemoryTag.WEIGHTS,)), W)) == ["/wake_up?tags=weights"]
    assert paths(wire.control(ResumeMemory((MemoryTag.KV_CACHE, MemoryTag.CUDA_GRAPH)), W)) == each[1:]
    assert wire.control(ResumeMemory((MemoryTag.CUDA_GRAPH,)), W) is None
    assert not VllmWire(entry_url="http://h:1").capabilities().memory_release


def test_no_weight_version_so_the_fleet_stamps() -> None:
    wire = VllmWire(entry_url="http://h:1")
    assert wire.control(GetVersion(), W) is None and wire.control(SetVersion("v1"), W) is None
    assert wire.capabilities().version_source is rb.VersionSource.STAMPED


@pytest.mark.parametrize(
    ("mode", "filtered"),
    [("processed_logprobs", True), ("processed_logits", True), ("raw_logprobs", False), ("raw_logits", False)],
)
def test_filtered_logprobs_follow_the_logprobs_mode(mode: str, filtered: bool) -> None:
    """processed_* logprobs are taken after min_p and top-k/top-p, renormalised (Sampler.sample)."""
    assert VllmWire(entry_url="http://h:1", logprobs_mode=mode).capabilities().filtered_logprobs is filtered


def test_without_server_info_vllms_default_logprobs_mode_is_assumed() -> None:
    assert VllmWire(entry_url="http://h:1").logprobs_mode == "raw_logprobs"
    assert not VllmWire(entry_url="http://h:1").capabilities().filtered_logprobs


def test_generate_body() -> None:
    wire = VllmWire(entry_url="http://h:1")
    s = SamplingParams(max_new_tokens=5, temperature=0.0, top_logprobs=3, stop_token_ids=(7,))
    body = wire.generate(GenerateRequest(input_ids=[1, 2], sampling=s, request_id="r"), None).json
    assert body["request_id"] == "r" and body["token_ids"] == [1, 2]
    sp = body["sampling_params"]
    assert sp["logprobs"] == 4  # one more than wanted: see VllmWire.top_logprobs
    assert sp["max_tokens"] == 5 and sp["stop_token_ids"] == [7] and sp["detokenize"] is False
    # SGLang's (our) ignore_eos also disables the stop ids; vLLM's does not: they are not sent.
    s2 = s.replace(ignore_eos=True)
    assert (
        "stop_token_ids" not in wire.generate(GenerateRequest(input_ids=[1], sampling=s2), None).json["sampling_params"]
    )
    # Re-scoring: vLLM refuses max_tokens 0; one token is generated and dropped when read.
    rescore = GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=0), prompt_logprobs_start=1)
    sp = wire.generate(rescore, None).json["sampling_params"]
    assert sp["max_tokens"] == 1 and sp["prompt_logprobs"] == 0
    with pytest.raises(rb.InvalidRequest) as exc:
        wire.generate(GenerateRequest(input_ids=[1], sampling=SamplingParams(stop=("x",))), None)
    assert exc.value.field == "sampling.stop"


def _entry(tok: int, lp: float, top: list[tuple[int, float]]) -> dict[str, Any]:
    return {
        "token": f"token_id:{tok}",
        "logprob": lp,
        "bytes": None,
        "top_logprobs": [{"token": f"token_id:{t}", "logprob": v, "bytes": None} for t, v in top],
    }


def _answer(ids: list[int], content: list[dict[str, Any]] | None, finish: str = "length", **extra: Any) -> HttpResponse:
    choice = {"index": 0, "logprobs": None if content is None else {"content": content}, "finish_reason": finish,
              "token_ids": ids, "routed_experts": None}  # fmt: skip
    body = {"request_id": "generate-tokens-r", "model": "m", "created": 1, "choices": [choice],
            "usage": {"prompt_tokens": 3, "total_tokens": 3 + len(ids), "completion_tokens": len(ids),
                      "prompt_tokens_details": {"cached_tokens": 2}}, "prompt_logprobs": None, **extra}  # fmt: skip
    return HttpResponse.from_json(body)


def test_top_logprobs_are_the_best_k_whatever_was_sampled() -> None:
    """vLLM lists the sampled token first, then the best: asked k + 1, the k best read back are the
    true top k even when a sampled token lies outside them."""
    wire = VllmWire(entry_url="http://h:1")
    req = GenerateRequest(
        input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=1, top_logprobs=2), request_id="r"
    )
    # Sampled 9 (-3.0), best 4 (-0.1), 5 (-0.5), 6 (-1.0): asked 3 -> [9, 4, 5].
    gen = wire.parse_generation(req, _answer([9], [_entry(9, -3.0, [(9, -3.0), (4, -0.1), (5, -0.5)])]), 0.0)
    assert gen.top_logprobs == (((4, -0.1), (5, -0.5)),)
    assert gen.logprobs == (-3.0,) and gen.cached_tokens == 2 and gen.prompt_tokens == 3
    with pytest.raises(rb.ContractViolation):  # fewer than k
        wire.parse_generation(req, _answer([9], [_entry(9, -3.0, [(9, -3.0)])]), 0.0)


def test_answers_read_strictly() -> None:
    wire = VllmWire(entry_url="http://h:1")
    req = GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2), request_id="r")
    with pytest.raises(rb.ContractViolation):  # one logprob for two tokens: never padded
        wire.parse_generation(req, _answer([4, 5], [_entry(4, -1.0, [(4, -1.0)])]), 0.0)
    with pytest.raises(rb.ContractViolation):  # the entry names another token
        wire.parse_generation(req, _answer([4], [_entry(8, -1.0, [(8, -1.0)])]), 0.0)
    gen = wire.parse_generation(req, _answer([4, 2], [_entry(4, -1.0, []), _entry(2, -0.5, [])], "stop"), 0.0)
    assert gen.finish_reason is FinishReason.STOP and gen.matched_stop == 2
    aborted = wire.parse_generation(req, _answer([4], [_entry(4, -1.0, [])], "abort"), 0.0)
    assert aborted.aborted and aborted.output_ids == (4,)
    with pytest.raises(rb.BackendUnavailable):
        wire.parse_generation(req, _answer([], [], "error"), 0.0)


def test_prompt_logprobs_in_our_shape() -> None:
    wire = VllmWire(entry_url="http://h:1")
    req = GenerateRequest(input_ids=[1, 2, 3, 4], sampling=SamplingParams(max_new_tokens=0), prompt_logprobs_start=1)
    plp = [None, {"2": {"logprob": -1.5, "rank": 3, "decoded_token": None}},
           {"3": {"logprob": -2.5, "rank": 1, "decoded_token": None}},
           {"4": {"logprob": -0.5, "rank": 1, "decoded_token": None}}]  # fmt: skip
    gen = wire.parse_generation(req, _answer([9], [_entry(9, -1.0, [])], prompt_logprobs=plp), 0.0)
    assert gen.output_ids == () and gen.logprobs == () and gen.finish_reason is FinishReason.LENGTH
    assert gen.prompt_logprobs == (None, -2.5, -0.5)  # from input_ids[1]: its own is None, as SGLang's


def _refusal(message: str, param: str | None, kind: str = "Bad Request") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": 400}}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (_refusal("temperature must be in [0, 2]", "temperature"), "sampling.temperature"),
        (_refusal("1 validation error", "body.token_ids.2"), "input_ids[2]"),
        (_refusal("Token id 700 is out of vocabulary", None, "BadRequestError"), "input_ids"),
        (_refusal("max_tokens must be at least 1", "body.sampling_params.max_tokens"), "sampling.max_new_tokens"),
    ],
)
def test_refusals_name_our_field(body: dict[str, Any], field: str) -> None:
    wire = VllmWire(entry_url="http://h:1")
    with pytest.raises(rb.InvalidRequest) as exc:
        wire.parse_generation(GenerateRequest(input_ids=[1]), HttpResponse.from_json(body, 400), 0.0)
    assert exc.value.field == field


def test_overload_and_server_errors() -> None:
    wire = VllmWire(entry_url="http://h:1")
    with pytest.raises(rb.Overloaded):
        wire.parse_generation(GenerateRequest(input_ids=[1]), HttpResponse(503, b"busy"), 0.0)
    with pytest.raises(rb.BackendUnavailable):
        wire.parse_generation(GenerateRequest(input_ids=[1]), HttpResponse(500, b"Internal Server Error"), 0.0)


def test_a_refused_flush_is_a_control_failure() -> None:
    wire = VllmWire(entry_url="http://h:1")
    with pytest.raises(rb.ControlFailed):
        wire.parse_control(FlushCache(), W, HttpResponse.from_json({"success": False}))
    wire.parse_control(FlushCache(), W, HttpResponse.from_json({"success": True}))


def _sse(*events: Any) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def _backend(handler: Any, n: int = 1, **wire: Any) -> HttpFleetBackend:
    workers = [Worker(id=f"h:{i}", control_url=f"http://h:{i}", generate_url=f"http://h:{i}") for i in range(n)]
    vwire = VllmWire(entry_url="http://h:0", routing=rb.RoutingKind.ROUND_ROBIN, **wire)
    client = HttpClient(transport=MockTransport(handler))
    return HttpFleetBackend(vwire, workers, client=client, rotate=True)


async def test_a_stream_ending_without_a_finish_was_aborted() -> None:
    """vLLM skips the output of an abort that adds no token: no finish_reason ever comes."""
    tok = {"request_id": "x", "choices": [{"index": 0, "logprobs": {"content": [_entry(4, -1.0, [])]},
                                           "finish_reason": None, "token_ids": [4]}], "usage": None}  # fmt: skip
    usage = {"request_id": "x", "choices": [], "usage": {"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1}}
    backend = _backend(lambda req: HttpResponse(200, _sse(tok, usage, b"[DONE]")))
    async with backend.stream(GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=9))) as s:
        chunks = [c async for c in s]
    final = chunks[-1].final
    assert final is not None and final.aborted and final.output_ids == (4,) and final.logprobs == (-1.0,)
    await backend.aclose()


async def test_commands_of_several_calls_stop_at_the_first_refusal() -> None:
    """A transfer session on vLLM: start, update, finish, in order; a refused update is the
    command's failure and finish is not sent (vLLM already ended the session)."""
    seen: list[str] = []

    def handler(req: HttpRequest) -> HttpResponse:
        seen.append(req.url.split("//", 1)[1].split("/", 1)[1])
        if req.url.endswith("/update_weights"):
            return HttpResponse(500, b"Internal Server Error")
        return HttpResponse.from_json({"message": "ok"})

    backend = _backend(handler, transfer_backend="nccl")
    bucket = WeightBucket((TensorSpec("a", "float32", (1,)),))
    with pytest.raises(rb.ControlFailed) as exc:
        await backend.update_weights_from_distributed(bucket, flush_cache=False)
    assert seen == ["start_weight_update", "update_weights"]
    assert exc.value.failures[0].worker == "h:0"
    seen.clear()
    await backend.update_weights_from_disk("/ckpt")  # reload, then the flush asked by default
    assert seen == ["collective_rpc", "reset_prefix_cache"]
    await backend.aclose()


async def test_without_a_router_unpinned_requests_go_round_the_servers() -> None:
    def handler(req: HttpRequest) -> HttpResponse:
        return _answer([5], None)

    backend = _backend(handler, n=3)
    sp = SamplingParams(max_new_tokens=1)
    workers = [
        (await backend.generate(GenerateRequest(input_ids=[1], sampling=sp, return_logprobs=False))).worker
        for _ in range(6)
    ]
    assert workers == ["h:0", "h:1", "h:2", "h:0", "h:1", "h:2"]
    assert (await backend.health()).router_live is None
    await backend.aclose()
