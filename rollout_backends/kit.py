"""Building blocks for adapter authors (httpx-style transport seam included).

The protocol is implemented once, by ``Fleet``, over one ``Driver`` per worker. An HTTP adapter is
a ``Wire``: pure request builders and response parsers; ``HttpFleetBackend(wire, workers)`` is the
``Fleet`` of ``HttpDriver``s that send them (I/O, retries, timeouts through ``HttpClient``), with
unpinned generation through the entry point the wire names (a router). Several workers with no
router: ``HttpDriver(link, worker, caps)`` per worker over one ``HttpLink(wire, client)``, given to
``Fleet(drivers, entry=RoundRobin(drivers), on_close=link.client.aclose)``. An engine reached
another way is a ``Driver`` per worker given to ``Fleet``. Every member and every operation:
``docs/adapters.md``.

The protocol, its value types and the error tree are ``rollout_backends`` itself; starting
processes (supervisor, engine and entry commands) is ``rollout_backends.launch``; SGLang's native
protocol is ``rollout_backends.sglang_native``. An adapter imports the core through those doors only
(``tests/test_import_contract.py``).
"""

from rollout_backends._fleet import Driver, Entry, Fleet, RoundRobin, fan_out
from rollout_backends._http import (
    AiohttpTransport,
    HttpClient,
    HttpRequest,
    HttpResponse,
    MockTransport,
    RetryPolicy,
    SseDecoder,
    Transport,
    get_json,
    json_loads,
    normalise_url,
    sse_json,
    worker_id_of,
)
from rollout_backends._http_driver import (
    HttpDriver,
    HttpEntry,
    HttpFleetBackend,
    HttpLink,
    StreamParser,
    Wire,
    Worker,
)
from rollout_backends._ops import (
    FLUSH_WAIT_S,
    AbortAll,
    AbortRequest,
    BeginWeightUpdate,
    Command,
    DestroyWeightGroup,
    EndWeightUpdate,
    FlushCache,
    GetVersion,
    InitWeightGroup,
    Live,
    NamedTensors,
    Operation,
    Pause,
    Probe,
    Progress,
    Ready,
    ReleaseMemory,
    Resume,
    ResumeMemory,
    SetVersion,
    UpdateFromDisk,
    UpdateFromDistributed,
    UpdateFromTensors,
    unhandled,
)
from rollout_backends._tensors import (
    FLATTENED_BUCKET,
    decode_tensor_payload,
    deserialize_named_tensors,
    serialize_flat_bucket,
    serialize_named_tensors,
)
from rollout_backends._types import ensure_tags
from rollout_backends._versions import VersionBook

#: The name kept from before the one ``Fleet`` (issue 15): the class every backend now is.
BackendBase = Fleet

__all__ = [
    "HttpEntry",
    "HttpDriver",
    "RoundRobin",
    "Fleet",
    "Entry",
    "Driver",
    "AbortAll",
    "AbortRequest",
    "AiohttpTransport",
    "BackendBase",
    "BeginWeightUpdate",
    "Command",
    "DestroyWeightGroup",
    "EndWeightUpdate",
    "FLUSH_WAIT_S",
    "FlushCache",
    "GetVersion",
    "HttpClient",
    "HttpFleetBackend",
    "HttpLink",
    "HttpRequest",
    "HttpResponse",
    "InitWeightGroup",
    "Live",
    "MockTransport",
    "NamedTensors",
    "Operation",
    "Pause",
    "Probe",
    "Progress",
    "Ready",
    "ReleaseMemory",
    "Resume",
    "ResumeMemory",
    "RetryPolicy",
    "SetVersion",
    "Transport",
    "UpdateFromDisk",
    "UpdateFromDistributed",
    "UpdateFromTensors",
    "VersionBook",
    "SseDecoder",
    "StreamParser",
    "Wire",
    "Worker",
    "FLATTENED_BUCKET",
    "decode_tensor_payload",
    "deserialize_named_tensors",
    "ensure_tags",
    "fan_out",
    "get_json",
    "json_loads",
    "normalise_url",
    "serialize_flat_bucket",
    "serialize_named_tensors",
    "sse_json",
    "unhandled",
    "worker_id_of",
]
