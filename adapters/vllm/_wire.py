"""vLLM 0.26's HTTP server as a ``Wire``: request builders and response parsers only.

Generation is token-in/token-out ``POST /inference/v1/generate``; control calls are the routes
``vllm serve`` adds with ``VLLM_SERVER_DEV_MODE=1`` (``/pause``, ``/resume``, ``/abort_requests``,
``/reset_prefix_cache``, ``/collective_rpc``, ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/sleep``,
``/wake_up``, ``/is_sleeping``), read from the ``vllm==0.26.0`` wheel. Which protocol call maps onto
which route, and why, is ``docs/vllm.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

import attrs

from rollout_backends import (
    BackendUnavailable,
    Capabilities,
    ContractViolation,
    ControlFailed,
    GenerateRequest,
    Generation,
    InvalidRequest,
    MemoryTag,
    PauseMode,
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

from ._codec import (
    assemble,
    choice_tokens,
    control_message,
    engine_request_id,
    error_of,
    field_of,
    generate_body,
    parse_generate_answer,
    parse_logprobs,
    usage_of,
)
from ._tensors import ipc_update_info

__all__ = [
    "DEFAULT_LOGPROBS_MODE",
    "GENERATE_PATH",
    "LOGPROBS_MODES",
    "PAUSE_QUERY",
    "TRANSFER_BACKENDS",
    "VllmWire",
    "filtered_logprobs",
]

GENERATE_PATH = "/inference/v1/generate"
#: Our pause modes as vLLM 0.26's ``POST /pause`` query (``PauseMode`` literal ``abort|wait|keep``;
#: ``EngineCoreProc.pause_scheduler``): ``keep`` freezes every request (``PAUSED_ALL``), and with
#: ``clear_cache=true`` then resets the prefix cache with ``reset_running_requests=True``, which
#: preempts the frozen requests (KV freed, recomputed after ``/resume``): RETRACT; without it their KV
#: stays: IN_PLACE. ``abort`` aborts every request (each answers ``finish_reason: "abort"`` with its
#: tokens). vLLM's ``wait`` (let in-flight requests finish, queue new ones) has no protocol mode.
PAUSE_QUERY: Mapping[PauseMode, str] = {
    PauseMode.ABORT: "mode=abort&clear_cache=false",
    PauseMode.RETRACT: "mode=keep&clear_cache=true",
    PauseMode.IN_PLACE: "mode=keep&clear_cache=false",
}
#: ``--weight-transfer-config '{"backend": ...}'`` values and the transport each serves (one per
#: server: ``WeightTransferConfig.backend``, default ``nccl`` once the config is given at all).
TRANSFER_BACKENDS: Mapping[str, WeightTransport] = {"nccl": WeightTransport.DISTRIBUTED, "ipc": WeightTransport.TENSOR}
#: ``--logprobs-mode`` (``ModelConfig.logprobs_mode``, ``vllm/config/model.py`` ``LogprobsMode``) when
#: not given: logprobs of the model's own logits, before penalties, temperature and filters.
DEFAULT_LOGPROBS_MODE = "raw_logprobs"
#: The modes whose logprobs are taken where the sampler draws (``v1/sample/sampler.py``
#: ``Sampler.sample``; ``ops/topk_topp_sampler.py`` ``forward_native``): after the penalties, the
#: temperature, ``min_p`` (``MinPLogitsProcessor``, an argmax-invariant logits processor applied
#: before top-k/top-p) and ``top_k`` / ``top_p`` (``apply_top_k_top_p``: the others at ``-inf``),
#: renormalised by the ``log_softmax`` there. ``*_logits`` answer logits, which no check takes for
#: logprobs (``greedy_shapes``); ``raw_*`` are taken before any of it.
_PROCESSED_MODES = frozenset({"processed_logprobs", "processed_logits"})
#: Every ``--logprobs-mode`` vLLM 0.26 takes (``LogprobsMode``).
LOGPROBS_MODES = frozenset({"raw_logprobs", "raw_logits", *_PROCESSED_MODES})


def filtered_logprobs(logprobs_mode: str) -> bool:
    """``Capabilities.filtered_logprobs`` of a vLLM engine run with ``--logprobs-mode logprobs_mode``."""
    return logprobs_mode in _PROCESSED_MODES


#: ``/wake_up?tags=`` values (vLLM's ``CuMemAllocator`` tags); ``cuda_graph`` has no vLLM tag.
_WAKE_TAGS: Mapping[MemoryTag, str] = {MemoryTag.WEIGHTS: "weights", MemoryTag.KV_CACHE: "kv_cache"}


def _post(url: str, path: str, body: Mapping[str, Any] | None = None) -> HttpRequest:
    return HttpRequest("POST", f"{url}{path}", json=dict(body or {}))


def _disk(op: UpdateFromDisk, url: str) -> HttpRequest | tuple[HttpRequest, ...]:
    """``GPUWorker.reload_weights(weights_path=)`` on every rank (a layerwise reload of the
    checkpoint), then the prefix cache reset where asked."""
    if op.load_format is not None:
        raise InvalidRequest("load_format", "vLLM reloads in the server's own --load-format")
    reload = _post(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": op.path}})
    return (reload, _post(url, "/reset_prefix_cache")) if op.flush_cache else reload


def _session(url: str, update_info: Mapping[str, Any], flush_cache: bool) -> tuple[HttpRequest, ...]:
    """One load as vLLM's transfer engine takes it: start (layerwise reload set up), the update,
    finish (the layers processed and put back), in order on one worker. Each load is a session of
    its own, so a layer must arrive whole within one bucket (``docs/vllm.md``)."""
    calls = (
        _post(url, "/start_weight_update"),
        _post(url, "/update_weights", {"update_info": dict(update_info)}),
        _post(url, "/finish_weight_update"),
    )
    return (*calls, _post(url, "/reset_prefix_cache")) if flush_cache else calls


def _wake(url: str, tags: tuple[MemoryTag, ...] | None) -> tuple[HttpRequest, ...] | None:
    """One ``/wake_up?tags=`` per tag vLLM knows (every tag for ``None``), weights first; nothing
    where only ``cuda_graph`` is asked.

    Never a plain ``/wake_up`` and never two tags in one call: vLLM 0.26's executor skips (warns,
    returns) a call naming a tag that is not asleep, so one call per tag wakes exactly what still
    sleeps, whatever woke before; and a plain ``/wake_up`` after ``tags=weights`` maps the woken
    weights again (``CuMemAllocator.wake_up(None)`` has no is-asleep check): HTTP 500 "CUDA Error:
    invalid argument" and an engine that answered nothing after it (H100 capture of 2026-12-06).
    """
    wanted = set(_WAKE_TAGS) if tags is None else set(tags)
    calls = tuple(_post(url, f"/wake_up?{urlencode({'tags': v})}") for t, v in _WAKE_TAGS.items() if t in wanted)
    return calls or None


class _DeltaStream:
    """A streamed ``/inference/v1/generate`` answer (``GenerateStreamResponse`` events): each event's
    ``choices[0]`` holds its *new* ``token_ids`` and their logprobs (``RequestOutputKind.DELTA``),
    the last token event its ``finish_reason``; then one ``choices: []`` event with the ``usage``
    (``stream_options.include_usage``), then ``data: [DONE]``. vLLM skips an output that adds no
    token (``serve_tokens_stream_generator``: ``if not delta_token_ids: continue``), so an abort
    after the last token sends no finish: a stream that ends without one was aborted."""

    __slots__ = ("finish", "ids", "lps", "request", "tops", "worker")

    def __init__(self, request: GenerateRequest, worker: str | None) -> None:
        self.request, self.worker = request, worker
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.tops: list[tuple[tuple[int, float], ...]] = []
        self.finish: object = None

    def event(self, data: bytes, latency_s: float) -> TokenChunk | None:
        event = sse_json(data, "streamed /inference/v1/generate", worker=self.worker)
        if event is None:
            return None
        if not isinstance(event, dict):
            raise ContractViolation(f"a stream event is {type(event).__name__}, expected an object")
        if "error" in event:
            err = event["error"]
            msg = str(err.get("message", err)) if isinstance(err, dict) else str(err)
            if not self.ids and isinstance(err, dict) and err.get("code") == 400:
                raise InvalidRequest(field_of(err.get("param"), msg), msg)
            raise BackendUnavailable(f"the stream failed after {len(self.ids)} tokens: {msg}", worker=self.worker)
        choices = event.get("choices")
        if not isinstance(choices, list):
            raise ContractViolation("a stream event has no choices", worker=self.worker)
        if not choices:
            return self._closing(event, latency_s)
        choice = choices[0]
        if len(choices) != 1 or not isinstance(choice, dict):
            raise ContractViolation("a stream event has more than one choice", worker=self.worker)
        ids = choice_tokens(choice, self.worker)
        lps, tops = parse_logprobs(self.request, choice, ids, self.worker)
        n = len(self.ids)
        self.ids.extend(ids)
        if lps is not None:
            self.lps.extend(lps)
        if tops is not None:
            self.tops.extend(tops)
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        if self.request.sampling.max_new_tokens == 0:  # re-scoring: the token generated is not the caller's
            return TokenChunk(request_id=self.request.request_id, index=0, output_ids=())
        return TokenChunk(
            request_id=self.request.request_id, index=n, output_ids=tuple(ids), logprobs=lps, top_logprobs=tops
        )

    def _closing(self, event: Mapping[str, Any], latency_s: float) -> TokenChunk:
        """The usage event: the generation is complete."""
        request = self.request
        prompt_tokens, cached = usage_of(event, request)
        gen = assemble(
            request,
            self.ids,
            tuple(self.lps) if request.return_logprobs else None,
            tuple(self.tops) if request.sampling.top_logprobs else None,
            finish="abort" if self.finish is None else self.finish,  # see the class docstring
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            prompt_logprobs=None,
            latency_s=latency_s,
            worker=self.worker,
        )
        return TokenChunk.closing(gen, len(gen.output_ids))


@attrs.frozen(slots=True, kw_only=True)
class VllmWire:
    """One vLLM fleet's wire format.

    ``entry_url`` is a router in front of the servers (``router=True``), or the one server; without
    a router the fleet hands each unpinned request to the next server itself
    (``HttpFleetBackend(rotate=True)``), so generation always names its server.
    """

    entry_url: str
    router: bool = False
    routing: RoutingKind = RoutingKind.SINGLE
    #: The RL routes are served (``VLLM_SERVER_DEV_MODE=1``): pause, abort by id, weights, sleep.
    dev_routes: bool = True
    #: ``--weight-transfer-config`` backend (``nccl``, ``ipc``) or ``None`` (not configured).
    transfer_backend: str | None = None
    #: ``--enable-sleep-mode``: ``/sleep`` and ``/wake_up`` release and restore GPU memory.
    sleep_mode: bool = False
    #: ``--max-logprobs`` (default 20). Top logprobs are asked one more than wanted (see ``generate``).
    max_logprobs: int = 20
    #: ``--enable-prompt-tokens-details``: answers carry ``usage.prompt_tokens_details.cached_tokens``.
    cached_tokens: bool = False
    #: ``VLLM_BATCH_INVARIANT=1``: greedy outputs do not depend on the batch.
    batch_invariant: bool = False
    #: ``--logprobs-mode`` (``/server_info``'s ``model_config.logprobs_mode``): which distribution
    #: logprobs are of (``filtered_logprobs``).
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE
    max_context: int | None = None
    vocab_size: int | None = None
    probe_timeout: float = 20.0
    #: The token the progress probe sends (any id the model knows).
    probe_token: int = 1

    @property
    def top_logprobs(self) -> int:
        """The most top logprobs per token served exactly: ``max_logprobs - 1`` (at most 20).

        vLLM's answer lists, per token, the first ``logprobs`` entries of a dict that holds the
        *sampled* token first, then the best (``Sampler.gather_logprobs``; ``ServingTokens.
        _create_tokens_logprobs``): asked ``k``, a sampled token outside the best ``k`` pushes the
        ``k``-th best out. Asked ``k + 1``, the ``k`` best of what comes back are exactly the best
        ``k`` whatever was sampled."""
        return max(0, min(20, self.max_logprobs - 1))

    def capabilities(self) -> Capabilities:
        dev = self.dev_routes
        transports = {WeightTransport.DISK} if dev else set()
        transfer = TRANSFER_BACKENDS.get(self.transfer_backend or "")
        if dev and transfer is not None:
            transports.add(transfer)
        return Capabilities(
            pause_modes=set(PAUSE_QUERY) if dev else set(),
            weight_transports=transports,
            memory_release=dev and self.sleep_mode,
            survives_failed_load=False,  # a failed reload_weights killed the engine core (H100, 2026-12-06)
            logprobs=True,
            top_logprobs=self.top_logprobs,
            filtered_logprobs=filtered_logprobs(self.logprobs_mode),
            prompt_logprobs=True,  # sampling_params.prompt_logprobs=0 (the whole prompt's, cut here)
            stop_strings=False,  # the answer carries neither text nor the matched string (0.26)
            streaming=True,
            routing=self.routing,
            abort=True,
            seeded_sampling=self.batch_invariant,
            begin_end_update=False,  # each load is one start/update/finish on the engine (see control)
            version_source=VersionSource.STAMPED,  # vLLM 0.26 keeps no weight version
            cached_tokens=self.cached_tokens,  # the servers' --enable-prompt-tokens-details (connect says)
            # Generation names its server (its own URL), router or not.
            worker_pinning=True,
            progress_probe=True,  # Progress: a 1-token generation on the server itself (_progress)
            version_constraints=True,
            version_spans=VersionSource.STAMPED,
            stream_version_spans=False,
            # RETRACT preempts the frozen requests (their KV freed): /reset_prefix_cache succeeds and
            # the load runs with them parked (EngineCoreProc.pause_scheduler, Scheduler.reset_prefix_cache).
            update_while_parked=dev,
            batch_invariant=self.batch_invariant,
            max_context=self.max_context,
            vocab_size=self.vocab_size,
        )

    # -- generation -------------------------------------------------------------------------

    def _refuse_unservable(self, request: GenerateRequest, *, stream: bool) -> None:
        if request.sampling.stop:
            raise InvalidRequest(
                "sampling.stop", "vLLM 0.26's token-in/token-out generate answers no text: no stop strings"
            )
        if stream and request.prompt_logprobs_start is not None:
            raise InvalidRequest("prompt_logprobs_start", "vLLM 0.26 streams no prompt logprobs (ask without stream)")

    def _base(self, worker: Worker | None) -> str:
        return (worker.generate_url or worker.control_url) if worker is not None else self.entry_url

    def generate(self, request: GenerateRequest, worker: Worker | None) -> HttpRequest:
        self._refuse_unservable(request, stream=False)
        body = generate_body(request, top_logprobs_asked=request.sampling.top_logprobs + 1)
        return HttpRequest("POST", f"{self._base(worker)}{GENERATE_PATH}", json=body)

    def parse_generation(
        self, request: GenerateRequest, response: HttpResponse, latency_s: float, *, worker: str | None = None
    ) -> Generation:
        if response.status != 200:
            raise error_of(response, what=GENERATE_PATH, worker=worker)
        return parse_generate_answer(request, response.json(), latency_s, worker=worker)

    def stream(self, request: GenerateRequest, worker: Worker | None) -> HttpRequest:
        self._refuse_unservable(request, stream=True)
        body = generate_body(request, top_logprobs_asked=request.sampling.top_logprobs + 1, stream=True)
        return HttpRequest("POST", f"{self._base(worker)}{GENERATE_PATH}", json=body)

    def stream_parser(self, request: GenerateRequest, head: HttpResponse, *, worker: str | None) -> StreamParser:
        if head.status != 200:
            raise error_of(head, what=GENERATE_PATH, worker=worker)
        return _DeltaStream(request, worker)

    # -- control ----------------------------------------------------------------------------

    @property
    def aborts_by_id(self) -> bool:
        """``/abort_requests`` aborts by id; the request still answers, with its tokens so far."""
        return self.dev_routes

    def control(self, op: Operation, worker: Worker) -> HttpRequest | tuple[HttpRequest, ...] | None:
        url = worker.control_url
        match op:
            case Live():
                return HttpRequest("GET", f"{url}/health", timeout=self.probe_timeout, idempotent=True)
            case Ready():
                # is_sleeping: the scheduler paused or the executor asleep (EngineCore.is_sleeping).
                ready = HttpRequest("GET", f"{url}/is_sleeping", timeout=5.0, idempotent=True)
                return ready if self.dev_routes else None
            case Progress():
                return self._progress(worker)
            case GetVersion() | SetVersion() | BeginWeightUpdate() | EndWeightUpdate() | DestroyWeightGroup():
                # 0.26 keeps no weight version (the fleet's VersionBook does), has no update
                # sessions of its own, and no route to drop the transfer group (it lives until the
                # server stops; a new init replaces it).
                return None
            case AbortRequest(request_id=rid):
                return _post(url, "/abort_requests", {"request_ids": [engine_request_id(rid)]})
            case AbortAll():
                return _post(url, "/abort_requests", {"request_ids": []})  # empty: every request held
            case Pause(mode=mode):
                return _post(url, f"/pause?{PAUSE_QUERY[mode]}")
            case Resume():
                return _post(url, "/resume")
            case FlushCache():
                # {"success": false} while requests hold blocks (frozen by an IN_PLACE pause): refused.
                return _post(url, "/reset_prefix_cache")
            case UpdateFromDisk():
                return _disk(op, url)
            case InitWeightGroup(group=g, rank_offset=rank_offset):
                if g.backend != "nccl":
                    raise InvalidRequest("group.backend", "vLLM's weight transfer group is NCCL only")
                info = {"master_address": g.master_address, "master_port": g.master_port,
                        "rank_offset": rank_offset, "world_size": g.world_size}  # fmt: skip
                return _post(url, "/init_weight_transfer_engine", {"init_info": info})
            case UpdateFromDistributed(bucket=bucket, flush_cache=flush_cache):
                info = {"names": bucket.names, "dtype_names": bucket.dtypes, "shapes": bucket.shapes, "packed": False}
                return _session(url, info, flush_cache)
            case UpdateFromTensors(tensors=tensors, load_format=load_format, flush_cache=flush_cache):
                if load_format is not None:
                    raise InvalidRequest("load_format", "vLLM's IPC weight transfer has no load formats")
                return _session(url, ipc_update_info(tensors.items), flush_cache)
            case ReleaseMemory(tags=tags):
                if tags is not None and not {MemoryTag.WEIGHTS, MemoryTag.KV_CACHE} <= set(tags):
                    raise InvalidRequest("tags", "vLLM releases weights and KV cache together (sleep level 1)")
                # Level 1: weights offloaded to CPU, KV discarded; keep: requests preempted, not aborted.
                return _post(url, "/sleep?level=1&mode=keep")
            case ResumeMemory(tags=tags):
                return _wake(url, tags)
        unhandled(op)

    def _progress(self, worker: Worker) -> HttpRequest:
        """A 1-token greedy generation on the worker."""
        probe = GenerateRequest(input_ids=(self.probe_token,), return_logprobs=False)
        body = generate_body(probe, top_logprobs_asked=0)
        body["sampling_params"].update(max_tokens=1, temperature=0.0, ignore_eos=True)
        return HttpRequest("POST", f"{self._base(worker)}{GENERATE_PATH}", json=body, timeout=self.probe_timeout)

    def parse_control(self, op: Command, worker: Worker, response: HttpResponse) -> None:
        if not response.ok:
            why = f"HTTP {response.status}: {control_message(response)}"
            raise ControlFailed(op.name, [WorkerFailure(worker.id, op.name, why)])
        data = response.json()
        if isinstance(data, dict) and data.get("success") is False:
            # /reset_prefix_cache: blocks are still held (running or frozen requests).
            raise ControlFailed(op.name, [WorkerFailure(worker.id, op.name, f"refused: {data}")])

    def parse_version(self, worker: Worker, response: HttpResponse) -> str | None:
        return None  # never asked: control() sends no GetVersion

    def parse_probe(self, probe: Probe, worker: Worker, response: HttpResponse) -> bool:
        match probe:
            case Live() | Progress():
                return response.ok
            case Ready():
                if not response.ok:
                    return False
                data = response.json()
                if not isinstance(data, dict) or not isinstance(data.get("is_sleeping"), bool):
                    raise ContractViolation(f"/is_sleeping answered {data!r:.120}", worker=worker.id)
                return not data["is_sleeping"]
        unhandled(probe)

    def router_health(self) -> HttpRequest | None:
        return HttpRequest("GET", f"{self.entry_url}/health", timeout=5.0, idempotent=True) if self.router else None
