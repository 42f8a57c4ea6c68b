"""The reference server as an engine command (CPU): ``python -m rollout_backends.adapters.reference.serve``."""

from __future__ import annotations

import sys

import attrs

from rollout_backends.launch import Launch, NodeContext, ProcessSpec

from ..sglang._launch import NativeServerCommand

__all__ = ["ReferenceServerCommand"]


@attrs.frozen(kw_only=True)
class ReferenceServerCommand(NativeServerCommand):
    """One reference server (SGLang-native HTTP API over a ``ReferenceEngine``) per engine.

    ``model_path`` must exist on the engine's node (shared storage), or pass ``make_model_seed``
    to have each server write the seeded tiny model there first (one path per node: two servers
    on one host must not share a path they both create). Port by role (``NodeContext.fixed``): ``http``.
    """

    weight_version: str = "default"
    page_size: int = 16
    num_threads: int = 1
    make_model_seed: int | None = None
    #: ``--no-compute N``: a ``NoComputeEngine`` (no model; N fixed tokens at once); ``model_path``
    #: is then only the name the server reports.
    no_compute: int | None = None
    grace: float = 5.0

    def build(self, ctx: NodeContext) -> Launch:
        port = ctx.port("http")
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
        if self.no_compute is not None:
            argv += ["--no-compute", str(self.no_compute)]
        if self.make_model_seed is not None:
            argv += ["--make-model", str(self.make_model_seed)]
        argv += self._common_args()
        spec = ProcessSpec(
            name=f"reference-{ctx.index}",
            argv=[*argv, *self.extra_args],
            env=self._env(ctx, OMP_NUM_THREADS=str(self.num_threads)),
            ready=self._ready(f"{url}/health"),
            ports=[(ctx.bind_host, port)],
            grace=self.grace,
        )
        return Launch(spec=spec, generate_url=url, control_url=url)
