"""The ``RolloutBackend`` protocol: what every backend (adapter) provides.

Control calls fan out to every worker of the fleet unless ``workers=`` names a subset (worker ids
as listed by ``workers``). A control call that fails on any worker raises ``ControlFailed`` naming
each failed worker; the workers where it succeeded are not rolled back (except inside
``weight_update``, which is a transaction).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, runtime_checkable

from rollout_backends._tensors import FlatBucket
from rollout_backends._token_stream import TokenStream
from rollout_backends._types import (
    Capabilities,
    GenerateRequest,
    Generation,
    HealthReport,
    MemoryTag,
    PauseMode,
    WeightBucket,
    WeightGroup,
)

__all__ = ["RolloutBackend", "WorkerSelection"]

#: ``None`` = every worker; otherwise the worker ids to act on.
WorkerSelection = Sequence[str] | None


@runtime_checkable
class RolloutBackend(Protocol):
    """An engine fleet that generates rollouts and takes new weights.

    Every method is a coroutine except ``capabilities`` and ``workers``. Errors are from
    ``rollout_backends._errors`` (re-exported at the top level).
    """

    @property
    def capabilities(self) -> Capabilities:
        """What this backend can do (static for the backend's lifetime)."""
        ...

    @property
    def workers(self) -> tuple[str, ...]:
        """The worker ids of the fleet, in a stable order."""
        ...

    # -- data plane -------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> Generation:
        """Generate for one request.

        Returns a ``Generation`` whose ``output_ids`` and ``logprobs`` have equal length, with the
        finish reason and the weight version the tokens were produced under. An aborted request
        is *returned* with ``FinishReason.ABORT`` and its partial tokens, not raised.

        Raises ``InvalidRequest`` (bad input: out-of-vocabulary id, prompt longer than the
        context, ...), ``TransientError`` (only if no token can have been produced),
        ``BackendUnavailable``, ``ContractViolation``.
        """
        ...

    def stream(self, request: GenerateRequest) -> TokenStream:
        """Generate for one request, its tokens delivered as they come (``Capabilities.streaming``).

        ``async with backend.stream(request) as chunks: async for chunk in chunks: ...``: each
        ``TokenChunk`` holds the new tokens only (indices contiguous from 0); the last one's
        ``final`` is the ``Generation`` ``generate`` would have returned (versions stamped the same
        way). Leaving the block early aborts the request on the engine; its id is free again when
        the block is left. Refused like ``generate`` (``InvalidRequest``, a request id already in
        flight included), and with ``Unsupported("streaming")`` where the capability is undeclared.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Abort one in-flight request on whichever worker holds it. Unknown ids are ignored."""
        ...

    async def abort_all(self, *, workers: WorkerSelection = None) -> None:
        """Abort every request the engines hold (one still on its way through a router when this is
        called is not among them). Raises ``ControlFailed`` naming unreachable workers."""
        ...

    # -- pause / resume -----------------------------------------------------------------------

    async def pause(self, mode: PauseMode = PauseMode.RETRACT, *, workers: WorkerSelection = None) -> None:
        """Stop generation (see ``docs/pause-modes.md``). New requests wait until ``resume``.

        Raises ``Unsupported`` for an undeclared mode, ``ControlFailed`` naming failed workers.
        """
        ...

    async def resume(self, *, workers: WorkerSelection = None) -> None:
        """Resume generation. Idempotent: resuming a running worker is not an error."""
        ...

    # -- weights ------------------------------------------------------------------------------

    async def init_weight_group(self, group: WeightGroup, *, workers: WorkerSelection = None) -> None:
        """Join each worker to a torch.distributed group with the trainer as rank 0.

        Each worker ``i`` (in ``workers`` order) joins at ``rank_offset + i * ranks_per_worker``.
        The trainer must call ``init_process_group`` concurrently (this call blocks until it does).
        """
        ...

    async def update_weights_from_distributed(
        self,
        bucket: WeightBucket,
        *,
        group_name: str = "weight_update_group",
        version: str | None = None,
        flush_cache: bool = True,
        workers: WorkerSelection = None,
    ) -> None:
        """Receive one bucket of tensors by broadcast from rank 0, in ``bucket`` order."""
        ...

    async def destroy_weight_group(
        self, group_name: str = "weight_update_group", *, workers: WorkerSelection = None
    ) -> None:
        """Leave and destroy the group. Idempotent."""
        ...

    async def update_weights_from_tensors(
        self,
        named_tensors: Sequence[tuple[str, Any]] | FlatBucket,
        *,
        version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
        workers: WorkerSelection = None,
    ) -> None:
        """Load in-memory tensors on the same host (CUDA IPC on GPU).

        A ``FlatBucket`` (``TensorBuckets.pack``) goes as one flat tensor
        (``load_format="flattened_bucket"``) where ``Capabilities.flattened_buckets`` is declared,
        else ``Unsupported``.
        """
        ...

    async def update_weights_from_disk(
        self,
        path: str,
        *,
        version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        workers: WorkerSelection = None,
    ) -> None:
        """Load a checkpoint directory. Outputs then equal a fresh engine started on ``path``.

        ``flush_cache=False`` is what ``weight_update`` passes (it flushed already, or must not).
        """
        ...

    async def begin_weight_update(self, selector: str = "all", *, workers: WorkerSelection = None) -> None:
        """Open an update session where the engine needs one (a no-op where it does not)."""
        ...

    async def end_weight_update(self, *, workers: WorkerSelection = None) -> None:
        """Close an update session (post-processing of loaded weights); no-op where not needed."""
        ...

    async def set_weight_version(self, version: str, *, workers: WorkerSelection = None) -> None:
        """Label the weights served from now on. Never aborts in-flight requests."""
        ...

    async def weight_versions(self) -> Mapping[str, str | None]:
        """The version each worker serves, by worker id."""
        ...

    async def weight_version(self) -> str | None:
        """The fleet's version. Raises ``StaleWeights`` (carrying the expected version) if workers
        disagree."""
        ...

    def expect_version(self, version: str | None) -> None:
        """Declare the version every worker should serve; ``health()`` reports others as stale.

        The expected version (``HealthReport.expected_version``) is the one declared last. This
        call declares it, and so does every operation that relabels the whole fleet:
        ``set_weight_version`` and a weight load with ``version=``, on all workers. So a committed
        ``weight_update`` declares its version, and one rolled back declares the version the
        fleet served before it. An operation on some workers only declares nothing.

        ``None`` withdraws the declaration; with none, the expected version is the one version
        the workers' labels (what each was last told to serve, or started on) agree on, else
        ``None``. A worker is stale only while it is live and serves another version than the
        expected one; with no expected version, none is.
        """
        ...

    async def flush_cache(self, *, workers: WorkerSelection = None) -> None:
        """Drop the prefix (KV) cache. Raises ``ControlFailed`` if a worker refuses (busy)."""
        ...

    def weight_update(
        self, version: str, *, mode: PauseMode = PauseMode.RETRACT, selector: str = "all"
    ) -> AbstractAsyncContextManager[Any]:
        """A weight-update transaction (see ``rollout_backends.weight_update``)."""
        ...

    # -- memory -------------------------------------------------------------------------------

    async def release_memory(
        self, tags: Sequence[MemoryTag | str] | None = None, *, workers: WorkerSelection = None
    ) -> None:
        """Free GPU memory (weights, KV cache, CUDA graphs; ``None`` = all). Pause first. Releasing
        what is already released is a no-op."""
        ...

    async def resume_memory(
        self, tags: Sequence[MemoryTag | str] | None = None, *, workers: WorkerSelection = None
    ) -> None:
        """Take back memory freed by ``release_memory`` (``None`` = all of it, also after a partial
        resume); resuming what is not released is a no-op."""
        ...

    # -- health and lifecycle -----------------------------------------------------------------

    async def health(self, *, probe: bool = False) -> HealthReport:
        """Per-worker live/ready/progress/stale. ``probe=True`` runs a 1-token generation per worker."""
        ...

    async def wait_ready(self, timeout: float = 60.0) -> HealthReport:
        """Wait until every worker is ready. Raises ``BackendUnavailable`` naming those that are not."""
        ...

    async def aclose(self) -> None:
        """Release client resources (and, for a launched fleet, stop its processes)."""
        ...
