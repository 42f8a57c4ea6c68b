"""The public surface is curated: changing it is a deliberate act (this test pins it)."""

from __future__ import annotations

import json

import rollout_backends as rb
import rollout_backends.kit as kit
import rollout_backends.launch as launch
import rollout_backends.sglang_native as sglang_native
import rollout_backends.testing as testing

EXPECTED_TOP = {
    "Aborted", "BackendClosed", "BackendTimeout", "BackendUnavailable", "Capabilities", "ConnectionFailed",
    "Completions", "ContractViolation", "ControlFailed", "FinishReason", "FlatBucket", "GenerateRequest", "Generation",
    "HealthReport", "InvalidRequest", "MemoryTag", "NoCompatibleVersion", "Overloaded", "PauseMode", "RolloutBackend",
    "RolloutBackendError", "RoutingKind", "SamplingParams", "StaleWeights", "TensorBuckets", "TensorSpec",
    "TokenChunk", "TokenStream", "TransientError", "Unsupported", "VersionSource", "WeightBucket", "WeightGroup",
    "WeightTransport", "WeightUpdateFailed", "WeightUpdateTransaction", "WorkerFailure",
    "WorkerHealth", "WorkerLoss", "WorkerLossPolicy", "__version__", "as_completed", "available_schemes",
    "generate_group",
    "generate_group_as_completed", "group_requests", "open_backend",
    "register_scheme", "wait_ready", "weight_update",
}  # fmt: skip

EXPECTED_KIT = {
    "AiohttpTransport", "BackendBase", "Driver", "Entry", "Fleet", "HttpClient", "HttpDriver", "HttpEntry",
    "HttpFleetBackend", "HttpLink", "HttpRequest", "RoundRobin",
    "HttpResponse", "MockTransport", "RetryPolicy", "SseDecoder",
    "StreamParser", "Transport", "VersionBook", "Wire", "Worker",
    "AbortAll", "AbortRequest", "BeginWeightUpdate", "Command", "DestroyWeightGroup", "EndWeightUpdate",
    "FLUSH_WAIT_S", "FlushCache", "GetVersion", "InitWeightGroup", "Live", "NamedTensors", "Operation", "Pause",
    "Probe",
    "Progress", "Ready", "ReleaseMemory", "Resume", "ResumeMemory", "SetVersion", "UpdateFromDisk",
    "UpdateFromDistributed", "UpdateFromTensors", "sse_json", "unhandled",
    "FLATTENED_BUCKET", "decode_tensor_payload", "deserialize_named_tensors", "ensure_tags", "fan_out", "get_json",
    "json_loads",
    "normalise_url", "serialize_flat_bucket", "serialize_named_tensors", "worker_id_of",
}  # fmt: skip

EXPECTED_LAUNCH = {
    "ConnectableEngine", "EngineCommand", "EngineInfo", "EntryCommand", "HelpFormatter", "Launch", "Local",
    "LocalEngines", "ManagedProcess", "NodeContext", "PlacedEngines", "Placement", "ProcessSpec",
    "ProcessState", "ReadyCheck", "ReadyProgress", "RunningFleet", "Supervisor", "carry",
    "env_map", "free_port", "group_members", "launch_fleet", "one_line_error", "pick_port",
    "port_in_use", "redact_argv", "require_model_dir", "require_module", "run_launcher_cli", "split_passthrough",
    "stderr_progress", "str_tuple",
}  # fmt: skip

EXPECTED_SGLANG_NATIVE = {
    "disk_body", "distributed_body", "init_group_body", "memory_body", "set_version_body", "tensors_body",
    "parse_abort_body", "parse_destroy_group_body", "parse_disk_body", "parse_distributed_body",
    "parse_init_group_body", "parse_memory_body", "parse_pause_body", "parse_set_version_body", "parse_stream_event",
    "parse_tensors_body", "TensorsBody",
    "ABORT_MESSAGE", "ADMIN_ROUTES", "ROUTING_KEY_HEADER", "SAMPLING_PARAM_KEYS", "NativeRequest",
    "ParseRules", "TextOptions", "UnknownKeys", "answer_body", "check_depth", "decode_text", "error_body",
    "error_field", "error_message", "finish_reason_body", "meta_info", "named_field", "native_field",
    "our_field", "parse_answer", "parse_request", "parse_sampling", "request_body",
    "sampling_params_body", "StopStrings", "trim_at_stop", "BATCH_LIST_KEYS", "batch_field", "split_batch",
}  # fmt: skip

EXPECTED_TESTING = {
    "EOS", "FAKE_CAPABILITIES", "MAX_CONTEXT", "VOCAB_SIZE", "FakeDriver", "FakeFleet", "fake_factory",
    "fake_fleet", "load_checkpoint", "permute_checkpoint", "read_checkpoint", "write_checkpoint",
}  # fmt: skip

DOORS = (rb, kit, launch, sglang_native, testing)
#: Exported as another library's own function: orjson's C ``loads`` where installed (no Python
#: frame per call; the stdlib fallback is ours).
FOREIGN = {("rollout_backends.kit", "json_loads")}
#: Type aliases: unions of our operation classes (a union's ``__module__`` is ``typing``).
FOREIGN |= {("rollout_backends.kit", name) for name in ("Command", "Operation", "Probe")}
#: Plain numbers (an int's ``__module__`` is ``builtins``).
FOREIGN |= {("rollout_backends.testing", name) for name in ("EOS", "MAX_CONTEXT", "VOCAB_SIZE")}


def test_top_level_all_is_pinned() -> None:
    assert set(rb.__all__) == EXPECTED_TOP
    assert len(rb.__all__) == len(set(rb.__all__))


def test_every_exported_name_exists() -> None:
    for door in DOORS:
        for name in door.__all__:
            assert hasattr(door, name), (door.__name__, name)


def test_kit_all_is_pinned() -> None:
    assert set(kit.__all__) == EXPECTED_KIT
    assert len(kit.__all__) == len(set(kit.__all__))


def test_launch_all_is_pinned() -> None:
    assert set(launch.__all__) == EXPECTED_LAUNCH
    assert len(launch.__all__) == len(set(launch.__all__))


def test_testing_all_is_pinned() -> None:
    assert set(testing.__all__) == EXPECTED_TESTING
    assert len(testing.__all__) == len(set(testing.__all__))


def test_sglang_native_all_is_pinned() -> None:
    assert set(sglang_native.__all__) == EXPECTED_SGLANG_NATIVE
    assert len(sglang_native.__all__) == len(set(sglang_native.__all__))


def test_exported_objects_are_public_names() -> None:
    # Nothing private leaks out as a public name's __module__ other than our own private modules.
    for door in DOORS:
        for name in door.__all__:
            obj = getattr(door, name)
            mod = getattr(obj, "__module__", "rollout_backends")
            assert mod.startswith("rollout_backends") or (door.__name__, name) in FOREIGN, (door.__name__, name, mod)


def test_error_tree() -> None:
    for cls in (
        rb.TransientError, rb.BackendUnavailable, rb.InvalidRequest, rb.Aborted, rb.ControlFailed,
        rb.StaleWeights, rb.ContractViolation, rb.Unsupported,
    ):  # fmt: skip
        assert issubclass(cls, rb.RolloutBackendError)
    for cls in (rb.BackendTimeout, rb.ConnectionFailed, rb.Overloaded):
        assert issubclass(cls, rb.TransientError) and cls.retryable
    assert issubclass(rb.WeightUpdateFailed, rb.ControlFailed)
    assert not rb.InvalidRequest("x", "y").retryable


async def test_a_router_less_http_fleet_from_public_names() -> None:
    # Several workers, no router: one HttpDriver per worker over one HttpLink, round robin between
    # them, the client closed with the fleet (the recipe in rollout_backends.kit's docstring).
    from rollout_backends.adapters.sglang import SGLangWire

    sent: list[str] = []

    def answer(request: kit.HttpRequest) -> kit.HttpResponse:
        sent.append(request.url.split("/")[2])
        body = {"output_ids": [7], "meta_info": {"id": "r", "finish_reason": {"type": "length"}, "prompt_tokens": 1,
                "weight_version": "v0", "output_token_logprobs": [[-0.5, 7, None]]}}  # fmt: skip
        return kit.HttpResponse(200, json.dumps(body).encode())

    wire = SGLangWire(entry_url="http://unused:1")
    link = kit.HttpLink(wire, kit.HttpClient(kit.MockTransport(answer)))
    workers = [kit.Worker(id=f"w{i}", control_url=f"http://w{i}:1") for i in range(2)]
    drivers = [kit.HttpDriver(link, w, wire.capabilities()) for w in workers]
    closed: list[bool] = []

    async def close() -> None:
        await link.client.aclose()
        closed.append(True)

    fleet = kit.Fleet(drivers, entry=kit.RoundRobin(drivers), capabilities=wire.capabilities(), on_close=close)
    assert isinstance(fleet, rb.RolloutBackend)
    async with fleet:
        gens = [await fleet.generate(rb.GenerateRequest(input_ids=[1], request_id=f"r{i}")) for i in range(4)]
    assert sent == ["w0:1", "w1:1", "w0:1", "w1:1"]  # spread over the workers, none through a router
    assert [g.worker for g in gens] == ["w0", "w1", "w0", "w1"] and closed == [True]


def test_fleet_backend_satisfies_the_protocol() -> None:
    from rollout_backends.adapters.sglang import SGLangWire

    backend = kit.HttpFleetBackend(
        SGLangWire(entry_url="http://127.0.0.1:1"),
        [kit.Worker(id="w0", control_url="http://127.0.0.1:1")],
        client=kit.HttpClient(kit.MockTransport(lambda r: kit.HttpResponse(200, b""))),
    )
    assert isinstance(backend, rb.RolloutBackend)
    for m in (m for m in dir(rb.RolloutBackend) if not m.startswith("_")):
        assert hasattr(backend, m), m
