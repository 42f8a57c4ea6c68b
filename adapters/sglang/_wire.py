"""SGLang's native HTTP API as a ``Wire``: request builders and response parsers only.

Endpoints and bodies follow SGLang 0.5.16 (and 0.5.23 where they differ: begin/end weight-update
sessions are sent only when the server lists them). Control calls go to each worker's own URL;
routers (smg, sglang-router) forward none of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from rollout_backends import (
    BackendUnavailable,
    Capabilities,
    ConnectionFailed,
    ContractViolation,
    ControlFailed,
    GenerateRequest,
    Generation,
    InvalidRequest,
    Overloaded,
    PauseMode,
    RolloutBackendError,
    RoutingKind,
    TokenChunk,
    VersionSource,
    WeightTransport,
    WorkerFailure,
)
from rollout_backends.kit import (
    AbortAll,
    AbortRequest,
    BeginWeightUpdate,
    Command,
    DestroyWeightGroup,
    EndWeightUpdate,
    FlushCache,
    GetVersion,
    HttpRequest,
    HttpResponse,
    InitWeightGroup,
    Live,
    Operation,
    Pause,
    Probe,
    Progress,
    Ready,
    ReleaseMemory,
    Resume,
    ResumeMemory,
    SetVersion,
    StreamParser,
    UpdateFromDisk,
    UpdateFromDistributed,
    UpdateFromTensors,
    Worker,
    sse_json,
    unhandled,
)
from rollout_backends.sglang_native import (
    ROUTING_KEY_HEADER,
    disk_body,
    distributed_body,
    error_field,
    error_message,
    init_group_body,
    memory_body,
    parse_answer,
    parse_stream_event,
    request_body,
    sampling_params_body,
    set_version_body,
    tensors_body,
)

__all__ = ["ROUTED_WORKER_HEADER", "ROUTING_KEY_HEADER", "SGLangWire", "sampling_params_body"]

#: The header smg 1.13 names the worker it routed a request to in (its URL; measured: the
#: answer to ``POST /generate`` through ``smg.launch_router`` carries ``x-smg-routed-worker-id:
#: http://127.0.0.1:57963``). Read case-insensitively (aiohttp's headers are).
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"

#: smg error codes that guarantee the request never reached an engine (smg 1.13: the connection to
#: the worker failed). ``call_upstream_request_error`` (the worker died mid-request) is not one.
_NOT_STARTED_CODES = frozenset({"call_upstream_connection_failed"})


def _json_or_none(resp: HttpResponse) -> Any:
    try:
        return resp.json()
    except ContractViolation:
        return None


def _error_code(resp: HttpResponse) -> str | None:
    """smg's ``{"error": {"code": ...}}``, if the body has one."""
    data = _json_or_none(resp)
    err = data.get("error") if isinstance(data, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


def _error_message(resp: HttpResponse) -> str:
    return error_message(_json_or_none(resp), resp.text)


def _generation_error(response: HttpResponse) -> RolloutBackendError:
    """The error for a ``/generate`` answer that is not HTTP 200 (off the hot path: one compare there)."""
    status = response.status
    if status == 400 or status == 422:
        data = _json_or_none(response)
        msg = error_message(data, response.text)
        return InvalidRequest(error_field(data, msg), msg)
    if status in (401, 403):
        return InvalidRequest("api_key", f"HTTP {status}: the server refused the API key (missing or wrong)")
    if status in (429, 503):
        return Overloaded(f"HTTP {status}: {_error_message(response)}")
    if status >= 500:
        code = _error_code(response)
        if code in _NOT_STARTED_CODES:
            # The router could not connect to any worker: no engine saw the request.
            return ConnectionFailed(
                f"router: HTTP {status} {code}: {_error_message(response)} (no token was generated)",
                nothing_generated=True,
            )
        return BackendUnavailable(f"HTTP {status}: {_error_message(response)}")
    if status == 404 and _error_code(response) == "model_not_found":
        return BackendUnavailable(f"router: {_error_message(response)}")
    return ContractViolation(f"/generate answered HTTP {status}: {_error_message(response)}")


class _CumulativeStream:
    """SGLang's streamed ``/generate`` answer: every event the answer so far (``parse_stream_event``),
    ``data: [DONE]`` at the end."""

    __slots__ = ("request", "sent", "worker")

    def __init__(self, request: GenerateRequest, worker: str | None) -> None:
        self.request = request
        self.worker = worker
        self.sent: tuple[int, ...] = ()

    def event(self, data: bytes, latency_s: float) -> TokenChunk | None:
        event = sse_json(data, "streamed /generate", worker=self.worker)
        if event is None:
            return None
        if type(event) is dict and "error" in event:
            # SGLang 0.5.16 answers a streamed request 200 at once and reports what its tokenizer
            # manager refuses (bad input, a duplicate id in flight) as an event {"error": {...}}
            # (http_server.py, stream_results).
            msg = error_message(event, data.decode("utf-8", errors="replace"))
            if not self.sent:
                raise InvalidRequest(error_field(event, msg), msg)
            raise BackendUnavailable(f"the stream failed after {len(self.sent)} tokens: {msg}", worker=self.worker)
        chunk = parse_stream_event(self.request, event, self.sent, latency_s, worker=self.worker)
        self.sent += chunk.output_ids
        return chunk


@attrs.frozen(slots=True, kw_only=True)
class SGLangWire:
    """Configuration of one SGLang fleet's wire format.

    ``entry_url`` is the router (or the single server) that takes generation.
    """

    entry_url: str
    routing: RoutingKind = RoutingKind.SINGLE
    has_begin_end: bool = False
    has_ready_route: bool = False
    memory_saver: bool = False
    #: The servers have a tokenizer (not ``--skip-tokenizer-init``): stop strings and ``text``.
    stop_strings: bool = False
    deterministic: bool = False
    max_context: int | None = None
    vocab_size: int | None = None
    #: The checkpoint the first worker reported at connect (``Capabilities.model_path``).
    model_path: str | None = None
    probe_timeout: float = 20.0
    #: Worker URL (no trailing slash) -> worker id: names the worker a router reports it routed to.
    url_workers: Mapping[str, str] = attrs.field(factory=dict)

    def capabilities(self) -> Capabilities:
        return Capabilities(
            pause_modes=set(PauseMode),
            weight_transports=set(WeightTransport),
            memory_release=self.memory_saver,
            logprobs=True,
            top_logprobs=20,  # SGLang's top_logprobs_num has no limit; SamplingParams' is 20
            prompt_logprobs=True,  # logprob_start_len, and max_new_tokens=0
            stop_strings=self.stop_strings,
            streaming=True,  # "stream": true, cumulative events (parse_stream_event)
            routing=self.routing,
            abort=True,
            seeded_sampling=self.deterministic,
            begin_end_update=self.has_begin_end,
            # load_format "flattened_bucket" (SGLang 0.5.16: ModelRunner's weight updater, the
            # path Miles' colocated updates take); our reference server unflattens it too.
            flattened_buckets=True,
            version_source=VersionSource.RESPONSE,
            cached_tokens=True,
            worker_pinning=True,
            progress_probe=True,  # Progress: GET /health_generate on the worker (a 1-token generation)
            version_constraints=True,  # the fleet routes by its labels, pinning where not all serve one
            # SGLang 0.5.16 keeps no per-token versions (it stamps each chunk with the version then
            # served; docs/pause-modes.md): the fleet gives spans only where no update overlapped.
            version_spans=VersionSource.STAMPED,
            # Each streamed event's meta_info.weight_version reaches TokenChunk.weight_version, but
            # spans built from them are not declared: they are early. Across an IN_PLACE update
            # (the only one 0.5.16 completes with a stream in flight, see update_while_parked) the
            # first token stamped with the new version was still the old weights' token (H200 tier
            # 2026-12-03 18:25: stream_version_spans_across_in_place_update failed at tokens 26
            # and 28, direct and behind smg). Streams keep the STAMPED rule of version_spans.
            stream_version_spans=False,
            # A RETRACT update with requests parked fails at its flush: 0.5.16's flush_cache waits
            # for is_fully_idle(), which counts the waiting queue the parked requests sit in (H200
            # tier 2026-12-03 16:01, "Timed out waiting for idle state"; sglang#32153, #33784).
            update_while_parked=False,
            batch_invariant=self.deterministic,
            max_context=self.max_context,
            vocab_size=self.vocab_size,
            model_path=self.model_path,
        )

    # -- generation -------------------------------------------------------------------------

    def generate(self, request: GenerateRequest, worker: Worker | None) -> HttpRequest:
        base = (worker.generate_url or worker.control_url) if worker is not None else self.entry_url
        headers = {ROUTING_KEY_HEADER: request.routing_key} if request.routing_key else {}
        return HttpRequest("POST", f"{base}/generate", json=request_body(request), headers=headers)

    def parse_generation(
        self, request: GenerateRequest, response: HttpResponse, latency_s: float, *, worker: str | None = None
    ) -> Generation:
        worker = self._answered_by(response, worker)
        return parse_answer(request, response.json(), latency_s, worker=worker)

    def _answered_by(self, response: HttpResponse, worker: str | None) -> str | None:
        """Raise for a refused call; the worker that served it (where known)."""
        if response.status != 200:
            raise _generation_error(response)
        if worker is None and self.url_workers:
            # Behind smg the answer names the routed worker (its URL) in a header.
            routed = response.headers.get(ROUTED_WORKER_HEADER)
            if routed is not None:
                worker = self.url_workers.get(routed.rstrip("/"))
        return worker

    def stream(self, request: GenerateRequest, worker: Worker | None) -> HttpRequest:
        base = (worker.generate_url or worker.control_url) if worker is not None else self.entry_url
        headers = {ROUTING_KEY_HEADER: request.routing_key} if request.routing_key else {}
        return HttpRequest("POST", f"{base}/generate", json=request_body(request, stream=True), headers=headers)

    def stream_parser(self, request: GenerateRequest, head: HttpResponse, *, worker: str | None) -> StreamParser:
        return _CumulativeStream(request, self._answered_by(head, worker))

    # -- control ----------------------------------------------------------------------------

    @property
    def aborts_by_id(self) -> bool:
        """SGLang aborts one request by id (``/abort_request``), answering its partial tokens."""
        return True

    def control(self, op: Operation, worker: Worker) -> HttpRequest | None:
        url = worker.control_url

        def post(path: str, body: dict[str, Any] | None = None) -> HttpRequest:
            # Every POST control route is one of SGLang's admin routes (ADMIN_OPTIONAL): the
            # client sends its admin key (``HttpClient(admin_api_key=...)``) on them.
            return HttpRequest("POST", f"{url}{path}", json=body if body is not None else {}, admin=True)

        match op:
            case AbortRequest(request_id=rid):
                return post("/abort_request", {"rid": rid, "abort_all": False})
            case AbortAll():
                return post("/abort_request", {"rid": "", "abort_all": True})
            case Pause(mode=mode):
                return post("/pause_generation", {"mode": mode.value})
            case Resume():
                return post("/continue_generation", {})
            case FlushCache(wait_s=wait_s):
                return post(f"/flush_cache?timeout={wait_s:g}", None)
            case InitWeightGroup(group=g, rank_offset=rank_offset):
                return post("/init_weights_update_group", init_group_body(g, rank_offset))
            case UpdateFromDistributed():
                return post("/update_weights_from_distributed", distributed_body(op))
            case UpdateFromTensors():
                return post("/update_weights_from_tensor", tensors_body(op, worker.ranks))
            case UpdateFromDisk():
                return post("/update_weights_from_disk", disk_body(op))
            case DestroyWeightGroup(group_name=group_name):
                return post("/destroy_weights_update_group", {"group_name": group_name})
            case BeginWeightUpdate(selector=selector):
                return post("/begin_weight_update", {"selector": selector}) if self.has_begin_end else None
            case EndWeightUpdate():
                return post("/end_weight_update", {}) if self.has_begin_end else None
            case SetVersion(version=version):
                return post("/update_weight_version", set_version_body(version))
            case ReleaseMemory(tags=tags):
                return post("/release_memory_occupation", memory_body(tags))
            case ResumeMemory(tags=tags):
                return post("/resume_memory_occupation", memory_body(tags))
            case GetVersion():
                return HttpRequest("GET", f"{url}/model_info", idempotent=True)
            case Live():
                # Not /health: stock SGLang 0.5.x serves /health and /health_generate with one handler
                # that generates a token unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 (only fleets
                # we launch set it), so on a paused server it blocks SGLANG_HEALTH_CHECK_TIMEOUT (20 s)
                # and answers 503 (http_server.py, health_generate). /model_info answers from the
                # tokenizer manager, paused or not: the server is up and serving its routes.
                return HttpRequest("GET", f"{url}/model_info", timeout=self.probe_timeout, idempotent=True)
            case Ready():
                return (
                    HttpRequest("GET", f"{url}/ready", timeout=5.0, idempotent=True) if self.has_ready_route else None
                )
            case Progress():
                return HttpRequest("GET", f"{url}/health_generate", timeout=self.probe_timeout, idempotent=True)
        unhandled(op)

    def parse_control(self, op: Command, worker: Worker, response: HttpResponse) -> None:
        if not response.ok:
            raise ControlFailed(
                op.name, [WorkerFailure(worker.id, op.name, f"HTTP {response.status}: {_error_message(response)}")]
            )
        if isinstance(op, FlushCache):
            return  # plain text on success
        data = response.json()
        if isinstance(data, dict) and data.get("success") is False:
            raise ControlFailed(op.name, [WorkerFailure(worker.id, op.name, str(data.get("message", data)))])

    def parse_version(self, worker: Worker, response: HttpResponse) -> str | None:
        if not response.ok:
            raise ControlFailed(
                GetVersion.name,
                [WorkerFailure(worker.id, GetVersion.name, f"HTTP {response.status}: {_error_message(response)}")],
            )
        data = response.json()
        if not isinstance(data, dict) or "weight_version" not in data:
            raise ContractViolation("/model_info has no weight_version", worker=worker.id)
        v = data["weight_version"]
        return None if v is None else str(v)

    def parse_probe(self, probe: Probe, worker: Worker, response: HttpResponse) -> bool:
        return response.ok

    def router_health(self) -> HttpRequest | None:
        if self.routing is RoutingKind.SINGLE:
            return None
        return HttpRequest("GET", f"{self.entry_url}/health", timeout=5.0, idempotent=True)
