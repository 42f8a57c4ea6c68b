"""DynamoWire and the launcher's command lines, without processes (MockTransport)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import attrs
import pytest
import torch

from rollout_backends import (
    BackendUnavailable,
    ConnectionFailed,
    ContractViolation,
    ControlFailed,
    FinishReason,
    GenerateRequest,
    InvalidRequest,
    Overloaded,
    PauseMode,
    SamplingParams,
    Unsupported,
    VersionSource,
    WeightGroup,
)
from rollout_backends._http import HttpClient, HttpRequest, HttpResponse, MockTransport
from rollout_backends.adapters.dynamo import DynamoFleet, DynamoWire
from rollout_backends.adapters.dynamo._launcher import _WorkerPorts, frontend_argv, worker_argv, worker_env
from rollout_backends.adapters.dynamo._wire import completion_body, stop_strings_from_annotations
from rollout_backends.adapters.sglang import sampling_params_body
from rollout_backends.kit import (
    AbortAll,
    AbortRequest,
    FlushCache,
    GetVersion,
    HttpFleetBackend,
    InitWeightGroup,
    NamedTensors,
    Pause,
    ReleaseMemory,
    SetVersion,
    UpdateFromDisk,
    UpdateFromTensors,
    Worker,
)

W0 = Worker(id="127.0.0.1:21001", control_url="http://127.0.0.1:21001", instance_id=111)
W1 = Worker(id="127.0.0.1:21002", control_url="http://127.0.0.1:21002", instance_id=222)


def _wire(**kw: Any) -> DynamoWire:
    base: dict[str, Any] = dict(
        frontend_url="http://fe",
        model="tiny",
        router_mode="kv",
        instance_workers={111: W0.id, 222: W1.id},
        url_workers={W0.control_url: W0.id, W1.control_url: W1.id},
        eos_token_ids=(0,),
    )
    base.update(kw)
    return DynamoWire(**base)


def _answer(ids: list[int], lps: list[float] | None, finish: str = "length", **nvext: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"text": "", "index": 0, "finish_reason": finish}
    if lps is not None:
        choice["logprobs"] = {"tokens": [], "token_logprobs": lps, "top_logprobs": [], "text_offset": []}
    return {
        "choices": [choice],
        "usage": {"prompt_tokens": 3, "completion_tokens": len(ids), "prompt_tokens_details": {"cached_tokens": 2}},
        "nvext": {"completion_token_ids": ids, "worker_id": {"decode_worker_id": 222}, **nvext},
    }


def test_completion_body() -> None:
    req = GenerateRequest(
        input_ids=[1, 2, 3],
        sampling=SamplingParams(max_new_tokens=5, temperature=0.5, stop_token_ids=[7], seed=3, min_new_tokens=1),
        request_id="r1",
    )
    body = completion_body(req, "tiny", logprobs=True, instance_id=222)
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 5 and body["ignore_eos"] is False
    assert body["stop_token_ids"] == [7] and body["seed"] == 3 and body["min_tokens"] == 1 and body["logprobs"] == 0
    assert "top_k" not in body  # -1 (whole vocabulary) is Dynamo's default
    assert body["nvext"]["backend_instance_id"] == 222 and body["nvext"]["annotations"] == ["rid:r1"]
    assert {"completion_token_ids", "worker_id", "engine_data"} <= set(body["nvext"]["extra_fields"])
    http = _wire().generate(req, W1)
    assert http.url == "http://fe/v1/completions" and http.json["nvext"]["backend_instance_id"] == 222


def test_the_routing_key_is_the_frontends_session_id() -> None:
    """``routing_key`` travels as ``x-dynamo-session-id`` (the frontend's session affinity) on every
    generation route; no key, no header."""
    req = GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2), routing_key="session-1")
    native = _wire(native_generate=True)
    for http in (
        _wire().generate(req, None),
        _wire().generate(req, W1),
        _wire().stream(req, None),
        native.generate(req, None),
    ):
        assert dict(http.headers) == {"x-dynamo-session-id": "session-1"}, http.url
    assert native.generate(req, None).url == "http://fe/generate"
    assert dict(_wire().generate(attrs.evolve(req, routing_key=None), None).headers) == {}


def test_parse_generation() -> None:
    w = _wire()
    req = GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2))
    g = w.parse_generation(req, HttpResponse.from_json(_answer([4, 5], [-0.1, -0.2])), 0.1)
    assert g.output_ids == (4, 5) and g.finish_reason is FinishReason.LENGTH and g.worker == W1.id
    assert g.cached_tokens == 2 and g.prompt_tokens == 3 and g.weight_version is None
    assert g.logprobs is not None and abs(g.logprobs[0] + 0.1) < 1e-7
    # engine_data: version, raw finish reason (1.4.2 reports an abort as "stop"), worker by URL
    ed = {"weight_version": "v3", "finish_reason": "abort", "worker": W0.control_url}
    g = w.parse_generation(req, HttpResponse.from_json(_answer([4], [-0.1], "stop", engine_data=ed)), 0.1)
    assert g.aborted and g.weight_version == "v3" and g.worker == W0.id
    # stop on EOS without engine_data: STOP with the matched token
    g = w.parse_generation(req, HttpResponse.from_json(_answer([4, 0], [-0.1, -0.2], "stop", stop_reason=0)), 0.1)
    assert g.finish_reason is FinishReason.STOP and g.matched_stop == 0
    # "stop" on a token that stops nothing: an abort the frontend reported as stop
    g = w.parse_generation(req, HttpResponse.from_json(_answer([4, 9], [-0.1, -0.2], "stop")), 0.1)
    assert g.aborted


def test_parse_generation_errors() -> None:
    w = _wire()
    req = GenerateRequest(input_ids=[1])
    with pytest.raises(ContractViolation):  # never padded
        w.parse_generation(req, HttpResponse.from_json(_answer([4, 5], [-0.1])), 0.1)
    with pytest.raises(ContractViolation):
        w.parse_generation(req, HttpResponse.from_json(_answer([4, 5], None)), 0.1)
    with pytest.raises(ContractViolation):
        w.parse_generation(req, HttpResponse.from_json({"choices": []}), 0.1)
    with pytest.raises(InvalidRequest):
        w.parse_generation(req, HttpResponse.from_json({"message": "bad max_tokens"}, 400), 0.1)
    with pytest.raises(ConnectionFailed):  # nothing generated: safe to resend
        w.parse_generation(req, HttpResponse.from_json({"message": "Failed to generate completions"}, 500), 0.1)
    with pytest.raises(BackendUnavailable):
        w.parse_generation(req, HttpResponse.from_json({"message": "Failed to fold completions stream"}, 500), 0.1)
    # the mocker has no logprobs: none are asked for and none are required
    g = _wire(flavor="mocker").parse_generation(req, HttpResponse.from_json(_answer([4], None)), 0.1)
    assert g.logprobs is None


@pytest.mark.parametrize("flavor", ["rollout", "sglang14", "sglang14-shim", "sglang16", "sglang16-shim"])
def test_control_routes(flavor: str) -> None:
    w = _wire(flavor=flavor)
    pause = w.control(Pause(PauseMode.IN_PLACE), W0)
    assert pause is not None
    if flavor.startswith("sglang16"):
        assert pause.url.endswith("/engine/pause_generation") and pause.json == {"mode": "in_place"}
    else:
        assert pause.url.endswith("/engine/call_tokenizer_manager")
        assert pause.json["args"] == [{"io_struct.PauseGenerationReqInput": {"mode": "in_place"}}]
    sv = w.control(SetVersion("v2"), W0)
    assert sv is not None and sv.json == {"new_version": "v2", "abort_all_requests": False}
    flush = w.control(FlushCache(wait_s=2.5), W0)
    assert flush is not None
    if flavor.startswith("sglang16"):
        assert flush.url.endswith("/engine/flush_cache")
    else:  # TokenizerManager.flush_cache(timeout_s=): deferred until idle (SGLang 0.5.16)
        assert flush.json == {"method": "flush_cache", "args": [], "kwargs": {"timeout_s": 2.5}}
    g = WeightGroup(master_address="h", master_port=1234, world_size=3, backend="gloo")
    init = w.control(InitWeightGroup(g, 2), W0)
    assert init is not None and "2" in str(init.json) and "gloo" in str(init.json)
    disk = w.control(UpdateFromDisk(path="/ck", version=None, load_format=None, flush_cache=False), W0)
    assert disk is not None and disk.url.endswith("/engine/control/update_weights_from_disk")
    assert disk.json == {"model_path": "/ck", "abort_all_requests": False, "flush_cache": False}
    abort = w.control(AbortRequest("r"), W0)
    assert (abort is not None) == (flavor in ("rollout", "sglang14-shim", "sglang16-shim")) == w.aborts_by_id
    named = NamedTensors((("x", torch.zeros(1)),))
    tensors = w.control(UpdateFromTensors(tensors=named, version=None, flush_cache=False, load_format=None), W0)
    assert tensors is not None and tensors.url.endswith("/engine/control/update_weights_from_tensor")
    if abort is not None:
        assert abort.url.endswith("/engine/rollout/abort") and abort.json == {"rid": "r"}
    # success is checked in every body
    with pytest.raises(ControlFailed):
        w.parse_control(
            UpdateFromDisk(path="/ck", version=None, load_format=None, flush_cache=False),
            W0,
            HttpResponse.from_json({"success": False, "message": "no"}),
        )
    with pytest.raises(ControlFailed):
        w.parse_control(ReleaseMemory(None), W0, HttpResponse.from_json({"status": "error", "message": "no"}))


def test_abort_on_1_6_x_by_flavor() -> None:
    """Stock dynamo.sglang 1.6.1 over SGLang 0.5.16 aborts neither one request with its tokens nor
    all of them (GPU tier, H200, 2026-12-06): not declared, and abort_all() is Unsupported, never
    sent. Through the shim both go by its rollout/abort, from the worker's event loop."""
    stock, shim = _wire(flavor="sglang16"), _wire(flavor="sglang16-shim")
    assert not stock.capabilities().abort and not stock.aborts_by_id
    with pytest.raises(Unsupported, match=r"abort_all.*sglang16-shim"):
        stock.control(AbortAll(), W0)
    assert shim.capabilities().abort and shim.aborts_by_id
    every = shim.control(AbortAll(), W0)
    assert isinstance(every, HttpRequest) and every.url.endswith("/engine/rollout/abort")
    assert every.json == {"abort_all": True}
    # The shim reads the served version (rollout/weight_version) as on 1.4.2.
    got = shim.control(GetVersion(), W0)
    assert isinstance(got, HttpRequest) and got.url.endswith("/engine/rollout/weight_version")
    assert stock.control(GetVersion(), W0) is None


def test_a_refused_second_unregister_names_its_cause() -> None:
    """ai-dynamo 1.6.1 unregisters a paused worker again after each engine route; under file
    discovery the runtime refuses (GPU tier 2026-12-06, measured on CPU): the error says why and
    what to do instead of the runtime's words alone."""
    answer = {
        "error": "Handler error",
        "message": "Python callback failed: Exception: Unable to unregister endpoint instance from discovery. "
        "Check discovery service status",
    }
    with pytest.raises(ControlFailed, match=r"(?s)Unable to unregister.*file discovery.*shim.*etcd") as e:
        _wire(flavor="sglang16").parse_control(FlushCache(), W0, HttpResponse.from_json(answer, 500))
    assert e.value.failures[0].worker == W0.id
    other = {"error": "Handler error", "message": "boom"}
    with pytest.raises(ControlFailed) as e2:
        _wire(flavor="sglang16").parse_control(FlushCache(), W0, HttpResponse.from_json(other, 500))
    assert "discovery" not in str(e2.value)


def test_sglang14_abort_all_500_is_success() -> None:
    w = _wire(flavor="sglang14")
    msg = {"error": "Handler error", "message": "TypeError: object NoneType can't be used in 'await' expression"}
    w.parse_control(AbortAll(), W0, HttpResponse.from_json(msg, 500))  # no raise
    with pytest.raises(ControlFailed):
        w.parse_control(FlushCache(), W0, HttpResponse.from_json(msg, 500))


def test_stringified_struct_results_keep_their_success() -> None:
    """dynamo.sglang 1.4.2 answers HTTP 200 {"result": str(msgspec struct)}: a refused flush must fail."""
    w = _wire(flavor="sglang14")
    refused = {"result": "FlushCacheReqOutput(rid=None, http_worker_ipc=None, success=False, message='')"}
    with pytest.raises(ControlFailed) as e:
        w.parse_control(FlushCache(), W0, HttpResponse.from_json(refused))
    assert "FlushCacheReqOutput" in str(e.value) and W0.id in str(e.value)
    busy = {"result": "FlushCacheReqOutput(rid=None, success=False, message='not idle, 3 running')"}
    with pytest.raises(ControlFailed, match="not idle, 3 running"):
        w.parse_control(FlushCache(), W0, HttpResponse.from_json(busy))
    done = {"result": "FlushCacheReqOutput(rid=None, http_worker_ipc=None, success=True, message='')"}
    w.parse_control(FlushCache(), W0, HttpResponse.from_json(done))  # no raise
    # Anything else in "result" is unreadable: never taken as done (the shim once sent an
    # array_like struct as a list, and a refused flush passed).
    for unreadable in ("ok", ["FlushCacheReqOutput", None, None, False, ""]):
        with pytest.raises(ContractViolation, match="unreadable"):
            w.parse_control(FlushCache(), W0, HttpResponse.from_json({"result": unreadable}))


def test_capabilities_by_mode_and_flavor() -> None:
    assert _wire(router_mode="round-robin").capabilities().worker_pinning is False
    assert _wire(router_mode="direct").capabilities().worker_pinning is True
    m = _wire(flavor="mocker", vocab_size=512, model_path="/m/tiny").capabilities()
    assert not m.pause_modes and not m.weight_transports and not m.logprobs
    # Random tokens in [1000, 2000) whatever the model's vocabulary (prompts are the model's), no abort route.
    assert not m.greedy_decoding and m.vocab_size == 512 and not m.abort
    ours = _wire(vocab_size=512, model_path="/m/tiny").capabilities()
    assert ours.greedy_decoding and ours.vocab_size == 512 and ours.abort and ours.model_path == "/m/tiny"


def test_memory_release_follows_the_workers_memory_saver(tmp_path: Any) -> None:
    """SGLang without ``--enable-memory-saver`` answers a release with success and frees nothing
    (the GRPO bench's Dynamo rows released and resumed every step, SGLang direct's did not: H100,
    2026-12-06); the launcher says what it started, a URL may say it too."""
    from rollout_backends.adapters.dynamo import RunningDynamoFleet, open_from_url

    assert _wire(flavor="sglang14").capabilities().memory_release
    assert not _wire(flavor="sglang14", memory_saver=False).capabilities().memory_release

    def options(**kw: Any) -> dict[str, Any]:
        cfg = DynamoFleet(model_path="/m/tiny", **kw)
        fleet = RunningDynamoFleet(config=cfg, namespace="ns", frontend_url="http://f:1", worker_urls=(),
                                   rpc_ports={}, worker_names=(), supervisor=None, run_dir=tmp_path)  # type: ignore[arg-type]  # fmt: skip
        return fleet.connect_options()

    assert options()["memory_saver"] is False
    assert options(sglang_args=("--enable-memory-saver",))["memory_saver"] is True
    assert "memory_saver" not in options(worker_kind="reference")
    with pytest.raises(InvalidRequest) as exc:
        asyncio.run(open_from_url("dynamo://127.0.0.1:1?memory_saver=maybe"))
    assert exc.value.field == "url.memory_saver"


async def test_the_mocker_relabels_in_the_fleet_and_refuses_engine_controls_typed() -> None:
    """The mocker has no engine routes: a relabel is the fleet's own (its versions are STAMPED),
    and every engine command is ``Unsupported`` naming it (each answered 404 before)."""
    sent: list[str] = []

    async def handler(req: HttpRequest) -> HttpResponse:
        sent.append(req.url)
        return HttpResponse(status=404, body=b"Route not found")

    wire = _wire(flavor="mocker", version_source=VersionSource.STAMPED)
    b = HttpFleetBackend(wire, [W0, W1], client=HttpClient(MockTransport(handler)))
    b.set_installed_version("v0")
    await b.set_weight_version("v1", workers=[W1.id])
    assert dict(await b.weight_versions()) == {W0.id: "v0", W1.id: "v1"} and sent == []
    for call, name in ((b.abort_all, "abort_all"), (b.flush_cache, "flush_cache")):
        with pytest.raises(Unsupported, match=name):
            await call()
    assert sent == []
    await b.aclose()


def test_min_new_tokens_is_refused_where_the_workers_drop_it() -> None:
    """dynamo.sglang 1.4.2 builds SGLang's sampling params without min_tokens: refused, not dropped."""
    req = GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=8, min_new_tokens=4))
    for flavor in ("sglang14", "sglang14-shim"):
        with pytest.raises(Unsupported, match=r"sampling\.min_new_tokens"):
            _wire(flavor=flavor).generate(req, None)
    assert _wire().generate(req, None).json["min_tokens"] == 4  # our worker passes it on


async def test_abort_cancels_the_in_flight_call() -> None:
    """Where the engine cannot abort by id, abort() cancels the client's HTTP call."""
    gate = asyncio.Event()

    async def handler(req: HttpRequest) -> HttpResponse:
        await gate.wait()
        return HttpResponse.from_json(_answer([1], [-0.5]))

    wire = _wire(flavor="sglang14")
    b = HttpFleetBackend(wire, [W0, W1], client=HttpClient(MockTransport(handler)))
    b.set_installed_version("v1")
    req = GenerateRequest(input_ids=[1, 2], worker=W1.id)
    task = asyncio.ensure_future(b.generate(req))
    await asyncio.sleep(0.01)
    assert b.inflight == (req.request_id,)
    await b.abort(req.request_id)
    g = await task
    assert g.aborted and g.output_ids == () and g.logprobs == () and g.worker == W1.id and g.weight_version == "v1"
    assert b.inflight == ()
    # a caller's own cancellation still propagates
    task = asyncio.ensure_future(b.generate(GenerateRequest(input_ids=[1])))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    await b.aclose()


def test_launcher_command_lines() -> None:
    cfg = DynamoFleet(
        model_path="/m/tiny",
        worker_kind="sglang",
        workers=2,
        router_mode="kv",
        kv_events=True,
        router_predicted_ttl_secs=5,
        stream_interval=4,
        sglang_args=["--tp", "1"],
        gpus=["2", "3"],
    )
    fe = frontend_argv(cfg, "ns1", 20000)
    for flag in ("--discovery-backend", "--request-plane", "--event-plane", "--kv-cache-block-size"):
        assert flag in fe
    assert fe[fe.index("--router-predicted-ttl-secs") + 1] == "5" and "--no-router-kv-events" not in fe
    ports = _WorkerPorts(system=21000, rpc=21001, kv_events=21002, sglang=21003, nccl=21004)
    argv = worker_argv(cfg, 1, "ns1", ports)
    assert argv[1:3] == ["-m", "rollout_backends.adapters.dynamo._sglang_shim"]
    assert "--enable-rl" in argv and argv[argv.index("--page-size") + 1] == "16"
    assert '"endpoint":"tcp://*:21002"' in argv[argv.index("--kv-events-config") + 1]
    assert argv[argv.index("--stream-interval") + 1] == "4" and argv[-2:] == ["--tp", "1"]
    env = worker_env(cfg, 1, {}, ports)
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["PYTHONHASHSEED"] == "0" and env["DYN_SYSTEM_PORT"] == "21000"
    off = DynamoFleet(model_path="/m", router_mode="kv", kv_events=False)
    assert "--no-router-kv-events" in frontend_argv(off, "ns", 1)
    assert "--router-session-affinity-ttl-secs" not in fe
    sticky = frontend_argv(attrs.evolve(off, session_affinity_ttl_secs=600), "ns", 1)
    assert sticky[sticky.index("--router-session-affinity-ttl-secs") + 1] == "600"
    from rollout_backends.adapters.dynamo.launch import config_from_args, parse_args

    cli = config_from_args(parse_args(["--model-path", "/m", "--session-affinity-ttl-secs", "600"]))
    assert cli.session_affinity_ttl_secs == 600
    # Unless told otherwise, sglang workers stream every 50 tokens (SGLang's 1 cost 1.20x the step
    # time on an H200); None leaves SGLang's own default.
    plain = DynamoFleet(model_path="/m", worker_kind="sglang", workers=1)
    assert worker_argv(plain, 0, "ns", ports)[worker_argv(plain, 0, "ns", ports).index("--stream-interval") + 1] == "50"
    assert "--stream-interval" not in worker_argv(attrs.evolve(plain, stream_interval=None), 0, "ns", ports)


def test_launcher_config_validation() -> None:
    with pytest.raises(InvalidRequest):
        DynamoFleet(model_path="/m", worker_kind="trtllm")  # vllm is a worker kind since issue 31
    with pytest.raises(InvalidRequest):
        DynamoFleet(model_path="/m", router_mode="kv", kv_events=False, router_predicted_ttl_secs=5)
    with pytest.raises(InvalidRequest):
        DynamoFleet(model_path="/m", discovery="etcd")
    for ttl in (0, 3.5, True, 10**9):
        with pytest.raises(InvalidRequest) as info:
            DynamoFleet(model_path="/m", session_affinity_ttl_secs=ttl)  # type: ignore[arg-type]
        assert info.value.field == "session_affinity_ttl_secs"
    cfg = DynamoFleet(model_path="/m", discovery="etcd", etcd_endpoints=["http://10.0.0.1:2379"])
    assert "etcd" in frontend_argv(cfg, "ns", 1)


# -- native /generate (ai-dynamo 1.6.x frontend, DYN_SGLANG_ENABLE_GENERATE=1) ----------------------


def _sse(*events: Any) -> HttpResponse:
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return HttpResponse(200, body, {"Content-Type": "text/event-stream"})


def _event(ids: list[int], lps: list[float] | None, finish: Any = None, **meta: Any) -> dict[str, Any]:
    m: dict[str, Any] = {"id": "r1", "finish_reason": finish, "prompt_tokens": 3, **meta}
    if lps is not None:
        m["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
    return {"output_ids": ids, "meta_info": m}


def test_native_generate_routes_unpinned_requests_only() -> None:
    w = _wire(native_generate=True)
    req = GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=5, temperature=0.7, seed=3))
    http = w.generate(req, None)
    assert http.url == "http://fe/generate"
    assert http.json == {
        "rid": req.request_id,
        "input_ids": (1, 2, 3),  # the validated tuple itself: the same JSON array
        "sampling_params": sampling_params_body(req.sampling),
        "return_logprob": True,
        "stream": True,  # the frontend answers 501 to a non-streamed /generate
    }
    assert http.json["sampling_params"]["sampling_seed"] == 3 and http.json["sampling_params"]["temperature"] == 0.7
    # 1.6.1's /generate ignores the pinning header: a pinned request stays on /v1/completions
    pinned = w.generate(req, W0)
    assert pinned.url == "http://fe/v1/completions" and pinned.json["nvext"]["backend_instance_id"] == 111
    assert _wire().generate(req, None).url == "http://fe/v1/completions"
    # 1.6.1's /generate answer carries no text: a request with stop strings (whose text is cut at
    # the match) stays on /v1/completions too
    stopping = attrs.evolve(req, sampling=attrs.evolve(req.sampling, stop=("ab",)))
    http = w.generate(stopping, None)
    assert http.url == "http://fe/v1/completions" and http.json["stop"] == ["ab"]


def test_parse_native_generation() -> None:
    w = _wire(native_generate=True)
    req = GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=3), request_id="mine")
    # Deltas concatenate; logprobs keep every bit (no f32 on this path); the worker names itself.
    lp = [-0.123456789012345, -1e-12, -7.0]
    resp = _sse(
        _event([4], lp[:1], completion_tokens=1),
        _event([5, 6], lp[1:], {"type": "length", "length": 3}, completion_tokens=3, cached_tokens=2,
               weight_version="v7", worker=W0.control_url),
    )  # fmt: skip
    g = w.parse_generation(req, resp, 0.1)
    assert g.output_ids == (4, 5, 6) and g.logprobs == tuple(lp) and g.finish_reason is FinishReason.LENGTH
    assert g.weight_version == "v7" and g.worker == W0.id and g.cached_tokens == 2 and g.request_id == "mine"
    # stop (matched token included), abort with partial tokens, no logprobs asked
    g = w.parse_generation(req, _sse(_event([4, 0], [-0.1, -0.2], {"type": "stop", "matched": 0})), 0.1)
    assert g.finish_reason is FinishReason.STOP and g.matched_stop == 0
    g = w.parse_generation(req, _sse(_event([4], [-0.1], {"type": "abort", "message": "aborted"})), 0.1)
    assert g.aborted and g.output_ids == (4,) and g.worker is None  # not named: the fleet fills it in if it knows
    nolp = GenerateRequest(input_ids=[1], return_logprobs=False)
    assert w.parse_generation(nolp, _sse(_event([4], None, {"type": "length"})), 0.1).logprobs is None


def test_parse_native_generation_errors() -> None:
    w = _wire(native_generate=True)
    req = GenerateRequest(input_ids=[1])
    with pytest.raises(BackendUnavailable):  # a failure after the stream began: HTTP 200 + an error event
        w.parse_generation(req, _sse({"error": {"message": "Internal server error"}}), 0.1)
    with pytest.raises(ContractViolation):  # the stream ended without a finished event
        w.parse_generation(req, _sse(_event([4], [-0.1])), 0.1)
    with pytest.raises(ContractViolation):  # fewer logprobs than tokens: never padded
        w.parse_generation(req, _sse(_event([4], [-0.1]), _event([5], None, {"type": "length"})), 0.1)
    with pytest.raises(ContractViolation):  # ids and completion_tokens disagree
        w.parse_generation(req, _sse(_event([4], [-0.1], {"type": "length"}, completion_tokens=2)), 0.1)
    bad = _event([4], [-0.1], {"type": "length"})
    bad["meta_info"]["output_token_logprobs"] = [[-0.1, 9, None]]
    with pytest.raises(ContractViolation):  # a logprob for another token
        w.parse_generation(req, _sse(bad), 0.1)
    with pytest.raises(ContractViolation):
        w.parse_generation(req, HttpResponse(200, b"data: {not json\n\n"), 0.1)
    with pytest.raises(InvalidRequest):
        w.parse_generation(req, HttpResponse.from_json({"error": {"message": "input_ids cannot be empty."}}, 400), 0.1)
    with pytest.raises(BackendUnavailable):  # no worker advertises sglang_generate
        msg = {"error": {"message": "no generate-capable model is registered"}}
        w.parse_generation(req, HttpResponse.from_json(msg, 404), 0.1)
    # A 500 before the stream began (the routed worker is dead): nothing was generated, resendable.
    dead = HttpResponse.from_json({"error": {"message": "internal server error"}}, 500)
    with pytest.raises(ConnectionFailed) as ei:
        w.parse_generation(req, dead, 0.1)
    assert ei.value.nothing_generated
    # ... but only for the native route: a pinned request went to /v1/completions
    with pytest.raises(BackendUnavailable):
        w.parse_generation(GenerateRequest(input_ids=[1], worker=W0.id), dead, 0.1)


def test_refusals_name_the_field() -> None:
    """Our worker's refusals (the codec's message form) and Dynamo's own words for the budget."""
    w = _wire(native_generate=True)
    req = GenerateRequest(input_ids=[1])
    cases = [
        ({"message": "sampling_params.stop_token_ids[0]: token id 600 is outside", "code": 400},
         "sampling.stop_token_ids[0]"),
        ({"message": "prompt tokens (10) + max tokens (5000) exceed the context length 4096", "code": 400},
         "sampling.max_new_tokens"),
        ({"message": "max_completion_tokens must be positive", "code": 400}, "sampling.max_new_tokens"),
        ({"message": "stop_token_ids must be a list", "code": 400}, "sampling.stop_token_ids"),
    ]  # fmt: skip
    for body, field in cases:
        with pytest.raises(InvalidRequest) as ei:
            w.parse_generation(req, HttpResponse.from_json(body, 400), 0.1)
        assert ei.value.field == field, body
    # A refusal inside the native stream (SGLang's error object) is the caller's, not the fleet's.
    err = {"error": {"message": "rid: Duplicate request ID detected: r", "type": "invalid_request_error",
                     "param": "rid", "code": 400}}  # fmt: skip
    with pytest.raises(InvalidRequest) as ei:
        w.parse_generation(req, _sse(err), 0.1)
    assert ei.value.field == "request_id" and str(ei.value) == "request_id: Duplicate request ID detected: r"


def test_frontend_503_is_not_resendable() -> None:
    """1.6.1 answers 503 "Service temporarily unavailable" for requests routed to a dead worker and
    for requests that were running on it when it died: tokens may have been generated."""
    body = {"message": "Service temporarily unavailable", "type": "Service Unavailable", "code": 503}
    with pytest.raises(Overloaded) as ei:
        _wire().parse_generation(GenerateRequest(input_ids=[1]), HttpResponse.from_json(body, 503), 0.1)
    assert not ei.value.nothing_generated


def _frontend(generate: HttpResponse, info: dict[str, Any] | None) -> MockTransport:
    seen: list[str] = []

    def handler(req: HttpRequest) -> HttpResponse:
        seen.append(req.url)
        path = req.url.split("://", 1)[1].split("/", 1)[1]
        if path == "v1/models":
            return HttpResponse.from_json({"data": [{"id": "tiny"}]})
        if path == "health":
            return HttpResponse.from_json({"instances": []})
        if path == "generate":
            assert req.json == {"input_ids": [], "stream": True}  # the probe generates nothing
            return generate
        if path == "engine/rollout/info" and info is not None:
            return HttpResponse.from_json(info)
        return HttpResponse.from_json({"message": f"Route not found: POST /{path}"}, 404)

    transport = MockTransport(handler)
    transport.seen = seen  # type: ignore[attr-defined]
    return transport


SERVED = HttpResponse.from_json({"error": {"message": "input_ids cannot be empty."}}, 400)
ABSENT = HttpResponse.from_json({"message": "Route not found: POST /generate", "code": 404}, 404)


@pytest.mark.parametrize(
    ("frontend", "info", "asked", "native"),
    [
        (SERVED, {"instance_id": 111, "native_generate": True}, None, True),  # 1.6.x + our worker
        (ABSENT, {"instance_id": 111, "native_generate": True}, None, False),  # 1.4.x, or no DYN_SGLANG_ENABLE_GENERATE
        (SERVED, {"instance_id": 111}, None, False),  # a worker that does not advertise it
        (SERVED, None, None, False),  # dynamo.sglang / mocker: their /generate answers name no worker
        (SERVED, {"instance_id": 111, "native_generate": True}, False, False),  # turned off
        (SERVED, None, True, True),  # asked for explicitly
    ],
)
async def test_connect_detects_native_generate(
    frontend: HttpResponse, info: dict[str, Any] | None, asked: bool | None, native: bool
) -> None:
    from rollout_backends.adapters.dynamo import connect

    transport = _frontend(frontend, info)
    flavor = None if info is not None else "sglang16"
    b = await connect(
        "http://fe:1", workers=["http://w:1"], flavor=flavor, native_generate=asked, client=HttpClient(transport)
    )
    try:
        assert b.wire.native_generate is native  # type: ignore[attr-defined]
    finally:
        await b.aclose()


async def test_connect_native_generate_required_but_absent() -> None:
    from rollout_backends.adapters.dynamo import connect

    with pytest.raises(Unsupported):
        await connect("http://fe:1", workers=["http://w:1"], flavor="sglang16", native_generate=True,
                      client=HttpClient(_frontend(ABSENT, None)))  # fmt: skip


async def test_registry_url_native_generate_option() -> None:
    from rollout_backends.adapters.dynamo import open_from_url

    with pytest.raises(InvalidRequest) as ei:
        await open_from_url("dynamo://fe:1?native_generate=maybe")
    assert ei.value.field == "url.native_generate"
    b = await open_from_url(
        "dynamo://fe:1?workers=w:1&flavor=sglang16&native_generate=0", client=HttpClient(_frontend(SERVED, None))
    )
    try:
        assert b.wire.native_generate is False  # type: ignore[attr-defined]
    finally:
        await b.aclose()


@pytest.mark.parametrize(
    ("routes", "flavor"),
    [
        ({"rollout/info": (200, {"instance_id": 7})}, "rollout"),
        ({"call_tokenizer_manager": (500, {"error": "Handler error", "message": "KeyError: 'method'"})}, "sglang14"),
        (
            {
                "call_tokenizer_manager": (500, {"error": "Handler error", "message": "KeyError: 'method'"}),
                "rollout/weight_version": (200, {"weight_version": "v1"}),
            },
            "sglang14-shim",
        ),
        ({}, "sglang16"),  # 1.6.x: no call_tokenizer_manager ("Route not found")
        ({"rollout/weight_version": (200, {"weight_version": "v1"})}, "sglang16-shim"),
    ],
)
async def test_detect_flavor(routes: dict[str, tuple[int, dict[str, Any]]], flavor: str) -> None:
    from rollout_backends.adapters.dynamo import detect_flavor

    def handler(req: HttpRequest) -> HttpResponse:
        route = req.url.split("/engine/", 1)[1]
        if route in routes:
            status, body = routes[route]
            return HttpResponse.from_json(body, status)
        return HttpResponse.from_json({"error": "Route not found", "message": f"Route /engine/{route} not found"}, 404)

    client = HttpClient(MockTransport(handler))
    try:
        got, _ = await detect_flavor(client, "http://w:1")
    finally:
        await client.aclose()
    assert got == flavor


def test_launcher_passes_both_versions_knobs() -> None:
    """Each knob is read by one Dynamo version and ignored by the other (``_commands.py``)."""
    from rollout_backends.adapters.dynamo._launcher import _node, fleet_planes, frontend_command

    cfg = DynamoFleet(model_path="/m/tiny", worker_kind="sglang", workers=1)
    env = frontend_command(cfg, "ns", fleet_planes(cfg)).build(_node(cfg, -1, "", set()), []).spec.env
    assert env["DYN_SGLANG_ENABLE_GENERATE"] == "1"
    off = DynamoFleet(model_path="/m/tiny", native_generate=False)
    assert (
        "DYN_SGLANG_ENABLE_GENERATE"
        not in frontend_command(off, "ns", fleet_planes(off)).build(_node(off, -1, "", set()), []).spec.env
    )
    ports = _WorkerPorts(system=21000, rpc=21001, kv_events=21002, sglang=21003, nccl=21004)
    wenv = worker_env(cfg, 0, {}, ports)
    routes = str(wenv["DYN_SGLANG_ENGINE_ROUTES"]).split()
    # what the sglang16 wire sends beyond 1.6.x's built-in routes
    assert routes == ["flush_cache", "init_weights_update_group", "destroy_weights_update_group", "abort_request:tm"]
    assert "--enable-rl" in worker_argv(cfg, 0, "ns", ports)  # 1.4.x: call_tokenizer_manager
    ref = DynamoFleet(model_path="/m/tiny", worker_kind="reference", workers=1)
    assert "DYN_SGLANG_ENGINE_ROUTES" not in worker_env(ref, 0, {}, ports)


@pytest.mark.parametrize("ids", [[1, True], [1, "2"], [1.0], "12", {"0": 1}])
def test_completion_token_ids_must_be_ints(ids: Any) -> None:
    """The one-pass int check (overhead benchmark) keeps the rule: a list of ints, never bools."""
    wire = _wire(flavor="mocker")
    req = GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2), return_logprobs=False)
    with pytest.raises(ContractViolation, match="completion_token_ids"):
        wire.parse_completion(req, _answer(ids, None), 0.0)


def test_completion_token_ids_of_an_int_subclass_still_pass() -> None:
    import enum

    class Tok(enum.IntEnum):
        A = 5

    wire = _wire(flavor="mocker")
    req = GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2), return_logprobs=False)
    gen = wire.parse_completion(req, _answer([Tok.A, 6], None), 0.0)
    assert gen.output_ids == (5, 6)


def test_top_logprobs_by_token_id() -> None:
    """``logprobs: k`` with ids as token names (1.4.2 renders the worker's ``top_logprobs`` as
    ``[{"token": "token_id:<id>", "logprob", "bytes"}]`` per token); at most 5 (the frontend's limit)."""
    w = _wire()
    req = GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2, top_logprobs=2))
    body = w.generate(req, None).json
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True
    ans = _answer([4, 5], [-0.1, -0.2])
    ans["choices"][0]["logprobs"]["top_logprobs"] = [
        [{"token": "token_id:4", "logprob": -0.1, "bytes": []}, {"token": "token_id:9", "logprob": -2.5}],
        [{"token": "token_id:3", "logprob": -0.2}, {"token": "token_id:5", "logprob": -0.2}],
    ]
    g = w.parse_generation(req, HttpResponse.from_json(ans), 0.1)
    assert g.top_logprobs is not None
    assert [[t for t, _ in top] for top in g.top_logprobs] == [[4, 9], [3, 5]]  # ties by id
    ans["choices"][0]["logprobs"]["top_logprobs"][1] = [{"token": "x", "logprob": -0.2}]
    with pytest.raises(ContractViolation):  # a token named by text, not by id
        w.parse_generation(req, HttpResponse.from_json(ans), 0.1)
    with pytest.raises(InvalidRequest) as e:
        w.generate(attrs.evolve(req, sampling=SamplingParams(top_logprobs=6)), None)
    assert e.value.field == "sampling.top_logprobs"
    assert _wire().capabilities().top_logprobs == 5
    assert _wire(flavor="sglang14").capabilities().top_logprobs == 0
    with pytest.raises(InvalidRequest):  # stock dynamo.sglang refuses >= 1
        _wire(flavor="sglang14").generate(req, None)
    # without top_logprobs the body is as before
    assert "return_tokens_as_token_ids" not in w.generate(attrs.evolve(req, sampling=SamplingParams()), None).json


def test_top_logprobs_drop_the_chosen_token_the_frontend_appends() -> None:
    """A sampled token outside the worker's top k comes as a k + 1-th entry (the frontend's
    ``convert_backend_top_logprobs``; at temperature > 0 this failed as a ContractViolation): dropped;
    a k + 1-th entry that is not the chosen token alone is still the frontend's breach. 1.4.2 sends
    lists of entries, 1.6.1 objects."""
    w = _wire()
    req = GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2, temperature=1.0, top_logprobs=2))

    def entry(tid: int, lp: float) -> dict[str, Any]:
        return {"token": f"token_id:{tid}", "logprob": lp}

    ans = _answer([297, 5], [-4.5, -0.2])
    tops = [[entry(377, -1.6), entry(237, -1.9), entry(297, -4.5)], [entry(5, -0.2), entry(3, -0.9)]]
    ans["choices"][0]["logprobs"]["top_logprobs"] = tops
    g = w.parse_generation(req, HttpResponse.from_json(ans), 0.1)
    assert g.top_logprobs is not None
    assert [[t for t, _ in top] for top in g.top_logprobs] == [[377, 237], [5, 3]]
    # 1.6.1 sends each position as OpenAI's legacy completions object {token: logprob}
    ans["choices"][0]["logprobs"]["top_logprobs"] = [{e["token"]: e["logprob"] for e in pos} for pos in tops]
    assert w.parse_generation(req, HttpResponse.from_json(ans), 0.1).top_logprobs == g.top_logprobs
    for bad in (
        [entry(377, -1.6), entry(237, -1.9), entry(300, -4.5)],  # the extra one is not the chosen token
        [entry(297, -1.6), entry(237, -1.9), entry(297, -4.5)],  # the chosen token is in the top k already
    ):
        ans["choices"][0]["logprobs"]["top_logprobs"] = [bad, tops[1]]
        with pytest.raises(ContractViolation, match=r"top_logprobs\[0\]"):
            w.parse_generation(req, HttpResponse.from_json(ans), 0.1)


def test_stop_strings_matched_by_the_frontend() -> None:
    """1.4.2 matches stop strings on its decoded text: finish "stop", nvext.stop_reason the string,
    the text cut before it (measured); without ignore_eos only (it drops them with ignore_eos)."""
    w = _wire()
    req = GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=8, stop=["e"]))
    assert w.generate(req, None).json["stop"] == ["e"]
    ans = _answer([272, 253, 339], [-0.1, -0.2, -0.3], "stop", stop_reason="e")
    ans["choices"][0]["text"] = " an\ufffdor"
    g = w.parse_generation(req, HttpResponse.from_json(ans), 0.1)
    assert g.finish_reason is FinishReason.STOP and g.matched_stop == "e" and g.text == " an\ufffdor"
    keep = attrs.evolve(req, sampling=req.sampling.replace(no_stop_trim=True))
    assert w.parse_generation(keep, HttpResponse.from_json(ans), 0.1).text == " an\ufffdore"
    with pytest.raises(InvalidRequest) as e:
        w.generate(attrs.evolve(req, sampling=req.sampling.replace(ignore_eos=True)), None)
    assert e.value.field == "sampling.stop"
    assert w.capabilities().stop_strings and not _wire(flavor="mocker").capabilities().stop_strings
    # Behind stock dynamo.sglang the frontend's stop cuts the worker's last chunk (version, worker): not declared.
    assert not any(_wire(flavor=f).capabilities().stop_strings for f in ("sglang14", "sglang16"))


def test_stop_strings_matched_in_the_shim() -> None:
    """Behind the shim the stop strings go to the worker only (an nvext annotation: the frontend does
    not match them, so it cannot end the stream before the worker's last chunk), which reports the
    match in engine_data with the whole output's text; the wire cuts it as SGLang does."""
    w = _wire(flavor="sglang14-shim")
    assert w.capabilities().stop_strings
    req = GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=8, stop=["e", "\u2603"]))
    body = w.generate(req, None).json
    assert "stop" not in body
    assert body["nvext"]["annotations"] == [f"rid:{req.request_id}", 'stop-strings:["e", "\\u2603"]']
    assert stop_strings_from_annotations(body["nvext"]) == ("e", "\u2603")  # what the shim reads back
    assert w.stream(req, None).json["nvext"]["annotations"] == body["nvext"]["annotations"]
    ed = {"weight_version": "v3", "finish_reason": "stop", "matched_stop": "e"}
    ans = _answer([272, 253, 339], [-0.1, -0.2, -0.3], "stop", engine_data=ed)
    ans["choices"][0]["text"] = " an\ufffdore"
    g = w.parse_generation(req, HttpResponse.from_json(ans), 0.1)
    assert (g.finish_reason, g.matched_stop, g.text, g.weight_version) == (FinishReason.STOP, "e", " an\ufffdor", "v3")
    keep = attrs.evolve(req, sampling=req.sampling.replace(no_stop_trim=True))
    assert w.parse_generation(keep, HttpResponse.from_json(ans), 0.1).text == " an\ufffdore"
    # SGLang keeps stop strings under ignore_eos; so does the shim (the frontend never sees them).
    ig = attrs.evolve(req, sampling=req.sampling.replace(ignore_eos=True))
    assert "stop-strings:" in w.generate(ig, None).json["nvext"]["annotations"][1]
    # No match: the whole text, the finish as the worker says.
    ans = _answer([272, 253], [-0.1, -0.2], "length", engine_data={"weight_version": "v3", "finish_reason": "length"})
    ans["choices"][0]["text"] = " an"
    g = w.parse_generation(req, HttpResponse.from_json(ans), 0.1)
    assert (g.finish_reason, g.matched_stop, g.text) == (FinishReason.LENGTH, None, " an")
    # A worker without a tokenizer refuses, naming the field.
    refused = {"finish_reason": "abort", "refused": {"param": "sampling_params.stop", "message": "no tokenizer"}}
    with pytest.raises(InvalidRequest) as e:
        w.parse_generation(req, HttpResponse.from_json(_answer([], [], "stop", engine_data=refused)), 0.1)
    assert e.value.field == "sampling.stop"
    for bad in ("stop-strings:[1]", "stop-strings:{", "stop-strings:[]", 'stop-strings:[""]'):
        with pytest.raises(InvalidRequest) as e:
            stop_strings_from_annotations({"annotations": [bad]})
        assert e.value.field == "sampling.stop"
    assert stop_strings_from_annotations({"annotations": ["rid:x"]}) == ()


def _completion_chunk(ids: list[int], lps: list[float], finish: str | None = None, **engine_data: Any) -> bytes:
    """One SSE chunk of the frontend's streamed /v1/completions (1.4.2's shape, measured)."""
    choice: dict[str, Any] = {"text": "", "index": 0, "logprobs": {"tokens": [], "token_logprobs": lps}}
    if finish is not None:
        choice["finish_reason"] = finish
    nvext: dict[str, Any] = {"completion_token_ids": ids, "worker_id": {"decode_worker_id": 222}}
    if engine_data:
        nvext["engine_data"] = engine_data
    event: dict[str, Any] = {"choices": [choice], "nvext": nvext}
    if finish is not None:
        event["usage"] = {"prompt_tokens": 3, "completion_tokens": 3}
    return json.dumps(event).encode()


def test_stream_chunks_carry_their_own_versions() -> None:
    """Our worker stamps every chunk with its tokens' version (engine_data.chunk_weight_version):
    a chunk whose engine_data holds only that is not the last; the last has its own too."""
    assert _wire().capabilities().stream_version_spans  # our worker (FlavorRoutes.chunk_versions)
    assert not _wire(flavor="sglang14-shim").capabilities().stream_version_spans  # SGLang's stamps are early
    assert _wire().capabilities().update_while_parked  # our worker flushes with requests parked
    assert not _wire(flavor="sglang14-shim").capabilities().update_while_parked  # SGLang 0.5.16 refuses
    assert not _wire(flavor="sglang14").capabilities().stream_version_spans  # stock dynamo.sglang: none
    assert not _wire(flavor="sglang16").capabilities().stream_version_spans
    w = _wire()
    req = GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=3, temperature=0.0))
    parser = w.stream_parser(req, HttpResponse(200, b"", {}), worker=None)
    first = parser.event(_completion_chunk([11], [-0.5], chunk_weight_version="v0"), 0.1)
    second = parser.event(_completion_chunk([12], [-0.25], chunk_weight_version="v1"), 0.1)
    assert first is not None and second is not None and first.final is None and second.final is None
    assert (first.index, first.output_ids, first.weight_version) == (0, (11,), "v0")
    assert (second.index, second.output_ids, second.weight_version) == (1, (12,), "v1")
    last = parser.event(
        _completion_chunk(
            [13], [-0.125], "length", chunk_weight_version="v1", weight_version="v1", finish_reason="length",
            worker=W1.control_url,
        ),
        0.1,
    )  # fmt: skip
    assert last is not None and last.final is not None
    assert (last.index, last.output_ids, last.weight_version) == (2, (13,), "v1")
    assert last.final.output_ids == (11, 12, 13) and last.final.weight_version == "v1" and last.final.worker == W1.id
    # Without a chunk version (stock workers) a chunk reports none; a non-string one is a breach.
    plain = w.stream_parser(req, HttpResponse(200, b"", {}), worker=None).event(_completion_chunk([11], [-0.5]), 0.1)
    assert plain is not None and plain.weight_version is None and plain.final is None
    bad = w.stream_parser(req, HttpResponse(200, b"", {}), worker=None)
    with pytest.raises(ContractViolation, match="chunk_weight_version"):
        bad.event(_completion_chunk([11], [-0.5], chunk_weight_version=3), 0.1)
    # A refusal (engine_data.refused, no finish reason on the native shape) still ends the stream.
    refused = w.stream_parser(req, HttpResponse(200, b"", {}), worker=None)
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        refused.event(
            _completion_chunk([], [], refused={"param": "sampling_params.max_new_tokens", "message": "too big"}), 0.1
        )
