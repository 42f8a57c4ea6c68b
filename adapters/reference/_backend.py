"""``ReferenceBackend``: the ``Fleet`` over N in-process ``ReferenceEngine``s, one ``ReferenceDriver`` each.

It is the backend the conformance suite is validated against and the one RL code can be unit
tested with on CPU: every capability is declared, and every numeric result is reproducible.
The protocol (validation, fan-out, versions, health, the transaction) is the fleet's; the driver
only turns each operation into an engine call.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from rollout_backends import (
    BackendUnavailable,
    Capabilities,
    GenerateRequest,
    Generation,
    InvalidRequest,
    MemoryTag,
    PauseMode,
    RoutingKind,
    SamplingParams,
    TokenChunk,
    VersionSource,
    WeightTransport,
)
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
    Live,
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

from ._engine import EngineError, ReferenceEngine
from ._model import SIZES, make_tiny_model

__all__ = ["ReferenceBackend", "ReferenceDriver", "cached_tiny_model", "default_cache_dir", "open_from_url"]

_PROBE_TIMEOUT_S = 10.0


def default_cache_dir() -> Path:
    """``$ROLLOUT_BACKENDS_CACHE`` or ``~/.cache/rollout-backends``."""
    env = os.environ.get("ROLLOUT_BACKENDS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "rollout-backends"


def cached_tiny_model(seed: int = 0, size: str = "tiny") -> Path:
    """A model made by ``make_tiny_model`` under the cache dir, made once per (size, seed).

    The directory is written under a temporary name and renamed, so concurrent makers never see
    a half-written model.
    """
    root = default_cache_dir() / "models"
    final = root / f"{size}-seed{seed}"
    if (final / "model.safetensors").is_file() and (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.{os.getpid()}.tmp"
    make_tiny_model(tmp, seed=seed, size=size)
    try:
        tmp.rename(final)
    except OSError:  # another process won the race; use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return final


class ReferenceDriver:
    """One ``ReferenceEngine`` as a fleet ``Driver``: operations become engine calls, in process.

    Engine refusals (``EngineError``) become ``ControlFailed`` naming the worker (``fan_out``).
    """

    __slots__ = ("_caps", "_owns", "engine")

    def __init__(self, engine: ReferenceEngine, capabilities: Capabilities, *, owns_engine: bool = True) -> None:
        self.engine = engine
        self._caps = capabilities
        self._owns = owns_engine

    @property
    def id(self) -> str:
        return self.engine.worker_id

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def aborts_by_id(self) -> bool:
        return True

    @property
    def ranks(self) -> int:
        return 1

    async def generate(self, request: GenerateRequest) -> Generation:
        try:
            return await self.engine.generate(request)
        except EngineError as exc:
            raise BackendUnavailable(str(exc), worker=self.id) from exc

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        chunks = self.engine.stream(request)
        try:
            async for chunk in chunks:
                yield chunk
        except EngineError as exc:
            raise BackendUnavailable(str(exc), worker=self.id) from exc
        finally:
            await chunks.aclose()  # closed early: the engine aborts the request before we return

    async def control(self, op: Command) -> None:
        e = self.engine
        match op:
            case AbortRequest():
                await e.abort(op.request_id)
            case AbortAll():
                await e.abort_all()
            case Pause():
                await e.pause(op.mode)
            case Resume():
                await e.resume()
            case FlushCache():
                await e.flush_cache(op.wait_s)  # deferred until idle, as the HTTP route does
            case InitWeightGroup():
                g = op.group
                await e.init_weight_group(
                    g.master_address,
                    g.master_port,
                    op.rank_offset,
                    g.world_size,
                    group_name=g.group_name,
                    backend=g.backend,
                )
            case DestroyWeightGroup():
                await e.destroy_weight_group(op.group_name)
            case UpdateFromDistributed():
                b = op.bucket
                await e.update_weights_from_distributed(
                    b.names,
                    b.dtypes,
                    b.shapes,
                    group_name=op.group_name,
                    version=op.version,
                    flush_cache=op.flush_cache,
                )
            case UpdateFromTensors():
                await e.update_weights_from_tensors(
                    list(op.tensors.items), version=op.version, flush_cache=op.flush_cache, load_format=op.load_format
                )
            case UpdateFromDisk():
                await e.update_weights_from_disk(
                    op.path, load_format=op.load_format, version=op.version, flush_cache=op.flush_cache
                )
            case BeginWeightUpdate():
                await e.begin_weight_update(op.selector)
            case EndWeightUpdate():
                await e.end_weight_update()
            case SetVersion():
                await e.set_weight_version(op.version)
            case ReleaseMemory():
                await e.release_memory(op.tags)
            case ResumeMemory():
                await e.resume_memory(op.tags)
            case _:
                unhandled(op)

    async def probe(self, op: Probe) -> bool | None:
        h = self.engine.health()
        match op:
            case Live():
                if not h.live:
                    raise BackendUnavailable("engine closed", worker=self.id)
                return True
            case Ready():
                if h.ready or not h.live:
                    return h.ready
                why = [f"paused ({h.paused.value})"] if h.paused is not None else []
                why += [f"{t.value} released" for t in h.released if t is not MemoryTag.CUDA_GRAPH]
                if why:
                    raise BackendUnavailable(", ".join(why), worker=self.id)
                return False
            case Progress():
                # A paused or memory-released engine would block the probe: no progress.
                return h.ready and await self._generates_one_token()
            case _:
                unhandled(op)

    async def _generates_one_token(self) -> bool:
        request = GenerateRequest(
            input_ids=(0,),
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
            worker=self.id,
        )
        try:
            gen = await asyncio.wait_for(self.engine.generate(request), _PROBE_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineError):
            return False
        return len(gen.output_ids) == 1

    async def served_version(self) -> str | None:
        return self.engine.weight_version

    async def aclose(self) -> None:
        if self._owns:
            await self.engine.aclose()

    def __repr__(self) -> str:
        return f"<ReferenceDriver {self.engine!r}>"


class ReferenceBackend(Fleet):
    """The fleet over in-process ``ReferenceEngine``s: round-robin routing, pinning by worker id.

    Only construction and engine access are here; the protocol is ``Fleet``'s.
    """

    def __init__(self, engines: Sequence[ReferenceEngine], *, owns_engines: bool = True) -> None:
        if not engines:
            raise InvalidRequest("engines", "a reference fleet needs at least one engine")
        first = engines[0]
        caps = Capabilities(
            pause_modes=set(PauseMode),
            weight_transports=set(WeightTransport),
            memory_release=True,
            logprobs=True,
            top_logprobs=20,  # SamplingParams' limit
            prompt_logprobs=True,
            stop_strings=all(e.has_tokenizer for e in engines),
            streaming=True,  # the scheduler's steps (ReferenceEngine.stream)
            routing=RoutingKind.ROUND_ROBIN if len(engines) > 1 else RoutingKind.SINGLE,
            abort=True,
            seeded_sampling=True,
            begin_end_update=True,
            flattened_buckets=True,  # the driver hands the engine the bucket's views
            version_source=VersionSource.RESPONSE,
            cached_tokens=True,
            worker_pinning=True,
            progress_probe=True,  # Progress: a 1-token generation on the engine (ReferenceDriver.probe)
            version_constraints=True,
            version_spans=VersionSource.RESPONSE,  # the engine records the version of every token
            stream_version_spans=True,  # each streamed chunk carries the engine's version
            # RETRACT drops the parked requests' KV and the engine flushes with them parked (a known
            # difference from SGLang 0.5.16, docs/pause-modes.md).
            update_while_parked=True,
            batch_invariant=True,  # every request runs alone through the model (no padded batches)
            max_context=first.max_context,
            vocab_size=first.vocab_size,
            model_path=str(first.model_path),
        )
        drivers = [ReferenceDriver(e, caps, owns_engine=owns_engines) for e in engines]
        super().__init__(drivers, capabilities=caps, name="reference")
        self._engines: dict[str, ReferenceEngine] = {e.worker_id: e for e in engines}
        for e in engines:
            self.set_installed_version(e.weight_version, [e.worker_id])

    @classmethod
    def create(
        cls,
        model_path: str | os.PathLike[str] | None = None,
        *,
        workers: int = 1,
        seed: int = 0,
        size: str = "tiny",
        num_threads: int = 1,
        page_size: int = 16,
        weight_version: str = "default",
        worker_prefix: str = "ref",
    ) -> ReferenceBackend:
        """Build ``workers`` engines on ``model_path`` (or on a cached tiny model made from ``seed``).

        Synchronous (loading is CPU work); engines bind to the event loop on first use.
        """
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidRequest("workers", f"must be an int >= 1, got {workers!r}")
        if size not in SIZES:
            raise InvalidRequest("size", f"unknown size {size!r} (known: {sorted(SIZES)})")
        path = Path(model_path) if model_path is not None else cached_tiny_model(seed, size)
        engines = [
            ReferenceEngine(
                path,
                worker_id=f"{worker_prefix}-{i}",
                page_size=page_size,
                weight_version=weight_version,
                num_threads=num_threads,
            )
            for i in range(workers)
        ]
        return cls(engines)

    def engine(self, worker: str) -> ReferenceEngine:
        """The engine behind a worker id (for tests and debugging)."""
        self.driver(worker)
        return self._engines[worker]

    @property
    def engines(self) -> tuple[ReferenceEngine, ...]:
        return tuple(self._engines[w] for w in self.workers)


def open_from_url(url: str, **kw: Any) -> ReferenceBackend:
    """Registry entry point: ``reference://?workers=2&seed=0`` or ``reference:///path/to/model?workers=2``.

    Query keys: ``workers``, ``seed``, ``size``, ``num_threads``, ``page_size``, ``weight_version``;
    keyword arguments override them. The path (if any) is the model directory.
    """
    parsed = urlparse(url)
    if parsed.scheme != "reference":
        raise InvalidRequest("url", f"expected a reference:// URL, got scheme {parsed.scheme!r}")
    if parsed.netloc:
        raise InvalidRequest("url", "use reference:///abs/path (three slashes) for a model path")
    ints = {"workers", "seed", "num_threads", "page_size"}
    strs = {"size", "weight_version"}
    opts: dict[str, Any] = {}
    for key, values in parse_qs(parsed.query, keep_blank_values=True, strict_parsing=False).items():
        if key not in ints | strs:
            raise InvalidRequest(f"url.{key}", f"unknown option (known: {sorted(ints | strs)})")
        value = values[-1]
        if key in ints:
            try:
                opts[key] = int(value)
            except ValueError:
                raise InvalidRequest(f"url.{key}", f"must be an int, got {value!r}") from None
        else:
            opts[key] = value
    opts.update(kw)
    path = unquote(parsed.path) or None
    return ReferenceBackend.create(path, **opts)
