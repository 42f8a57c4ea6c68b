"""The public surface is curated: changing it is a deliberate act (this test pins it)."""

from __future__ import annotations

import rollout_backends as rb
import rollout_backends.kit as kit

EXPECTED_TOP = {
    "Aborted", "BackendTimeout", "BackendUnavailable", "Capabilities", "ConnectionFailed",
    "ContractViolation", "ControlFailed", "FinishReason", "GenerateRequest", "Generation",
    "HealthReport", "InvalidRequest", "MemoryTag", "Overloaded", "PauseMode", "RolloutBackend",
    "RolloutBackendError", "RoutingKind", "SamplingParams", "StaleWeights", "TensorSpec",
    "TransientError", "Unsupported", "VersionSource", "WeightBucket", "WeightGroup",
    "WeightTransport", "WeightUpdateFailed", "WeightUpdateTransaction", "WorkerFailure",
    "WorkerHealth", "__version__", "available_schemes", "generate_group", "open_backend",
    "register_scheme", "wait_ready", "weight_update",
}  # fmt: skip

EXPECTED_KIT = {
    "AiohttpTransport", "BackendBase", "HttpClient", "HttpFleetBackend", "HttpRequest",
    "HttpResponse", "MockTransport", "Op", "RetryPolicy", "Transport", "Wire", "Worker",
    "deserialize_named_tensors", "fan_out", "serialize_named_tensors",
}  # fmt: skip


def test_top_level_all_is_pinned() -> None:
    assert set(rb.__all__) == EXPECTED_TOP
    assert len(rb.__all__) == len(set(rb.__all__))


def test_every_exported_name_exists() -> None:
    for name in rb.__all__:
        assert hasattr(rb, name), name
    for name in kit.__all__:
        assert hasattr(kit, name), name


def test_kit_all_is_pinned() -> None:
    assert set(kit.__all__) == EXPECTED_KIT


def test_exported_objects_are_public_names() -> None:
    # Nothing private leaks out as a public name's __module__ other than our own private modules.
    for name in rb.__all__:
        obj = getattr(rb, name)
        mod = getattr(obj, "__module__", "rollout_backends")
        assert mod.startswith("rollout_backends"), (name, mod)


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
