"""The Wire skeleton of docs/adapters.md (section 1), kept as a file: mypy --strict checks it
(tools/typecheck.sh) and tests/test_toy_adapter.py holds the document's copy to it. The bodies
left to write raise NotImplementedError; examples/toy_adapter/ is a complete adapter."""

from __future__ import annotations

from rollout_backends import Capabilities, ControlFailed, GenerateRequest, Generation, PauseMode, RoutingKind
from rollout_backends import Unsupported, VersionSource, WeightTransport, WorkerFailure
from rollout_backends.kit import Command, HttpClient, HttpFleetBackend, HttpRequest, HttpResponse, Operation, Probe
from rollout_backends.kit import StreamParser, Worker, unhandled
from rollout_backends.kit import (
    AbortAll, AbortRequest, BeginWeightUpdate, DestroyWeightGroup, EndWeightUpdate, FlushCache, GetVersion,
    InitWeightGroup, Live, Pause, Progress, Ready, ReleaseMemory, Resume, ResumeMemory, SetVersion, UpdateFromDisk,
    UpdateFromDistributed, UpdateFromTensors,
)  # fmt: skip


class MyWire:
    def __init__(self, entry_url: str) -> None:
        self.entry_url = entry_url

    def capabilities(self) -> Capabilities:
        return Capabilities(
            pause_modes={PauseMode.ABORT},
            weight_transports={WeightTransport.DISK},
            routing=RoutingKind.ROUND_ROBIN,
            version_source=VersionSource.RESPONSE,
            worker_pinning=True,
        )

    @property
    def aborts_by_id(self) -> bool:
        return True

    def generate(self, request: GenerateRequest, worker: Worker | None) -> HttpRequest:
        url = worker.generate_url or worker.control_url if worker is not None else self.entry_url
        sp = request.sampling  # send every field, in the engine's names: never leave one to its defaults
        body = {"input_ids": list(request.input_ids), "temperature": sp.temperature, "max_tokens": sp.max_new_tokens}
        return HttpRequest("POST", f"{url}/generate", json=body)

    def parse_generation(
        self, request: GenerateRequest, response: HttpResponse, latency_s: float, *, worker: str | None = None
    ) -> Generation:
        raise NotImplementedError  # a Generation; InvalidRequest(field, ...) for a refused input, ContractViolation

    def stream(self, request: GenerateRequest, worker: Worker | None) -> HttpRequest:
        raise Unsupported("streaming")  # until capabilities() declares streaming=True

    def stream_parser(self, request: GenerateRequest, head: HttpResponse, *, worker: str | None) -> StreamParser:
        raise Unsupported("streaming")

    def control(self, op: Operation, worker: Worker) -> HttpRequest | None:
        url = worker.control_url
        match op:
            case Pause(mode=mode):
                return HttpRequest("POST", f"{url}/pause", json={"mode": mode.value})
            case Resume():
                return HttpRequest("POST", f"{url}/resume", json={})
            case AbortRequest(request_id=rid):
                return HttpRequest("POST", f"{url}/abort", json={"rid": rid})
            case AbortAll():
                return HttpRequest("POST", f"{url}/abort", json={"all": True})
            case FlushCache():
                return HttpRequest("POST", f"{url}/flush", json={})
            case UpdateFromDisk(path=path, version=version):
                return HttpRequest("POST", f"{url}/load", json={"path": path, "version": version})
            case SetVersion(version=version):
                return HttpRequest("POST", f"{url}/label", json={"version": version})
            case GetVersion():
                return HttpRequest("GET", f"{url}/version", idempotent=True)
            case Live():
                return HttpRequest("GET", f"{url}/health", idempotent=True)
            case Ready() | Progress():
                return None  # ready when live; no progress probe (progress_probe is not declared)
            case (
                InitWeightGroup() | UpdateFromDistributed() | DestroyWeightGroup() | UpdateFromTensors()
                | BeginWeightUpdate() | EndWeightUpdate() | ReleaseMemory() | ResumeMemory()
            ):  # fmt: skip
                raise Unsupported(op.name)  # not declared: the fleet refuses these before they get here
        unhandled(op)  # an operation left out above is a mypy error here

    def parse_control(self, op: Command, worker: Worker, response: HttpResponse) -> None:
        if not response.ok:
            raise ControlFailed(op.name, [WorkerFailure(worker.id, op.name, f"HTTP {response.status}")])

    def parse_version(self, worker: Worker, response: HttpResponse) -> str | None:
        raise NotImplementedError  # the label in the answer to GetVersion

    def parse_probe(self, probe: Probe, worker: Worker, response: HttpResponse) -> bool:
        return response.ok

    def router_health(self) -> HttpRequest | None:
        return HttpRequest("GET", f"{self.entry_url}/health", idempotent=True)


async def connect(url: str, *, client: HttpClient | None = None) -> HttpFleetBackend:
    workers = [Worker(id="w0", control_url=url, generate_url=url)]
    return HttpFleetBackend(MyWire(url), workers, client=client or HttpClient(), name="mine")
