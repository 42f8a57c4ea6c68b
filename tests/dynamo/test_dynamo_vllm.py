"""``dynamo.vllm`` workers behind Dynamo (the ``vllm`` flavor and worker kind), without a GPU: the
engine-route calls the wire builds (ai-dynamo 1.4.2's ``dynamo/vllm/handlers.py`` bodies), flavor
detection, the worker's command line, and the mocker simulating vLLM's scheduler (real processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import rollout_backends as rb
from rollout_backends import GenerateRequest, MemoryTag, PauseMode, SamplingParams, TensorSpec, WeightBucket
from rollout_backends.adapters.dynamo import (
    DynamoFleet,
    DynamoWire,
    DynamoWorkerCommand,
    RunningDynamoFleet,
    launch_dynamo_fleet,
)
from rollout_backends.adapters.dynamo._client import detect_flavor
from rollout_backends.adapters.dynamo._commands import vllm_logprobs_mode
from rollout_backends.adapters.dynamo._services import DynamoPlanes
from rollout_backends.adapters.dynamo._vllm_routes import CONTEXT_ID_HEADER, context_id
from rollout_backends.kit import (
    AbortAll,
    AbortRequest,
    HttpClient,
    HttpRequest,
    HttpResponse,
    MockTransport,
    Pause,
    ReleaseMemory,
    ResumeMemory,
    SetVersion,
    UpdateFromDisk,
    UpdateFromDistributed,
    Worker,
)
from rollout_backends.launch import NodeContext

from .conftest import HAS_DYNAMO

W = Worker(id="h:9", control_url="http://h:9", instance_id=7)


def wire(**kw: object) -> DynamoWire:
    # connect() stamps versions where the workers serve no rollout/weight_version (dynamo.vllm).
    kw.setdefault("version_source", rb.VersionSource.STAMPED)
    return DynamoWire(frontend_url="http://f:1", model="tiny", flavor="vllm", **kw)  # type: ignore[arg-type]


def bodies(calls: object) -> list[tuple[str, object]]:
    calls = calls if isinstance(calls, tuple) else (calls,)
    return [(c.url.removeprefix("http://h:9/engine/"), c.json) for c in calls]  # type: ignore[attr-defined]


def test_capabilities_declare_what_dynamo_vllm_serves() -> None:
    caps = wire().capabilities()
    # IN_PLACE is not declared: 1.4.2's flush_cache ignores what vLLM's reset_prefix_cache answers.
    assert caps.pause_modes == {PauseMode.ABORT, PauseMode.RETRACT}
    assert caps.weight_transports == {rb.WeightTransport.DISK}
    assert caps.version_source is rb.VersionSource.STAMPED and caps.update_while_parked and caps.memory_release
    assert wire(transfer_backend="nccl").capabilities().weight_transports == {
        rb.WeightTransport.DISK,
        rb.WeightTransport.DISTRIBUTED,
    }
    assert rb.WeightTransport.TENSOR in wire(transfer_backend="ipc").capabilities().weight_transports
    assert wire().aborts_by_id
    # 1.4.2's weight routes refuse a load unless pause_generation came first.
    assert (
        caps.load_needs_pause
        and not DynamoWire(frontend_url="http://f:1", model="tiny").capabilities().load_needs_pause
    )


def test_filtered_logprobs_follow_the_workers_logprobs_mode(tmp_path: Path) -> None:
    """Declared from the ``--logprobs-mode`` the launcher gives the workers (Dynamo does not show
    it): ``VllmServerCommand``'s ``processed_logprobs`` unless the extra vLLM args (last) say
    another; connected without it, vLLM's default (``raw_logprobs``: not declared)."""
    assert not wire().capabilities().filtered_logprobs
    assert wire(logprobs_mode="processed_logprobs").capabilities().filtered_logprobs
    assert not wire(logprobs_mode="raw_logprobs").capabilities().filtered_logprobs
    rollout = DynamoWire(frontend_url="http://f:1", model="tiny", flavor="rollout", logprobs_mode="processed_logprobs")
    assert not rollout.capabilities().filtered_logprobs  # not a vLLM worker
    assert vllm_logprobs_mode(()) == "processed_logprobs"
    assert vllm_logprobs_mode(("--logprobs-mode", "raw_logprobs", "--seed", "1")) == "raw_logprobs"
    assert vllm_logprobs_mode(("--logprobs-mode=raw_logits",)) == "raw_logits"

    def options(**kw: Any) -> dict[str, Any]:
        cfg = DynamoFleet(model_path="/m/tiny", worker_kind="vllm", **kw)
        fleet = RunningDynamoFleet(config=cfg, namespace="ns", frontend_url="http://f:1", worker_urls=(),
                                   rpc_ports={}, worker_names=(), supervisor=None, run_dir=tmp_path)  # type: ignore[arg-type]  # fmt: skip
        return fleet.connect_options()

    assert options()["logprobs_mode"] == "processed_logprobs"
    assert options(vllm_args=("--logprobs-mode", "raw_logprobs"))["logprobs_mode"] == "raw_logprobs"


async def test_an_unknown_logprobs_mode_is_refused_by_name() -> None:
    from rollout_backends.adapters.dynamo import open_from_url

    with pytest.raises(rb.InvalidRequest) as exc:
        await open_from_url("dynamo://fe:1?flavor=vllm&logprobs_mode=processed")
    assert exc.value.field == "logprobs_mode"


def test_engine_route_bodies() -> None:
    w = wire(transfer_backend="nccl")
    assert bodies(w.control(Pause(PauseMode.RETRACT), W)) == [
        ("pause_generation", {"mode": "keep", "clear_cache": True})
    ]
    assert bodies(w.control(Pause(PauseMode.ABORT), W)) == [
        ("pause_generation", {"mode": "abort", "clear_cache": False})
    ]
    assert bodies(w.control(AbortRequest("r1"), W)) == [("abort_request", {"request_id": context_id("r1")})]
    assert [p for p, _ in bodies(w.control(AbortAll(), W))] == ["pause_generation", "resume_generation"]
    disk = UpdateFromDisk(path="/ckpt", version="v1", load_format=None, flush_cache=False)
    assert bodies(w.control(disk, W)) == [("update_weights_from_disk", {"model_path": "/ckpt"})]
    bucket = WeightBucket((TensorSpec("a", "bfloat16", (2,)),))
    steps = bodies(w.control(UpdateFromDistributed(bucket=bucket, group_name="g", version=None, flush_cache=True), W))
    assert [b["engine_rpc"] for _, b in steps] == ["start_weight_update", "update_weights", "finish_weight_update"]  # type: ignore[index]
    assert {p for p, _ in steps} == {"update_weights_from_distributed"}
    assert steps[1][1]["update_info"]["names"] == ["a"]  # type: ignore[index]
    assert [b["reset_prefix_cache"] for _, b in steps] == [False, False, True]  # type: ignore[index]
    assert bodies(w.control(ReleaseMemory(None), W)) == [("control/sleep", {"level": 1})]
    both = (MemoryTag.WEIGHTS, MemoryTag.KV_CACHE)
    assert (
        bodies(w.control(ResumeMemory(None), W))
        == bodies(w.control(ResumeMemory(both), W))
        == [("control/wake_up", {})]
    )
    with pytest.raises(rb.InvalidRequest) as exc:  # the first wake-up ends dynamo.vllm's sleep: KV left asleep
        w.control(ResumeMemory((MemoryTag.WEIGHTS,)), W)
    assert exc.value.field == "tags"
    assert w.control(ResumeMemory((MemoryTag.CUDA_GRAPH,)), W) is None
    assert w.control(SetVersion("v2"), W) is None  # the fleet stamps versions


def test_the_request_id_travels_as_the_context_id() -> None:
    req = GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2), request_id="not-a-uuid")
    call = wire().generate(req, None)
    assert call.headers[CONTEXT_ID_HEADER] == context_id("not-a-uuid")
    assert context_id("not-a-uuid") == context_id("not-a-uuid") != context_id("other")
    sglang = DynamoWire(frontend_url="http://f:1", model="tiny", flavor="sglang14")
    assert CONTEXT_ID_HEADER not in sglang.generate(req, None).headers


async def test_flavor_detected_by_get_weight_version() -> None:
    def handler(req: HttpRequest) -> HttpResponse:
        if req.url.endswith("/engine/get_weight_version"):
            return HttpResponse.from_json({"status": "ok", "version": "initial"})
        return HttpResponse(404, b"Route not found")

    client = HttpClient(transport=MockTransport(handler))
    assert await detect_flavor(client, "http://h:9") == ("vllm", None)
    await client.aclose()


def test_worker_command_line(tmp_path: Path) -> None:
    planes = DynamoPlanes(discovery="file", file_kv=str(tmp_path))
    cmd = DynamoWorkerCommand(kind="vllm", model_path="/m/tiny", namespace="ns", planes=planes, transfer_backend="ipc")
    launch = cmd.build(NodeContext.on(0, "127.0.0.1", str(tmp_path), gpu_ids=("1",)))
    argv = list(launch.spec.argv)
    assert argv[1:3] == ["-m", "dynamo.vllm"]
    for flag in ("--enable-rl", "--enforce-eager", "--enable-sleep-mode", "--weight-transfer-config"):
        assert flag in argv, flag
    assert argv[argv.index("--model") + 1] == "/m/tiny" and argv[argv.index("--served-model-name") + 1] == "tiny"
    assert argv[argv.index("--endpoint") + 1] == "dyn://ns.backend.generate"
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    env = launch.spec.env
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert "VLLM_SERVER_DEV_MODE" not in env  # dynamo.vllm serves its own engine routes
    mocker = DynamoWorkerCommand(kind="mocker", model_path="/m/tiny", namespace="ns", planes=planes,
                                 mocker_engine_type="vllm")  # fmt: skip
    margv = list(mocker.build(NodeContext.on(1, "127.0.0.1", str(tmp_path))).spec.argv)
    assert margv[margv.index("--engine-type") + 1] == "vllm"
    with pytest.raises(rb.InvalidRequest) as exc:
        DynamoWorkerCommand(kind="mocker", model_path="/m", namespace="ns", planes=planes, mocker_engine_type="x")
    assert exc.value.field == "mocker_engine_type"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DYNAMO, reason="ai-dynamo is not installed")
async def test_mocker_simulating_vllm(tiny_model: Path, no_orphans: None) -> None:
    """``dynamo.mocker --engine-type vllm`` (1.4.2 and 1.6.1 have it; vllm is its default) behind the
    frontend: generation through the adapter, every answer naming its worker."""
    cfg = DynamoFleet(
        model_path=tiny_model, workers=2, worker_kind="mocker", mocker_engine_type="vllm", router_mode="kv"
    )
    async with launch_dynamo_fleet(cfg) as fleet:
        backend = await fleet.connect()
        sp = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
        gens = [await backend.generate(GenerateRequest(input_ids=[1, 2, 3 + i], sampling=sp)) for i in range(4)]
        assert all(len(g.output_ids) == 5 and g.worker in backend.workers for g in gens)
        pinned = await backend.generate(GenerateRequest(input_ids=[4, 5], sampling=sp, worker=backend.workers[1]))
        assert pinned.worker == backend.workers[1]
