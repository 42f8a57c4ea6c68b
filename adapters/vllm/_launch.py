"""``vllm serve`` (0.26) as a launch command (see ``rollout_backends.launch``).

The server runs ``python -m vllm.entrypoints.openai.api_server`` with ``VLLM_SERVER_DEV_MODE=1``
(the RL and dev routes the adapter drives) on the GPUs the launcher assigned it; ``connect`` builds
the backend of a fleet without a router (unpinned requests go to each server in turn).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rollout_backends import InvalidRequest
from rollout_backends.kit import HttpFleetBackend
from rollout_backends.launch import EngineInfo, Launch, NodeContext, ProcessSpec, ReadyCheck, env_map, str_tuple

from ._wire import TRANSFER_BACKENDS

__all__ = ["VllmServerCommand"]


@attrs.frozen(kw_only=True)
class VllmServerCommand:
    """One ``vllm serve`` server per engine (TP over the GPUs the launcher assigned).

    Defaults keep start-up short and the answers what the adapter reads: ``--enforce-eager`` (no
    CUDA graph capture), ``--attention-backend TRITON_ATTN`` (no flash-attn kernels needed),
    ``--logprobs-mode processed_logprobs`` (logprobs of the distribution sampled from: after
    temperature, as SGLang's, and after top-k/top-p/min-p, renormalised, unlike SGLang's:
    ``Capabilities.filtered_logprobs``; ``docs/vllm.md``), ``--max-logprobs 21`` (20 top logprobs, asked one
    more: ``VllmWire.top_logprobs``), ``--enable-prompt-tokens-details`` (cached-token counts).
    ``transfer_backend`` (``nccl`` / ``ipc``) adds ``--weight-transfer-config``; ``ipc`` also sets
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (the pickled CUDA IPC handles need it). ``None`` / ``False``
    leaves a flag out. ``extra_args`` go last. Port by role (``NodeContext.fixed``): ``http``.
    """

    model_path: str
    served_model_name: str | None = None
    tp: int = 1
    enforce_eager: bool = True
    attention_backend: str | None = "TRITON_ATTN"
    logprobs_mode: str | None = "processed_logprobs"
    max_logprobs: int | None = 21
    prompt_tokens_details: bool = True
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    transfer_backend: str | None = None
    sleep_mode: bool = False
    seed: int | None = None
    batch_invariant: bool = False
    api_key: str | None = attrs.field(default=None, repr=False)
    extra_args: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
    env: Mapping[str, str] = attrs.field(factory=dict, converter=env_map)
    python: str | None = None
    grace: float = 15.0

    def __attrs_post_init__(self) -> None:
        if self.transfer_backend is not None and self.transfer_backend not in TRANSFER_BACKENDS:
            raise InvalidRequest(
                "transfer_backend", f"must be one of {sorted(TRANSFER_BACKENDS)}, got {self.transfer_backend!r}"
            )
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization < 1:
            raise InvalidRequest("gpu_memory_utilization", f"must be in (0, 1), got {self.gpu_memory_utilization}")

    def args(self) -> list[str]:
        """The flags after ``--model``/``--host``/``--port`` (what a ``dynamo.vllm`` worker takes too)."""
        argv: list[str] = []
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        if self.tp != 1:
            argv += ["--tensor-parallel-size", str(self.tp)]
        if self.enforce_eager:
            argv.append("--enforce-eager")
        if self.attention_backend:
            argv += ["--attention-backend", self.attention_backend]
        if self.logprobs_mode:
            argv += ["--logprobs-mode", self.logprobs_mode]
        if self.max_logprobs is not None:
            argv += ["--max-logprobs", str(self.max_logprobs)]
        if self.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.max_model_len is not None:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.transfer_backend is not None:
            argv += ["--weight-transfer-config", json.dumps({"backend": self.transfer_backend})]
        if self.sleep_mode:
            argv.append("--enable-sleep-mode")
        if self.seed is not None:
            argv += ["--seed", str(self.seed)]
        return argv

    def environment(self, ctx: NodeContext) -> dict[str, str | None]:
        """The server's environment: dev routes on, offline, its GPUs, then ``env``."""
        out: dict[str, str | None] = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        if self.transfer_backend == "ipc":
            out["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if self.batch_invariant:
            out["VLLM_BATCH_INVARIANT"] = "1"
        if ctx.gpu_ids:
            out["CUDA_VISIBLE_DEVICES"] = ",".join(ctx.gpu_ids)
        out.update(self.env)
        return out

    def build(self, ctx: NodeContext) -> Launch:
        port = ctx.port("http")
        url = ctx.url(port)
        argv = [
            self.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_path, "--host", ctx.bind_host, "--port", str(port),
            *self.args(),
        ]  # fmt: skip
        if self.prompt_tokens_details:
            argv.append("--enable-prompt-tokens-details")
        if self.api_key:
            argv += ["--api-key", self.api_key]
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        spec = ProcessSpec(
            name=f"vllm-{ctx.index}",
            argv=[*argv, *self.extra_args],
            env=self.environment(ctx),
            # /health answers once the engine is up and the server serves.
            ready=ReadyCheck.http(f"{url}/health", headers=headers, check_timeout=30.0),
            ports=[(ctx.bind_host, port)],
            grace=self.grace,
        )
        return Launch(spec=spec, generate_url=url, control_url=url)

    async def connect(self, entry_url: str | None, engines: Sequence[EngineInfo], **kwargs: Any) -> HttpFleetBackend:
        """The backend over ``engines`` (through ``entry_url`` where a router fronts them)."""
        from ._client import connect

        urls = [e.generate_url or e.control_url for e in engines]
        kwargs.setdefault("cached_tokens", self.prompt_tokens_details)
        kwargs.setdefault("api_key", self.api_key)
        return await connect(entry_url or urls[0], workers=urls, **kwargs)
