"""Control operations as values: what a fleet asks one worker to do.

A closed set of frozen values, one class per operation, each carrying exactly its arguments with
their types. Adapters dispatch on them with ``match`` (``Wire.control``, in-process drivers), so a
new operation is a type error in every adapter that does not handle it, not a ``KeyError`` at run
time; before these values, arguments travelled as ``**args: Any`` read by string key.

``Command`` values change a worker and answer nothing (success, or an error); ``GetVersion``
answers the version a worker serves; ``Probe`` values (``Live``, ``Ready``, ``Progress``) answer a
bool. Each has a ``name``: the protocol method it serves, which error messages carry
(``ControlFailed.operation``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NoReturn, TypeAlias

import attrs

from rollout_backends._errors import InvalidRequest
from rollout_backends._tensors import FlatBucket
from rollout_backends._types import MemoryTag, PauseMode, WeightBucket, WeightGroup

__all__ = [
    "AbortAll",
    "AbortRequest",
    "BeginWeightUpdate",
    "Command",
    "DestroyWeightGroup",
    "EndWeightUpdate",
    "FlushCache",
    "GetVersion",
    "InitWeightGroup",
    "Live",
    "NamedTensors",
    "Operation",
    "Pause",
    "Probe",
    "Progress",
    "Ready",
    "ReleaseMemory",
    "Resume",
    "ResumeMemory",
    "SetVersion",
    "UpdateFromDisk",
    "UpdateFromDistributed",
    "UpdateFromTensors",
    "busy_wait_s",
    "unhandled",
]


@attrs.define(slots=True, eq=False)
class NamedTensors:
    """``(name, tensor)`` pairs for an in-memory load; ``payload`` makes their wire form.

    Not a value type (it holds tensors). Made from a ``FlatBucket`` (``flat``), the payload is
    SGLang's ``flattened_bucket`` (one handle for the bucket) and ``items`` are views into its
    buffer (what an in-process engine loads).
    """

    items: tuple[tuple[str, Any], ...]
    flat: FlatBucket | None = None

    @classmethod
    def of(cls, named_tensors: Sequence[tuple[str, Any]] | FlatBucket) -> NamedTensors:
        """The pairs, checked for shape only (``InvalidRequest`` naming a bad one): what a tensor
        is, is the engine's to say (``payload`` for SGLang; an in-process engine its own)."""
        if isinstance(named_tensors, FlatBucket):
            return cls(tuple(named_tensors.views()), named_tensors)
        kind = type(named_tensors).__name__
        if isinstance(named_tensors, (str, bytes, Mapping)):
            raise InvalidRequest("named_tensors", f"must be a list of (name, tensor) pairs, got {kind}")
        try:
            items = tuple(named_tensors)
        except TypeError:
            raise InvalidRequest("named_tensors", f"must be a list of (name, tensor) pairs, got {kind}") from None
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise InvalidRequest(f"named_tensors[{i}]", "must be a (name, tensor) pair")
        return cls(items)

    def payload(self) -> str:
        """One receiving process's ``serialized_named_tensors`` entry (``InvalidRequest`` naming a
        bad pair).

        Made anew for each receiver: every dump takes one reference on each shared storage for the
        process that will open it (torch's reductions: ``_shared_incref`` for CPU shared memory, a
        CUDA-IPC reference count), which that process gives back. One payload opened by two
        workers gave back two and unlinked the CPU segment under the sender (the second push then
        failed: "unable to open shared memory object"); SGLang serializes once per TP rank too
        (``sglang/srt/weight_sync/utils.py``).
        """
        from rollout_backends._tensors import serialize_flat_bucket, serialize_named_tensors

        if self.flat is not None:
            return serialize_flat_bucket(self.flat)
        return serialize_named_tensors(self.items)


@attrs.frozen(slots=True)
class AbortRequest:
    """Abort one in-flight request by id (unknown ids are ignored)."""

    name: ClassVar[str] = "abort"
    request_id: str


@attrs.frozen(slots=True)
class AbortAll:
    name: ClassVar[str] = "abort_all"


@attrs.frozen(slots=True)
class Pause:
    name: ClassVar[str] = "pause"
    mode: PauseMode


@attrs.frozen(slots=True)
class Resume:
    name: ClassVar[str] = "resume"


#: Seconds a flush waits for the engine to go idle before it is refused. A request that has
#: just answered can still sit in SGLang's running batch for a scheduler step, and an immediate
#: flush is then refused (seen through Dynamo in the 2026-12-02 H200 tier, once the shim
#: stopped hiding refusals); SGLang 0.5.16 defers a flush with ``timeout_s`` until idle.
FLUSH_WAIT_S = 3.0


@attrs.frozen(slots=True)
class FlushCache:
    """Clear the prefix cache once the engine is idle, waiting at most ``wait_s`` for it."""

    name: ClassVar[str] = "flush_cache"
    wait_s: float = FLUSH_WAIT_S


@attrs.frozen(slots=True)
class InitWeightGroup:
    """Join ``group`` at global rank ``rank_offset`` (the fleet assigns each worker its offset)."""

    name: ClassVar[str] = "init_weight_group"
    group: WeightGroup
    rank_offset: int


@attrs.frozen(slots=True)
class DestroyWeightGroup:
    name: ClassVar[str] = "destroy_weight_group"
    group_name: str


@attrs.frozen(slots=True, kw_only=True)
class UpdateFromDistributed:
    name: ClassVar[str] = "update_weights_from_distributed"
    bucket: WeightBucket
    group_name: str
    version: str | None
    flush_cache: bool


@attrs.frozen(slots=True, kw_only=True)
class UpdateFromTensors:
    name: ClassVar[str] = "update_weights_from_tensors"
    tensors: NamedTensors
    version: str | None
    flush_cache: bool
    load_format: str | None


@attrs.frozen(slots=True, kw_only=True)
class UpdateFromDisk:
    name: ClassVar[str] = "update_weights_from_disk"
    path: str
    version: str | None
    load_format: str | None
    flush_cache: bool


@attrs.frozen(slots=True)
class BeginWeightUpdate:
    name: ClassVar[str] = "begin_weight_update"
    selector: str


@attrs.frozen(slots=True)
class EndWeightUpdate:
    name: ClassVar[str] = "end_weight_update"


@attrs.frozen(slots=True)
class SetVersion:
    """Label the weights served from now on (never aborts in-flight requests)."""

    name: ClassVar[str] = "set_weight_version"
    version: str


@attrs.frozen(slots=True)
class ReleaseMemory:
    """Free GPU memory; ``tags=None`` = all."""

    name: ClassVar[str] = "release_memory"
    tags: tuple[MemoryTag, ...] | None


@attrs.frozen(slots=True)
class ResumeMemory:
    name: ClassVar[str] = "resume_memory"
    tags: tuple[MemoryTag, ...] | None


@attrs.frozen(slots=True)
class GetVersion:
    """Read the version a worker serves (where engines report it)."""

    name: ClassVar[str] = "weight_version"


@attrs.frozen(slots=True)
class Live:
    """Whether the worker's process answers."""

    name: ClassVar[str] = "live"


@attrs.frozen(slots=True)
class Ready:
    """Whether the worker takes generation (``None`` from a wire's builder: ready when live)."""

    name: ClassVar[str] = "ready"


@attrs.frozen(slots=True)
class Progress:
    """Whether a 1-token generation on the worker completes."""

    name: ClassVar[str] = "probe"


Command: TypeAlias = (
    AbortRequest
    | AbortAll
    | Pause
    | Resume
    | FlushCache
    | InitWeightGroup
    | DestroyWeightGroup
    | UpdateFromDistributed
    | UpdateFromTensors
    | UpdateFromDisk
    | BeginWeightUpdate
    | EndWeightUpdate
    | SetVersion
    | ReleaseMemory
    | ResumeMemory
)
Probe: TypeAlias = Live | Ready | Progress
Operation: TypeAlias = Command | GetVersion | Probe


def busy_wait_s(op: Command) -> float:
    """How long a driver sends ``op`` again while its engine refuses it as busy (a wire's
    ``parse_control`` raised ``Overloaded``: the engine did nothing). Only a flush waits: its
    ``wait_s``, the time SGLang itself defers a flush given ``timeout_s``; every other command
    fails at its first refusal."""
    return op.wait_s if isinstance(op, FlushCache) else 0.0


def unhandled(op: NoReturn) -> NoReturn:
    """The end of a ``match`` over operations: mypy proves it unreachable (every case handled);
    at run time it names a value that is not an operation at all."""
    raise TypeError(f"not an operation: {op!r}")
