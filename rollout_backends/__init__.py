"""rollout-backends: one protocol for RL rollouts and weight updates over SGLang and Dynamo.

    import rollout_backends as rb

    async with await rb.open_backend("sglang://127.0.0.1:30000") as backend:
        gen = await backend.generate(rb.GenerateRequest(input_ids=[1, 2, 3]))
        async with backend.weight_update("step-1") as tx:
            await tx.update_from_disk("/ckpt/step-1")

    buckets = rb.TensorBuckets(dtype=torch.bfloat16)   # flat buffers, reused every step
    async with backend.weight_update("step-2") as tx:  # colocated: CUDA IPC, one handle a bucket
        await tx.update_from_tensors(model.named_parameters(), buckets=buckets)

Adapter authors: see ``rollout_backends.kit``; starting engines and routers: ``rollout_backends.launch``.
Errors: the ``RolloutBackendError`` tree below (``docs/errors.md``).
"""

from rollout_backends._errors import (
    Aborted,
    BackendClosed,
    BackendTimeout,
    BackendUnavailable,
    ConnectionFailed,
    ContractViolation,
    ControlFailed,
    InvalidRequest,
    NoCompatibleVersion,
    Overloaded,
    RolloutBackendError,
    StaleWeights,
    TransientError,
    Unsupported,
    WeightUpdateFailed,
    WorkerFailure,
)
from rollout_backends._protocol import RolloutBackend
from rollout_backends._registry import available_schemes, open_backend, register_scheme
from rollout_backends._streams import Completions, as_completed, generate_group_as_completed
from rollout_backends._tensors import FlatBucket, TensorBuckets
from rollout_backends._token_stream import TokenStream
from rollout_backends._transaction import (
    WeightUpdateTransaction,
    generate_group,
    group_requests,
    wait_ready,
    weight_update,
)
from rollout_backends._types import (
    Capabilities,
    FinishReason,
    GenerateRequest,
    Generation,
    HealthReport,
    MemoryTag,
    PauseMode,
    RoutingKind,
    SamplingParams,
    TensorSpec,
    TokenChunk,
    VersionSource,
    WeightBucket,
    WeightGroup,
    WeightTransport,
    WorkerHealth,
)
from rollout_backends._worker_loss import WorkerLoss, WorkerLossPolicy

__version__ = "0.1.0"

__all__ = [
    "WorkerLoss",
    "WorkerLossPolicy",
    "Aborted",
    "BackendTimeout",
    "BackendUnavailable",
    "Capabilities",
    "ConnectionFailed",
    "Completions",
    "ContractViolation",
    "ControlFailed",
    "FinishReason",
    "FlatBucket",
    "GenerateRequest",
    "Generation",
    "HealthReport",
    "InvalidRequest",
    "MemoryTag",
    "NoCompatibleVersion",
    "Overloaded",
    "PauseMode",
    "RolloutBackend",
    "RolloutBackendError",
    "RoutingKind",
    "SamplingParams",
    "StaleWeights",
    "TensorBuckets",
    "TensorSpec",
    "TokenChunk",
    "TokenStream",
    "TransientError",
    "BackendClosed",
    "Unsupported",
    "VersionSource",
    "WeightBucket",
    "WeightGroup",
    "WeightTransport",
    "WeightUpdateFailed",
    "WeightUpdateTransaction",
    "WorkerFailure",
    "WorkerHealth",
    "__version__",
    "as_completed",
    "available_schemes",
    "generate_group",
    "generate_group_as_completed",
    "group_requests",
    "open_backend",
    "register_scheme",
    "wait_ready",
    "weight_update",
]
