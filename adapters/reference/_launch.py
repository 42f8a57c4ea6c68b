"""The reference server as an engine command (CPU): ``python -m rollout_backends.adapters.reference.serve``."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rollout_backends._fleet import HttpFleetBackend
from rollout_backends._launch import EngineInfo, Launch, NodeContext
from rollout_backends._supervisor import ProcessSpec, ReadyCheck

__all__ = ["ReferenceServerCommand"]


def _str_tuple(value: Sequence[Any] | None) -> tuple[str, ...]:
    return tuple(str(v) for v in (value or ()))


def _env_map(value: Mapping[str, str] | None) -> Mapping[str, str]:
    return dict(value or {})


@attrs.frozen(kw_only=True)
class ReferenceServerCommand:
    """One reference server (SGLang-native HTTP API over a ``ReferenceEngine``) per engine.

    ``model_path`` must exist on the engine's node (shared storage), or pass ``make_model_seed``
    to have each server write the seeded tiny model there first (one path per node: two servers
    on one host must not share a path they both create).
    """

    model_path: str
    weight_version: str = "default"
    page_size: int = 16
    num_threads: int = 1
    make_model_seed: int | None = None
    served_model_name: str | None = None
    extra_args: tuple[str, ...] = attrs.field(factory=tuple, converter=_str_tuple)
    env: Mapping[str, str] = attrs.field(factory=dict, converter=_env_map)
    python: str | None = None
    grace: float = 5.0

    def build(self, ctx: NodeContext) -> Launch:
        port = ctx.port()
        url = ctx.url(port)
        argv = [
            self.python or sys.executable, "-m", "rollout_backends.adapters.reference.serve",
            "--model-path", self.model_path,
            "--host", ctx.bind_host, "--port", str(port),
            "--worker-id", f"{ctx.advertise_host}:{port}",
            "--weight-version", self.weight_version,
            "--page-size", str(self.page_size),
            "--num-threads", str(self.num_threads),
        ]  # fmt: skip
        if self.make_model_seed is not None:
            argv += ["--make-model", str(self.make_model_seed)]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        env: dict[str, str | None] = {
            "OMP_NUM_THREADS": str(self.num_threads),
            # /health answers without running a generation (the router probes it every second).
            "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
        }
        env.update(self.env)
        spec = ProcessSpec(
            name=f"reference-{ctx.index}",
            argv=[*argv, *self.extra_args],
            env=env,
            ready=ReadyCheck.http(f"{url}/health"),
            ports=[(ctx.bind_host, port)],
            grace=self.grace,
        )
        return Launch(spec=spec, generate_url=url, control_url=url)

    async def connect(self, entry_url: str | None, engines: Sequence[EngineInfo], **kwargs: Any) -> HttpFleetBackend:
        from rollout_backends.adapters.sglang._launch import connect_engines

        return await connect_engines(entry_url, engines, **kwargs)
