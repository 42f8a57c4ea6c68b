"""Connecting to a running Dynamo fleet: detect the worker flavor, map instance ids, build the backend."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from rollout_backends import BackendUnavailable, InvalidRequest, RolloutBackendError, Unsupported, VersionSource
from rollout_backends.kit import (
    HttpClient,
    HttpFleetBackend,
    HttpRequest,
    HttpResponse,
    Worker,
    get_json,
    normalise_url,
    worker_id_of,
)

from ..vllm import LOGPROBS_MODES
from ._memory_saver import detect_memory_saver
from ._wire import FLAVORS, ROUTES, DynamoWire, generate_instances, to_flavor

__all__ = ["connect", "detect_flavor", "detect_native_generate", "open_from_url", "worker_id_of"]


def _normalise(url: str) -> str:
    return normalise_url(url, "dynamo")


async def _send(client: HttpClient, req: HttpRequest) -> HttpResponse:
    return await client.send(req)


def _route_missing(resp: HttpResponse) -> bool:
    return resp.status == 404 and "Route not found" in resp.text


async def detect_flavor(client: HttpClient, worker_url: str) -> tuple[str, dict[str, Any] | None]:
    """Which engine routes a worker serves, probed once (no side effects):

    ``rollout/info`` answers → our worker (``rollout``, with its info); ``get_weight_version``
    answers ``{"status": "ok", "version": ...}`` → ``dynamo.vllm`` (``vllm``); else
    ``call_tokenizer_manager`` is routed → ``sglang14`` (1.4.x with ``--enable-rl``); else a 404
    "Route not found" → ``sglang16`` (1.6.x native routes) — or a mocker, which has no engine
    routes at all (pass ``flavor="mocker"``; the launcher does). Either dynamo.sglang through the
    shim: ``sglang14-shim`` / ``sglang16-shim``, where its ``rollout/weight_version`` answers.
    """
    info = await _send(client, HttpRequest("POST", f"{worker_url}/engine/rollout/info", json={}, timeout=10.0))
    if info.ok:
        data = info.json()
        return "rollout", data if isinstance(data, dict) else None
    version = await _send(client, HttpRequest("POST", f"{worker_url}/engine/get_weight_version", json={}, timeout=10.0))
    if version.ok and isinstance(answer := version.json(), dict) and "version" in answer:
        return "vllm", None
    # An empty body makes the 1.4.x handler fail on the missing `method` (500); 1.6.x has no route.
    tm = await _send(client, HttpRequest("POST", f"{worker_url}/engine/call_tokenizer_manager", json={}, timeout=10.0))
    base = "sglang16" if _route_missing(tm) else "sglang14"
    version = await _send(
        client, HttpRequest("POST", f"{worker_url}/engine/rollout/weight_version", json={}, timeout=10.0)
    )
    return (f"{base}-shim" if version.ok else base), None


async def detect_native_generate(client: HttpClient, frontend: str) -> bool:
    """Whether the frontend serves SGLang's native ``POST /generate`` (ai-dynamo 1.6.x with
    ``DYN_SGLANG_ENABLE_GENERATE=1``), probed once without generating: an empty ``input_ids`` is
    refused by the route's own validation (400 "input_ids cannot be empty"); without the route the
    frontend answers 404 "Route not found" (1.4.x, or 1.6.x without the variable)."""
    resp = await _send(
        client, HttpRequest("POST", f"{frontend}/generate", json={"input_ids": [], "stream": True}, timeout=10.0)
    )
    return resp.status == 400 and "input_ids" in resp.text


def _model_config(model_path: str | None) -> dict[str, Any]:
    if not model_path:
        return {}
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _eos_ids(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, list):
        return tuple(int(x) for x in eos)
    return ()


def _model_limits(
    info0: Mapping[str, Any] | None, model_path: str | None
) -> tuple[int | None, int | None, tuple[int, ...]]:
    """``(max_context, vocab_size, eos_token_ids)``: our worker's ``rollout/info``, else the checkpoint's config."""
    cfg = _model_config(model_path)
    vocab = (info0 or {}).get("vocab_size") or cfg.get("vocab_size")
    ctx = (info0 or {}).get("max_context") or cfg.get("max_position_embeddings")
    eos = tuple((info0 or {}).get("eos_token_ids") or ()) or _eos_ids(cfg)
    return (int(ctx) if isinstance(ctx, int) else None), (int(vocab) if isinstance(vocab, int) else None), eos


def _instances_by_rpc_port(instances: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """Instance ids by request-plane port, from each instance's ``transport.tcp`` in ``/health``."""
    by_rpc_port: dict[int, int] = {}
    for inst in instances:
        tcp = (inst.get("transport") or {}).get("tcp") if isinstance(inst.get("transport"), dict) else None
        if isinstance(tcp, str) and ":" in tcp:
            with contextlib.suppress(ValueError, KeyError):
                by_rpc_port[int(tcp.split("/", 1)[0].rsplit(":", 1)[1])] = int(inst["instance_id"])
    return by_rpc_port


def _instance_workers(frontend: str, instances: Sequence[Mapping[str, Any]]) -> list[Worker]:
    """Without worker URLs: each generate instance is a worker with no control routes."""
    fleet = [Worker(id=f"instance-{int(i['instance_id']):x}", control_url="", instance_id=int(i["instance_id"]))
             for i in instances]  # fmt: skip
    if not fleet:
        raise BackendUnavailable(f"{frontend}: no generate instances are registered")
    return fleet


async def _control_workers(
    client: HttpClient,
    urls: Sequence[str],
    flavor: str | None,
    rpc_ports: Mapping[str, int] | None,
    by_rpc_port: Mapping[int, int],
) -> tuple[str, list[Worker], dict[str, Any] | None]:
    """The workers at ``urls`` (system ports), each with its instance id where known; the flavor
    (detected from the first when ``None``) and the first ``rollout/info`` answer (our worker's)."""
    info0: dict[str, Any] | None = None
    if flavor is None:
        flavor, info0 = await detect_flavor(client, urls[0])
    fleet: list[Worker] = []
    for u in urls:
        instance: int | None = None
        if flavor == "rollout":
            resp = await _send(client, HttpRequest("POST", f"{u}/engine/rollout/info", json={}, timeout=10.0))
            data = resp.json() if resp.ok else None
            if isinstance(data, dict):
                info0 = info0 or data
                if isinstance(data.get("instance_id"), int):
                    instance = data["instance_id"]
        if instance is None and rpc_ports and u in rpc_ports:
            instance = by_rpc_port.get(int(rpc_ports[u]))
        fleet.append(Worker(id=worker_id_of(u), control_url=u, instance_id=instance))
    return flavor, fleet, info0


async def _use_native_generate(
    client: HttpClient, frontend: str, native_generate: bool | None, flavor: str, info0: Mapping[str, Any] | None
) -> bool:
    """Whether unpinned requests go by the frontend's native ``/generate`` (see ``connect``)."""
    # Native /generate only where its answers name the worker: ours says so in rollout/info
    # (dynamo.sglang's and the mocker's native answers carry no worker id).
    advertised = flavor == "rollout" and bool((info0 or {}).get("native_generate"))
    native = False
    if native_generate or (native_generate is None and advertised):
        native = await detect_native_generate(client, frontend)
        if native_generate and not native:
            raise Unsupported(f"{frontend} serves no native /generate (1.6.x with DYN_SGLANG_ENABLE_GENERATE=1)")
    return native


async def _served_model(client: HttpClient, frontend: str, model: str | None) -> str:
    """``model``, else the frontend's only model (``/v1/models``)."""
    status, models = await get_json(f"{frontend}/v1/models", client=client)
    if status != 200 or not isinstance(models, dict):
        raise BackendUnavailable(f"{frontend}: /v1/models answered HTTP {status}")
    names = [m.get("id") for m in models.get("data") or [] if isinstance(m, dict)]
    if model is None:
        if len(names) != 1:
            raise BackendUnavailable(f"{frontend}: expected one model, the frontend lists {names}")
        model = str(names[0])
    return model


async def _fleet(
    client: HttpClient,
    frontend: str,
    namespace: str | None,
    workers: Sequence[str] | None,
    flavor: str | None,
    rpc_ports: Mapping[str, int] | None,
) -> tuple[str, list[Worker], dict[str, Any] | None]:
    """The fleet behind the frontend (see ``connect``): the flavor, the workers, and the first
    ``rollout/info`` answer where the workers are ours."""
    _, health = await get_json(f"{frontend}/health", client=client)
    instances = generate_instances(health, namespace)
    by_rpc_port = _instances_by_rpc_port(instances)
    if workers is None:
        return flavor or "none", _instance_workers(frontend, instances), None
    urls = [_normalise(w) for w in workers]
    return await _control_workers(client, urls, flavor, rpc_ports, by_rpc_port)


def _version_source(version_source: VersionSource | str | None, flavor: str) -> VersionSource:
    if version_source is None:
        # Where workers serve rollout/weight_version they report the version; else the fleet stamps it.
        return VersionSource.RESPONSE if ROUTES[to_flavor(flavor)].rollout_routes else VersionSource.STAMPED
    return VersionSource(version_source)


def _worker_rpc_ports(rpc_ports: Mapping[str, int] | None, fleet: Sequence[Worker]) -> dict[str, int]:
    """Worker id -> request-plane port, for the workers of the fleet."""
    ids = {w.id for w in fleet}
    return {worker_id_of(u): int(p) for u, p in (rpc_ports or {}).items() if worker_id_of(_normalise(u)) in ids}


async def connect(
    url: str,
    *,
    workers: Sequence[str] | None = None,
    rpc_ports: Mapping[str, int] | None = None,
    flavor: str | None = None,
    router_mode: str = "round-robin",
    model: str | None = None,
    model_path: str | None = None,
    initial_version: str | None = None,
    version_source: VersionSource | str | None = None,
    memory_saver: bool | None = None,
    namespace: str | None = None,
    native_generate: bool | None = None,
    transfer_backend: str | None = None,
    logprobs_mode: str | None = None,
    api_key: str | None = None,
    client: HttpClient | None = None,
    on_close: Any = None,
) -> HttpFleetBackend:
    """Connect to a Dynamo frontend at ``url``; ``workers`` are the workers' system-port URLs.

    * The model is the frontend's only model unless ``model`` names one.
    * Instance ids (the frontend's ``nvext.worker_id``) are mapped to worker ids from each worker's
      ``rollout/info`` (our worker) or, for ``rpc_ports`` given, from the frontend's ``/health``
      ``transport`` (``DYN_TCP_RPC_PORT``; the launcher fixes it per worker).
    * ``router_mode`` is the frontend's (the frontend does not report it): pinning
      (``GenerateRequest.worker``) is declared only for ``kv``/``direct``.
    * Without ``workers``, the frontend's instances become workers without control routes (generation only).
    * ``native_generate``: unpinned requests use the frontend's native ``/generate``; ``None`` (default)
      detects it (the route served, the workers ours and saying so in ``rollout/info``); ``True``
      requires it (``Unsupported`` without the route); ``False`` always uses ``/v1/completions``.
    * Flags Dynamo does not show, which the launcher passes: ``transfer_backend``, ``logprobs_mode``
      (``vllm`` workers). ``memory_saver`` (SGLang's ``--enable-memory-saver``; ``False``: no
      ``memory_release``): ``None`` (default) asks the workers (``_memory_saver.py``), else ``True``.
    """
    _check_logprobs_mode(logprobs_mode)
    frontend = _normalise(url)
    client = client or HttpClient(api_key=api_key)
    try:
        model = await _served_model(client, frontend, model)
        flavor, fleet, info0 = await _fleet(client, frontend, namespace, workers, flavor, rpc_ports)
        native = await _use_native_generate(client, frontend, native_generate, flavor, info0)
        saver = (
            await detect_memory_saver(client, flavor, fleet) if memory_saver is None else (memory_saver, "caller", "")
        )
    except RolloutBackendError:
        await client.aclose()
        raise
    if flavor not in FLAVORS:
        await client.aclose()
        raise InvalidRequest("flavor", f"must be one of {FLAVORS}, got {flavor!r}")
    vs = _version_source(version_source, flavor)
    ctx, vocab, eos = _model_limits(info0, model_path)
    wire = DynamoWire(
        frontend_url=frontend,
        model=model,
        flavor=flavor,
        router_mode=router_mode,
        instance_workers={w.instance_id: w.id for w in fleet if w.instance_id is not None},
        url_workers={w.control_url: w.id for w in fleet if w.control_url},
        worker_rpc_ports=_worker_rpc_ports(rpc_ports, fleet),
        version_source=vs,
        memory_saver=saver[0],
        memory_saver_source=saver[1],
        memory_saver_note=saver[2],
        max_context=ctx,
        vocab_size=vocab,
        model_path=model_path,
        eos_token_ids=eos,
        namespace=namespace,
        native_generate=native,
        transfer_backend=transfer_backend,
        logprobs_mode=logprobs_mode,
    )
    backend = HttpFleetBackend(wire, fleet, client=client, name="dynamo", on_close=on_close)
    if initial_version is not None and vs is VersionSource.STAMPED:
        backend.set_installed_version(initial_version)
    return backend


def _check_logprobs_mode(mode: str | None) -> None:
    """``logprobs_mode`` is one vLLM takes (before anything is opened)."""
    if mode is not None and mode not in LOGPROBS_MODES:
        raise InvalidRequest("logprobs_mode", f"must be one of {sorted(LOGPROBS_MODES)}, got {mode!r}")


async def open_from_url(url: str, **kwargs: Any) -> HttpFleetBackend:
    """Registry entry: ``dynamo://host:port?workers=h1:p1,h2:p2&router_mode=kv&flavor=rollout``.

    ``workers`` are the workers' system ports (``DYN_SYSTEM_PORT``); ``rpc_ports`` their request-plane
    ports (``DYN_TCP_RPC_PORT``, one per worker, in order: maps instance ids where the workers do not
    say theirs); other keys: ``router_mode``, ``flavor``, ``model``, ``model_path``, ``namespace``,
    ``version_source``, ``initial_version``, ``native_generate`` (``0``/``1``; default: detected),
    ``transfer_backend`` and ``logprobs_mode`` (``vllm`` workers: ``nccl`` / ``ipc``; ``--logprobs-mode``),
    ``memory_saver`` (``0``/``1``: whether ``dynamo.sglang`` workers run with ``--enable-memory-saver``,
    so ``memory_release`` is declared; default: asked of the workers, see ``connect``). The launcher
    prints such a URL with every key it knows.
    """
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    known = {
        "workers",
        "router_mode",
        "flavor",
        "model",
        "model_path",
        "namespace",
        "version_source",
        "initial_version",
        "native_generate",
        "rpc_ports",
        "transfer_backend",
        "logprobs_mode",
        "memory_saver",
    }
    for key, values in query.items():
        if key not in known:
            raise InvalidRequest(f"url.{key}", f"unknown option (known: {sorted(known)})")
        if key in kwargs:
            continue
        if key == "workers":
            kwargs["workers"] = [w for item in values for w in item.split(",") if w]
        elif key == "rpc_ports":
            continue  # paired with the workers below
        elif key in ("native_generate", "memory_saver"):
            flag = values[-1].lower()
            if flag not in ("0", "1", "true", "false"):
                raise InvalidRequest(f"url.{key}", f"must be 0/1/true/false, got {values[-1]!r}")
            kwargs[key] = flag in ("1", "true")
        else:
            kwargs[key] = values[-1]
    if "rpc_ports" in query and "rpc_ports" not in kwargs:
        kwargs["rpc_ports"] = _rpc_ports(query["rpc_ports"], kwargs.get("workers"))
    return await connect(f"http://{parts.netloc}", **kwargs)


def _rpc_ports(values: list[str], workers: Any) -> dict[str, int]:
    """``rpc_ports=p1,p2`` of a URL: worker URL -> port, paired with ``workers`` in order."""
    ports = [p for item in values for p in item.split(",") if p]
    if not isinstance(workers, list) or len(workers) != len(ports):
        raise InvalidRequest("url.rpc_ports", "one port per worker of url.workers, in the same order")
    try:
        return {_normalise(w): int(p) for w, p in zip(workers, ports, strict=True)}
    except ValueError:
        raise InvalidRequest("url.rpc_ports", f"ports must be integers, got {ports}") from None
