"""The engine routes of ``dynamo.vllm`` workers (ai-dynamo 1.4.2) as calls: the control half of the
Dynamo wire for the ``vllm`` flavor.

Read from the ai-dynamo 1.4.2 wheel: ``dynamo/vllm/worker_factory.py`` (``register_engine_routes``:
every route is ``POST <system port>/engine/<route>``, registered whether or not ``--enable-rl`` is
given) and ``dynamo/vllm/handlers.py`` (``BaseWorkerHandler``: each route's body, and its answer
``{"status": "ok" | "error", "message"}``). The weight routes drive vLLM through
``engine_client.collective_rpc(engine_rpc, kwargs=<the body's other keys>)``, so one route
(``update_weights_from_distributed``) serves every step of vLLM 0.26's transfer session, and each
refuses unless the worker was paused through ``pause_generation``. Which protocol call maps onto
which route, and what is not declared, is ``docs/vllm.md``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from rollout_backends import InvalidRequest, MemoryTag, PauseMode
from rollout_backends.kit import (
    AbortAll,
    AbortRequest,
    BeginWeightUpdate,
    Command,
    DestroyWeightGroup,
    EndWeightUpdate,
    FlushCache,
    HttpRequest,
    InitWeightGroup,
    Pause,
    ReleaseMemory,
    Resume,
    ResumeMemory,
    SetVersion,
    UpdateFromDisk,
    UpdateFromDistributed,
    UpdateFromTensors,
    Worker,
    unhandled,
)

from ..vllm import ipc_update_info

__all__ = ["CONTEXT_ID_HEADER", "PAUSE_BODIES", "VLLM_PAUSE_MODES", "context_id", "vllm_control"]

#: The header the 1.4.2 frontend takes a request's id from (a UUID form only; it becomes the
#: worker's ``context.id()``, the id ``dynamo.vllm`` gives vLLM, which ``abort_request`` takes).
CONTEXT_ID_HEADER = "x-dynamo-request-id"
_ID_NAMESPACE = uuid.UUID("5f0c7a42-2d7e-4a31-9f8e-6b5a1c3e8d20")

#: ``pause_generation`` bodies (vLLM's modes, as on a vLLM server: ``adapters/vllm/_wire.py``
#: ``PAUSE_QUERY``). ``IN_PLACE`` is not declared behind dynamo.vllm 1.4.2: its ``flush_cache``
#: route ignores what ``reset_prefix_cache`` answers, so a flush refused while frozen requests hold
#: their KV reads as done.
PAUSE_BODIES: Mapping[PauseMode, Mapping[str, Any]] = {
    PauseMode.ABORT: {"mode": "abort", "clear_cache": False},
    PauseMode.RETRACT: {"mode": "keep", "clear_cache": True},
    PauseMode.IN_PLACE: {"mode": "keep", "clear_cache": False},
}
#: The modes declared behind dynamo.vllm 1.4.2 (see ``PAUSE_BODIES``).
VLLM_PAUSE_MODES = frozenset({PauseMode.ABORT, PauseMode.RETRACT})
_WAKE_TAGS: Mapping[MemoryTag, str] = {MemoryTag.WEIGHTS: "weights", MemoryTag.KV_CACHE: "kv_cache"}


def context_id(request_id: str) -> str:
    """The UUID our request id travels as (``CONTEXT_ID_HEADER``): the same for the same id."""
    return str(uuid.uuid5(_ID_NAMESPACE, request_id))


def _engine(worker: Worker, route: str, body: Mapping[str, Any] | None = None) -> HttpRequest:
    return HttpRequest("POST", f"{worker.control_url}/engine/{route}", json=dict(body or {}))


def _rpc(worker: Worker, engine_rpc: str, flush: bool = False, **kwargs: Any) -> HttpRequest:
    """One ``collective_rpc`` through ``update_weights_from_distributed`` (the worker paused)."""
    body = {"engine_rpc": engine_rpc, "reset_prefix_cache": flush, **kwargs}
    return _engine(worker, "update_weights_from_distributed", body)


def _session(worker: Worker, update_info: Mapping[str, Any], flush: bool) -> tuple[HttpRequest, ...]:
    """vLLM's transfer session (start, update, finish), the prefix cache reset after the last step."""
    return (
        _rpc(worker, "start_weight_update"),
        _rpc(worker, "update_weights", update_info=dict(update_info)),
        _rpc(worker, "finish_weight_update", flush),
    )


def vllm_control(op: Command, worker: Worker) -> HttpRequest | tuple[HttpRequest, ...] | None:
    """The calls for one command on one ``dynamo.vllm`` worker."""
    match op:
        case AbortRequest(request_id=rid):
            return _engine(worker, "abort_request", {"request_id": context_id(rid)})
        case AbortAll():
            # No route aborts everything: pause(abort) then resume (it resumes a paused worker too).
            return _engine(worker, "pause_generation", PAUSE_BODIES[PauseMode.ABORT]), _engine(
                worker, "resume_generation"
            )
        case Pause(mode=mode):
            return _engine(worker, "pause_generation", PAUSE_BODIES[mode])
        case Resume():
            return _engine(worker, "resume_generation")
        case FlushCache():
            return _engine(worker, "flush_cache")
        case UpdateFromDisk(path=path, load_format=load_format):
            if load_format is not None:
                raise InvalidRequest("load_format", "dynamo.vllm reloads in the engine's own --load-format")
            # engine_rpc reload_weights(weights_path=); the route resets the prefix cache itself.
            return _engine(worker, "update_weights_from_disk", {"model_path": path})
        case InitWeightGroup(group=g, rank_offset=rank_offset):
            if g.backend != "nccl":
                raise InvalidRequest("group.backend", "vLLM's weight transfer group is NCCL only")
            info = {"master_address": g.master_address, "master_port": g.master_port,
                    "rank_offset": rank_offset, "world_size": g.world_size}  # fmt: skip
            return _engine(
                worker, "init_weights_update_group", {"engine_rpc": "init_weight_transfer_engine", "init_info": info}
            )
        case UpdateFromDistributed(bucket=b, flush_cache=flush):
            return _session(
                worker, {"names": b.names, "dtype_names": b.dtypes, "shapes": b.shapes, "packed": False}, flush
            )
        case UpdateFromTensors(tensors=tensors, load_format=load_format, flush_cache=flush):
            if load_format is not None:
                raise InvalidRequest("load_format", "vLLM's IPC weight transfer has no load formats")
            return _session(worker, ipc_update_info(tensors.items), flush)
        case ReleaseMemory(tags=tags):
            if tags is not None and not {MemoryTag.WEIGHTS, MemoryTag.KV_CACHE} <= set(tags):
                raise InvalidRequest("tags", "vLLM releases weights and KV cache together (sleep level 1)")
            return _engine(worker, "control/sleep", {"level": 1})
        case ResumeMemory(tags=tags):
            wake = set(_WAKE_TAGS) if tags is None else {t for t in tags if t in _WAKE_TAGS}
            if wake and wake != set(_WAKE_TAGS):
                # dynamo.vllm 1.4.2 ends the sleep at the first wake-up, partial or not: it resumes
                # generation, registers the worker again and answers every later wake-up "Engine
                # already awake" (dynamo/vllm/handlers.py wake_up, VllmEnginePauseController.resume
                # then mark_resumed), so the KV cache would stay asleep under a serving engine.
                raise InvalidRequest("tags", "dynamo.vllm resumes weights and KV cache together (tags=None)")
            return _engine(worker, "control/wake_up") if wake else None
        case SetVersion() | BeginWeightUpdate() | EndWeightUpdate() | DestroyWeightGroup():
            # Versions: the fleet stamps them (get_weight_version reports only labels given with a
            # load; 1.4.2 has no route to set one). No update sessions; no route drops the group.
            return None
    unhandled(op)
