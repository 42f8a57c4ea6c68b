"""A ``Fleet`` whose engines answer generations from a script, recording every fleet call.

The protocol is the one ``Fleet``'s (validation, selection, versions, health, the transaction);
``ScriptedDriver`` only answers, and ``ScriptedBackend`` records each fan-out as one
``(name, kwargs)`` call with the workers it reached, for tests of what the Miles facade asks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import rollout_backends as rb
from rollout_backends.kit import (
    AbortAll,
    AbortRequest,
    BeginWeightUpdate,
    Command,
    DestroyWeightGroup,
    EndWeightUpdate,
    Fleet,
    FlushCache,
    InitWeightGroup,
    Pause,
    Probe,
    ReleaseMemory,
    Resume,
    ResumeMemory,
    SetVersion,
    UpdateFromDisk,
    UpdateFromDistributed,
    UpdateFromTensors,
    unhandled,
)


class ScriptedDriver:
    """One scripted worker; the script, the failures and the versions are its fleet's."""

    def __init__(self, owner: ScriptedBackend, worker_id: str, capabilities: rb.Capabilities) -> None:
        self._owner = owner
        self._id = worker_id
        self._caps = capabilities

    @property
    def id(self) -> str:
        return self._id

    @property
    def capabilities(self) -> rb.Capabilities:
        return self._caps

    @property
    def aborts_by_id(self) -> bool:
        return True

    @property
    def ranks(self) -> int:
        return 1

    def _answer(self, request: rb.GenerateRequest, out: tuple[int, ...], finish: rb.FinishReason) -> rb.Generation:
        o = self._owner
        return rb.Generation(
            request_id=request.request_id,
            output_ids=out,
            logprobs=tuple(-0.1 * (i + 1) for i in range(len(out))) if request.return_logprobs else None,
            finish_reason=finish,
            weight_version=o.versions[request.worker or o.workers[0]],
            prompt_tokens=len(request.input_ids),
            worker=request.worker,
        )

    async def generate(self, request: rb.GenerateRequest) -> rb.Generation:
        o = self._owner
        o.requests.append(request)
        if o.failures:
            raise o.failures.pop(0)
        if o.hold is not None:
            while not o.hold.is_set() and request.request_id not in o.aborted:
                await asyncio.sleep(0.01)
            if request.request_id in o.aborted:
                return rb.Generation(
                    request_id=request.request_id,
                    output_ids=(7,),
                    logprobs=(-0.5,),
                    finish_reason=rb.FinishReason.ABORT,
                    weight_version=o.versions[request.worker or o.workers[0]],
                    prompt_tokens=len(request.input_ids),
                    worker=request.worker,
                )
        if o.script:
            return o.script.pop(0)
        n = request.sampling.max_new_tokens
        return self._answer(request, tuple(range(10, 10 + n)), rb.FinishReason.LENGTH)

    async def control(self, op: Command) -> None:
        o = self._owner
        match op:
            case AbortRequest():
                o.aborted.add(op.request_id)
            case AbortAll():
                o.aborted.update(r.request_id for r in o.requests if r.worker in (None, self._id))
            case UpdateFromDisk() if op.path == "/missing":
                raise rb.ControlFailed(op.name, [rb.WorkerFailure(self._id, "update", "no such dir")])
            case UpdateFromDisk() | UpdateFromTensors() | UpdateFromDistributed():
                if op.version is not None:
                    o.versions[self._id] = op.version
            case SetVersion():
                o.versions[self._id] = op.version
            case (
                Pause()
                | Resume()
                | FlushCache()
                | InitWeightGroup()
                | DestroyWeightGroup()
                | BeginWeightUpdate()
                | EndWeightUpdate()
                | ReleaseMemory()
                | ResumeMemory()
            ):
                return None
            case _:
                unhandled(op)

    async def probe(self, op: Probe) -> bool | None:
        return True  # live, ready (unless its fleet paused it) and making progress

    async def served_version(self) -> str | None:
        return self._owner.versions[self._id]

    async def aclose(self) -> None:
        return None


def _call(op: Command, workers: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """A fan-out as the call the tests read: a short name, the op's arguments, the workers."""
    w = {"workers": workers}
    match op:
        case AbortRequest():
            return "abort", {"request_id": op.request_id}
        case AbortAll():
            return "abort_all", w
        case Pause():
            return "pause", {"mode": op.mode, **w}
        case Resume():
            return "resume", w
        case FlushCache():
            return "flush_cache", w
        case InitWeightGroup():
            return "init_weight_group", {"group": op.group, **w}
        case DestroyWeightGroup():
            return "destroy_weight_group", {"group_name": op.group_name, **w}
        case UpdateFromDistributed():
            kw = {
                "bucket": op.bucket,
                "group_name": op.group_name,
                "version": op.version,
                "flush_cache": op.flush_cache,
            }
            return "update_distributed", {**kw, **w}
        case UpdateFromTensors():
            kw = {"named": list(op.tensors.items), "version": op.version, "flush_cache": op.flush_cache}
            return "update_tensors", {**kw, "load_format": op.load_format, **w}
        case UpdateFromDisk():
            kw = {"path": op.path, "version": op.version, "load_format": op.load_format, "flush_cache": op.flush_cache}
            return "update_disk", {**kw, **w}
        case BeginWeightUpdate():
            return "begin", {"selector": op.selector, **w}
        case EndWeightUpdate():
            return "end", w
        case SetVersion():
            return "set_version", {"version": op.version, **w}
        case ReleaseMemory():
            return "release_memory", {"tags": op.tags, **w}
        case ResumeMemory():
            return "resume_memory", {"tags": op.tags, **w}
        case _:
            unhandled(op)


class ScriptedBackend(Fleet):
    def __init__(self, workers: Sequence[str] = ("w0", "w1"), *, pinning: bool = True, top_logprobs: int = 0) -> None:
        caps = rb.Capabilities(
            top_logprobs=top_logprobs,
            pause_modes=set(rb.PauseMode),
            weight_transports=set(rb.WeightTransport),
            memory_release=True,
            begin_end_update=True,
            worker_pinning=pinning,
            routing=rb.RoutingKind.ROUND_ROBIN,
        )
        self.script: list[rb.Generation] = []
        self.failures: list[BaseException] = []
        self.requests: list[rb.GenerateRequest] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []
        #: What each worker serves (tests may set it directly).
        self.versions: dict[str, str | None] = dict.fromkeys(workers, "default")
        self.hold: asyncio.Event | None = None  # set: generations wait for it (or an abort)
        self.aborted: set[str] = set()
        super().__init__([ScriptedDriver(self, w, caps) for w in workers], capabilities=caps, name="scripted")
        self.set_installed_version("default")
        # Scripted failures reach the caller as they are: what Miles' own retries do is under test.
        self.worker_loss = rb.WorkerLossPolicy(action=rb.WorkerLoss.FAIL)

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    async def _fan_each(self, operation: str, ops: Mapping[str, Command]) -> None:
        await super()._fan_each(operation, ops)
        self.calls.append(_call(next(iter(ops.values())), tuple(ops)))
