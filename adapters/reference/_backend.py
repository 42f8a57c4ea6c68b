"""``ReferenceBackend``: the full ``RolloutBackend`` protocol, in process, over N ReferenceEngines.

It is the backend the conformance suite is validated against and the one RL code can be unit
tested with on CPU: every capability is declared, and every numeric result is reproducible.
Engine refusals (``EngineError``) become ``ControlFailed`` naming the worker, through ``fan_out``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from rollout_backends import (
    BackendUnavailable,
    Capabilities,
    GenerateRequest,
    Generation,
    HealthReport,
    InvalidRequest,
    MemoryTag,
    PauseMode,
    RoutingKind,
    SamplingParams,
    VersionSource,
    WeightBucket,
    WeightGroup,
    WeightTransport,
    WorkerHealth,
)
from rollout_backends.kit import BackendBase, VersionBook, ensure_tags, fan_out

from ._engine import EngineError, ReferenceEngine
from ._model import SIZES, make_tiny_model

__all__ = ["ReferenceBackend", "cached_tiny_model", "default_cache_dir", "open_from_url"]

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


class ReferenceBackend(BackendBase):
    """In-process backend over ``ReferenceEngine``s: round-robin routing, pinning by worker id."""

    def __init__(self, engines: Sequence[ReferenceEngine], *, owns_engines: bool = True) -> None:
        if not engines:
            raise ValueError("ReferenceBackend needs at least one engine")
        ids = [e.worker_id for e in engines]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids must be unique, got {ids}")
        self._engines: dict[str, ReferenceEngine] = {e.worker_id: e for e in engines}
        self._ids = tuple(ids)
        self._rr = itertools.cycle(self._ids)
        self._owns = owns_engines
        first = engines[0]
        self._versions = VersionBook(ids)
        for e in engines:
            self._versions.record(e.weight_version, [e.worker_id])
        self.capabilities = Capabilities(
            pause_modes=set(PauseMode),
            weight_transports=set(WeightTransport),
            memory_release=True,
            logprobs=True,
            top_logprobs=20,  # SamplingParams' limit
            streaming=False,
            routing=RoutingKind.ROUND_ROBIN if len(engines) > 1 else RoutingKind.SINGLE,
            abort=True,
            seeded_sampling=True,
            begin_end_update=True,
            version_source=VersionSource.RESPONSE,
            cached_tokens=True,
            worker_pinning=True,
            batch_invariant=True,  # every request runs alone through the model (no padded batches)
            max_context=first.max_context,
            vocab_size=first.vocab_size,
        )

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

    # -- introspection ----------------------------------------------------------------------

    @property
    def workers(self) -> tuple[str, ...]:
        return self._ids

    def engine(self, worker: str) -> ReferenceEngine:
        """The engine behind a worker id (for tests and debugging)."""
        try:
            return self._engines[worker]
        except KeyError:
            raise InvalidRequest("worker", f"unknown worker {worker!r} (known: {list(self._ids)})") from None

    @property
    def engines(self) -> tuple[ReferenceEngine, ...]:
        return tuple(self._engines[w] for w in self._ids)

    # -- data plane -------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> Generation:
        if request.worker is not None:
            if request.worker not in self._engines:
                raise InvalidRequest("worker", f"unknown worker {request.worker!r} (known: {list(self._ids)})")
            worker = request.worker
        else:
            worker = next(self._rr)
        try:
            return await self._engines[worker].generate(request)
        except EngineError as exc:
            raise BackendUnavailable(str(exc), worker=worker) from exc

    async def abort(self, request_id: str) -> None:
        for engine in self._engines.values():
            await engine.abort(request_id)

    async def abort_all(self, *, workers: Sequence[str] | None = None) -> None:
        await fan_out("abort_all", self._select(workers), lambda w: self._engines[w].abort_all())

    # -- pause ------------------------------------------------------------------------------

    async def pause(self, mode: PauseMode = PauseMode.RETRACT, *, workers: Sequence[str] | None = None) -> None:
        m = self._require_pause_mode(mode)
        await fan_out("pause", self._select(workers), lambda w: self._engines[w].pause(m))

    async def resume(self, *, workers: Sequence[str] | None = None) -> None:
        await fan_out("resume", self._select(workers), lambda w: self._engines[w].resume())

    # -- weights ----------------------------------------------------------------------------

    async def init_weight_group(self, group: WeightGroup, *, workers: Sequence[str] | None = None) -> None:
        selected = self._select(workers)
        if group.rank_offset + len(selected) > group.world_size:
            raise InvalidRequest(
                "group.world_size",
                f"{len(selected)} worker(s) from rank {group.rank_offset} do not fit in world_size {group.world_size}",
            )
        ranks = {w: group.rank_offset + i for i, w in enumerate(selected)}
        await fan_out(
            "init_weight_group",
            selected,
            lambda w: self._engines[w].init_weight_group(
                group.master_address,
                group.master_port,
                ranks[w],
                group.world_size,
                group_name=group.group_name,
                backend=group.backend,
            ),
        )

    async def update_weights_from_distributed(
        self,
        bucket: WeightBucket,
        *,
        group_name: str = "weight_update_group",
        version: str | None = None,
        flush_cache: bool = True,
        workers: Sequence[str] | None = None,
    ) -> None:
        if not isinstance(bucket, WeightBucket):
            raise InvalidRequest("bucket", f"must be a WeightBucket, got {type(bucket).__name__}")
        selected = self._select(workers)
        await fan_out(
            "update_weights_from_distributed",
            selected,
            lambda w: self._engines[w].update_weights_from_distributed(
                bucket.names,
                bucket.dtypes,
                bucket.shapes,
                group_name=group_name,
                version=version,
                flush_cache=flush_cache,
            ),
        )
        self._versions.relabelled(version, selected)

    async def destroy_weight_group(
        self, group_name: str = "weight_update_group", *, workers: Sequence[str] | None = None
    ) -> None:
        await fan_out(
            "destroy_weight_group", self._select(workers), lambda w: self._engines[w].destroy_weight_group(group_name)
        )

    async def update_weights_from_tensors(
        self,
        named_tensors: Sequence[tuple[str, Any]],
        *,
        version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
        workers: Sequence[str] | None = None,
    ) -> None:
        named = list(named_tensors)
        selected = self._select(workers)
        await fan_out(
            "update_weights_from_tensors",
            selected,
            lambda w: self._engines[w].update_weights_from_tensors(
                named, version=version, flush_cache=flush_cache, load_format=load_format
            ),
        )
        self._versions.relabelled(version, selected)

    async def update_weights_from_disk(
        self,
        path: str,
        *,
        version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        workers: Sequence[str] | None = None,
    ) -> None:
        selected = self._select(workers)
        await fan_out(
            "update_weights_from_disk",
            selected,
            lambda w: self._engines[w].update_weights_from_disk(
                path, load_format=load_format, version=version, flush_cache=flush_cache
            ),
        )
        self._versions.relabelled(version, selected)

    async def begin_weight_update(self, selector: str = "all", *, workers: Sequence[str] | None = None) -> None:
        await fan_out("begin", self._select(workers), lambda w: self._engines[w].begin_weight_update(selector))

    async def end_weight_update(self, *, workers: Sequence[str] | None = None) -> None:
        await fan_out("end", self._select(workers), lambda w: self._engines[w].end_weight_update())

    async def set_weight_version(self, version: str, *, workers: Sequence[str] | None = None) -> None:
        if not isinstance(version, str) or not version:
            raise InvalidRequest("version", "must be a non-empty string")
        selected = self._select(workers)
        await fan_out("set_weight_version", selected, lambda w: self._engines[w].set_weight_version(version))
        self._versions.relabelled(version, selected)

    async def weight_versions(self) -> Mapping[str, str | None]:
        return {w: self._engines[w].weight_version for w in self._ids}

    async def flush_cache(self, *, workers: Sequence[str] | None = None) -> None:
        await fan_out("flush_cache", self._select(workers), lambda w: self._engines[w].flush_cache())

    # -- memory -----------------------------------------------------------------------------

    async def release_memory(
        self, tags: Sequence[MemoryTag | str] | None = None, *, workers: Sequence[str] | None = None
    ) -> None:
        checked = ensure_tags(tags)
        await fan_out("release_memory", self._select(workers), lambda w: self._engines[w].release_memory(checked))

    async def resume_memory(
        self, tags: Sequence[MemoryTag | str] | None = None, *, workers: Sequence[str] | None = None
    ) -> None:
        checked = ensure_tags(tags)
        await fan_out("resume_memory", self._select(workers), lambda w: self._engines[w].resume_memory(checked))

    # -- health / lifecycle -----------------------------------------------------------------

    async def _probe(self, worker: str) -> bool:
        request = GenerateRequest(
            input_ids=(0,),
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
            worker=worker,
        )
        try:
            gen = await asyncio.wait_for(self._engines[worker].generate(request), _PROBE_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineError):
            return False
        return len(gen.output_ids) == 1

    async def health(self, *, probe: bool = False) -> HealthReport:
        expected = self._versions.expected
        out: list[WorkerHealth] = []
        for w in self._ids:
            h = self._engines[w].health()
            progress: bool | None = None
            if probe:
                # A paused or memory-released engine would block the probe: report no progress.
                progress = await self._probe(w) if h.ready else False
            error = None
            if not h.ready and h.live:
                why = [f"paused ({h.paused.value})"] if h.paused is not None else []
                why += [f"{t.value} released" for t in h.released if t is not MemoryTag.CUDA_GRAPH]
                error = ", ".join(why) or None
            out.append(
                WorkerHealth(
                    worker=w,
                    live=h.live,
                    ready=h.ready,
                    making_progress=progress,
                    weight_version=h.weight_version,
                    stale=VersionBook.is_stale(h.weight_version, expected=expected, live=h.live),
                    error=error if h.live else "engine closed",
                )
            )
        return HealthReport(workers=tuple(out), expected_version=expected, router_live=None)

    async def aclose(self) -> None:
        if self._owns:
            for engine in self._engines.values():
                await engine.aclose()


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
