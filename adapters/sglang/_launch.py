"""Launch commands for SGLang-native engines and the smg router (see ``rollout_backends._launch``).

* :class:`SGLangServerCommand`: ``python -m sglang.launch_server`` on the engine's GPUs.
* :class:`SmgRouter`: ``python -m smg.launch_router`` in front of the engines (the fleet's
  generation entry); control calls still go to each engine.
* :func:`connect_engines`: ``connect(entry or engine 0, workers=[every engine])``.

The reference server's command (CPU) is ``rollout_backends.adapters.reference.ReferenceServerCommand``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rollout_backends._errors import InvalidRequest
from rollout_backends._fleet import HttpFleetBackend
from rollout_backends._launch import EngineInfo, Launch, NodeContext
from rollout_backends._supervisor import ProcessSpec, ReadyCheck

__all__ = ["SGLangServerCommand", "SmgRouter", "connect_engines"]


def _str_tuple(value: Sequence[Any] | None) -> tuple[str, ...]:
    return tuple(str(v) for v in (value or ()))


def _env_map(value: Mapping[str, str] | None) -> Mapping[str, str]:
    return dict(value or {})


async def connect_engines(entry_url: str | None, engines: Sequence[EngineInfo], **kwargs: Any) -> HttpFleetBackend:
    """The SGLang backend: generation to ``entry_url`` (a router) or, without one, to engine 0;
    control calls to every engine."""
    from rollout_backends.adapters.sglang._client import connect

    urls = [e.generate_url for e in engines]
    if any(u is None for u in urls):
        raise InvalidRequest("engines", "every SGLang-native engine needs a generation URL")
    workers = [u for u in urls if u is not None]
    return await connect(entry_url or workers[0], workers=workers, **kwargs)


@attrs.frozen(kw_only=True)
class SGLangServerCommand:
    """``python -m sglang.launch_server`` for one engine (TP over the GPUs the launcher assigned).

    ``CUDA_VISIBLE_DEVICES`` is set to the context's ``gpu_ids`` (Ray's assignment), so
    ``--base-gpu-id`` stays 0. ``extra_args`` are passed as they are (``--mem-fraction-static``...).
    """

    model_path: str
    tp: int = 1
    served_model_name: str | None = None
    page_size: int | None = None
    extra_args: tuple[str, ...] = attrs.field(factory=tuple, converter=_str_tuple)
    env: Mapping[str, str] = attrs.field(factory=dict, converter=_env_map)
    python: str | None = None
    grace: float = 30.0
    ready_path: str = "/health"

    def build(self, ctx: NodeContext) -> Launch:
        port = ctx.port()
        nccl = ctx.port()
        argv = [
            self.python or sys.executable, "-m", "sglang.launch_server",
            "--model-path", self.model_path,
            "--host", ctx.bind_host, "--port", str(port), "--nccl-port", str(nccl),
            "--tp-size", str(self.tp), "--base-gpu-id", "0",
        ]  # fmt: skip
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        if self.page_size is not None:
            argv += ["--page-size", str(self.page_size)]
        env: dict[str, str | None] = dict(self.env)
        if ctx.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ctx.gpu_ids)
        url = ctx.url(port)
        spec = ProcessSpec(
            name=f"sglang-{ctx.index}",
            argv=[*argv, *self.extra_args],
            env=env,
            ready=ReadyCheck.http(f"{url}{self.ready_path}", check_timeout=10.0),
            ports=[(ctx.bind_host, port), (ctx.bind_host, nccl)],
            grace=self.grace,
        )
        return Launch(spec=spec, generate_url=url, control_url=url, extra={"nccl_port": nccl})

    async def connect(self, entry_url: str | None, engines: Sequence[EngineInfo], **kwargs: Any) -> HttpFleetBackend:
        return await connect_engines(entry_url, engines, **kwargs)


@attrs.frozen(kw_only=True)
class SmgRouter:
    """``python -m smg.launch_router`` with the engines as static workers (``docs/smg-notes.md``)."""

    policy: str = "round_robin"
    extra_args: tuple[str, ...] = attrs.field(factory=tuple, converter=_str_tuple)
    python: str | None = None
    #: smg keeps its listener open ~5 s after SIGTERM (load-balancer settle window).
    grace: float = 8.0

    def build(self, ctx: NodeContext, engines: Sequence[EngineInfo]) -> Launch:
        port = ctx.port()
        prom = ctx.port()
        workers = [e.generate_url for e in engines if e.generate_url]
        argv = [
            self.python or sys.executable, "-m", "smg.launch_router",
            "--host", ctx.bind_host, "--port", str(port),
            "--prometheus-host", ctx.bind_host, "--prometheus-port", str(prom),
            "--policy", self.policy,
            "--log-dir", f"{ctx.log_dir}/smg", "--log-level", "warn",
            "--disable-tokenizer-autoload",
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--worker-startup-check-interval", "1",
            "--worker-urls", *workers,
            *self.extra_args,
        ]  # fmt: skip
        url = ctx.url(port)
        spec = ProcessSpec(
            name="router",
            argv=argv,
            ready=ReadyCheck.http(f"{url}/readiness"),
            ports=[(ctx.bind_host, port), (ctx.bind_host, prom)],
            grace=self.grace,
        )
        return Launch(spec=spec, generate_url=url, control_url=url)

    async def connect(self, entry_url: str, engines: Sequence[EngineInfo], **kwargs: Any) -> HttpFleetBackend:
        known = ("round_robin", "random", "cache_aware")
        kwargs.setdefault("routing", self.policy if self.policy in known else "other")
        return await connect_engines(entry_url, engines, **kwargs)
