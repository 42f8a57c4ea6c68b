"""The toy engine's wire: what each operation sends and how each answer reads (pure, no I/O).

Everything else (validation, worker selection, fan-out, versions, health, the weight-update
transaction, retries and timeouts) is the ``Fleet``'s, written once for every engine.
"""

from __future__ import annotations

from typing import Any

import attrs

from rollout_backends import (
    Capabilities,
    ContractViolation,
    ControlFailed,
    FinishReason,
    GenerateRequest,
    Generation,
    InvalidRequest,
    PauseMode,
    RoutingKind,
    Unsupported,
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
    unhandled,
)

from ._engine import TOP_LOGPROBS

__all__ = ["ToyWire"]

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
_SAMPLING_FIELDS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "min_new_tokens", "stop_token_ids", "ignore_eos",
    "seed", "repetition_penalty", "frequency_penalty", "presence_penalty",
)  # fmt: skip


@attrs.frozen(kw_only=True)
class ToyWire:
    """Requests to toy engines and their answers. ``workers``: how many there are (for the routing kind)."""

    vocab_size: int
    max_context: int
    workers: int = 1

    def capabilities(self) -> Capabilities:
        # Declared: what the engine does and the conformance suite then checks. logprobs, abort and
        # version_source=RESPONSE are the defaults; cached_tokens (no cache), streaming, stop strings
        # and prompt logprobs are left undeclared, so their checks skip.
        return Capabilities(
            pause_modes={PauseMode.ABORT, PauseMode.IN_PLACE},
            weight_transports={WeightTransport.DISK},
            routing=RoutingKind.ROUND_ROBIN if self.workers > 1 else RoutingKind.SINGLE,
            seeded_sampling=True,
            batch_invariant=True,  # each request runs alone through the model
            worker_pinning=True,
            progress_probe=True,  # GET /health_generate: one token
            top_logprobs=TOP_LOGPROBS,
            version_constraints=True,  # the fleet routes by the labels it installed
            version_spans=VersionSource.STAMPED,  # the fleet's, where no update overlapped a request
            vocab_size=self.vocab_size,
            max_context=self.max_context,
        )

    @property
    def aborts_by_id(self) -> bool:
        return True  # POST /abort {rid}: the request answers with its tokens so far

    # -- generation ---------------------------------------------------------------------------

    def generate(self, request: GenerateRequest, worker: Worker | None) -> HttpRequest:
        if worker is None:  # the fleet has no router: its RoundRobin entry always names a worker
            raise Unsupported("routing", "a toy fleet has no router; generation goes to a worker")
        sp = request.sampling
        # Every sampling field is sent (the engine must not fall back on defaults of its own), but
        # stop strings: they are not declared, so the fleet never lets a request carry one.
        sampling = {name: getattr(sp, name) for name in _SAMPLING_FIELDS}
        sampling["stop_token_ids"] = list(sp.stop_token_ids)
        body = {"rid": request.request_id, "input_ids": list(request.input_ids), "sampling": sampling,
                "logprobs": request.return_logprobs, "top_logprobs": sp.top_logprobs}  # fmt: skip
        return HttpRequest("POST", f"{worker.generate_url or worker.control_url}/generate", json=body)

    def parse_generation(
        self, request: GenerateRequest, response: HttpResponse, latency_s: float, *, worker: str | None = None
    ) -> Generation:
        body = _answer(response, "generate", worker)
        try:
            tops = body["top_logprobs"]
            return Generation(
                request_id=request.request_id,
                output_ids=tuple(body["output_ids"]),
                logprobs=tuple(body["logprobs"]) if body["logprobs"] is not None else None,
                finish_reason=_FINISH[body["finish"]],
                weight_version=body["version"],
                prompt_tokens=body["prompt_tokens"],
                worker=worker or body["worker"],
                latency_s=latency_s,
                matched_stop=body["matched_stop"],
                top_logprobs=tuple(tuple((t, lp) for t, lp in row) for row in tops) if tops is not None else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ContractViolation(f"a generation answer it cannot read ({exc!r})", worker=worker) from None

    def stream(self, request: GenerateRequest, worker: Worker | None) -> HttpRequest:
        raise Unsupported("streaming")  # not declared: the fleet refuses streams before asking

    def stream_parser(self, request: GenerateRequest, head: HttpResponse, *, worker: str | None) -> StreamParser:
        raise Unsupported("streaming")

    # -- control ------------------------------------------------------------------------------

    def control(self, op: Operation, worker: Worker) -> HttpRequest | None:
        url = worker.control_url

        def post(route: str, **body: Any) -> HttpRequest:
            return HttpRequest("POST", f"{url}{route}", json=body, admin=True)

        def get(route: str, timeout: float | None = None) -> HttpRequest:
            return HttpRequest("GET", f"{url}{route}", timeout=timeout, idempotent=True)

        match op:
            case AbortRequest(request_id=rid):
                return post("/abort", rid=rid)
            case AbortAll():
                return post("/abort", all=True)
            case Pause(mode=mode):
                return post("/pause", mode=mode.value)
            case Resume():
                return post("/resume")
            case FlushCache():
                return post("/flush")
            case UpdateFromDisk(path=path, version=version):
                return post("/load", path=path, version=version)
            case SetVersion(version=version):
                return post("/label", version=version)
            case GetVersion():
                return get("/version")
            case Live():
                return get("/health", timeout=5.0)
            case Ready():
                return get("/ready", timeout=5.0)
            case Progress():
                return get("/health_generate", timeout=20.0)
            case (
                InitWeightGroup() | UpdateFromDistributed() | DestroyWeightGroup() | UpdateFromTensors()
                | BeginWeightUpdate() | EndWeightUpdate() | ReleaseMemory() | ResumeMemory()
            ):  # fmt: skip
                # Not declared (no such transport, no begin/end sessions, no memory release): the
                # fleet refuses them before they reach the wire.
                raise Unsupported(op.name)
        unhandled(op)

    def parse_control(self, op: Command, worker: Worker, response: HttpResponse) -> None:
        _answer(response, op.name, worker.id)

    def parse_version(self, worker: Worker, response: HttpResponse) -> str | None:
        version = _answer(response, "weight_version", worker.id).get("version")
        return str(version) if version is not None else None

    def parse_probe(self, probe: Probe, worker: Worker, response: HttpResponse) -> bool:
        return response.ok

    def router_health(self) -> HttpRequest | None:
        return None  # no router


def _answer(response: HttpResponse, operation: str, worker: str | None) -> dict[str, Any]:
    """The JSON body of a 200 answer; a refusal as the typed error the engine's answer says."""
    body = response.json()
    if response.status == 400 and isinstance(body, dict) and "field" in body:
        if operation == "generate":  # the caller's input, named as the caller wrote it
            raise InvalidRequest(str(body["field"]), str(body.get("error")))
        raise ControlFailed(operation, [WorkerFailure(worker or "?", operation, str(body.get("error")))])
    if not response.ok or not isinstance(body, dict):
        message = f"HTTP {response.status}: {response.text[:200]}"
        if operation == "generate":
            raise ContractViolation(f"generate: {message}", worker=worker)
        raise ControlFailed(operation, [WorkerFailure(worker or "?", operation, message)])
    return body
