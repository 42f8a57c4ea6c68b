"""ai-dynamo 1.4.2's real ``DecodeWorkerHandler`` under the shim's patches, with SGLang stubbed out.

``python -m tests.dynamo.real_handler MODEL_DIR`` prints one JSON object (see ``main``).
Run in a subprocess (``test_sglang_shim.py``): it installs an import hook that answers every
``sglang.*`` import with a stub module, which must not leak into other tests.

SGLang itself cannot run on a CPU, but the handler code that the shim wraps is pure Python in
the ai-dynamo wheel: ``generate`` → ``_process_token_stream`` → ``_extract_logprobs`` (the
patched extractor) and ``_cancellation_monitor``, and ``RLMixin._normalize_result``. The engine
here streams what SGLang 0.5.16's ``Engine.async_generate(stream=True)`` yields under
``incremental_streaming_output`` (per-chunk ``output_ids`` and logprobs, cumulative
``completion_tokens``, ``meta_info.id``), and finishes a request with ``abort`` one chunk after
``tokenizer_manager.abort_request(rid)``, as SGLang's scheduler does for a running request.
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import json
import sys
import types
from collections.abc import AsyncIterator
from typing import Any


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


class _StubClass(type):
    """A stub class whose every attribute is a no-op function (``sgl.Engine.async_generate``)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: None


class _DataclassStubModule(types.ModuleType):
    """Each name an empty dataclass pydantic can build a schema for (1.6.x's
    ``TypeAdapter(GenerateReqInput)`` at import)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        import dataclasses

        value = dataclasses.dataclass(_StubClass(name, (), {}))
        setattr(self, name, value)
        return value


class _StubSGLang(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of ``roots`` (``sglang`` by default) with stub modules."""

    def __init__(self, roots: tuple[str, ...] = ("sglang",), *, dataclasses: bool = False) -> None:
        self.roots = roots
        self.module = _DataclassStubModule if dataclasses else _StubModule

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".", 1)[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return self.module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # type: ignore[attr-defined]


class Context:
    """The parts of ``dynamo._core.Context`` the handler uses."""

    def __init__(self, cid: str) -> None:
        self._id = cid
        self.trace_id = None  # what the 1.4.2 frontend gives (SGLang then names the request)
        self._stopped: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def id(self) -> str:
        return self._id

    def is_stopped(self) -> bool:
        return self._stopped.done()

    def async_killed_or_stopped(self) -> asyncio.Future[None]:
        return self._stopped

    def trace_headers(self) -> dict[str, str]:
        return {}


class TokenizerManager:
    def __init__(self, model_path: str) -> None:
        self.server_args = types.SimpleNamespace(weight_version="v7", model_path=model_path, tokenizer_path=None)
        self.aborted: list[str] = []

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:  # synchronous in 0.5.16
        self.aborted.append("*" if abort_all else rid)

    async def get_internal_state(self) -> list[dict[str, Any]]:
        """SGLang 0.5.16 (``TokenizerControlMixin.get_internal_state``): one state per DP rank, each
        ``vars(ServerArgs)`` and load figures (``Scheduler.get_internal_state``); here two ranks of a
        server run without ``--enable-memory-saver``."""
        state = {**vars(self.server_args), "enable_memory_saver": False, "last_gen_throughput": 0.0}
        return [dict(state), dict(state)]


class Engine:
    """``async_generate(stream=True)`` of SGLang 0.5.16 with incremental streaming output."""

    def __init__(self, tm: TokenizerManager, scripts: dict[str, list[list[int]]]) -> None:
        self.tokenizer_manager = tm
        self.scripts = scripts  # first prompt token -> chunks of output ids
        self.n = 0

    async def async_generate(self, input_ids: list[int], sampling_params: dict[str, Any], stream: bool,
                             rid: str | None = None, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        self.n += 1
        sid = rid or f"sg-{self.n}"
        chunks = self.scripts[str(input_ids[0])]
        tm = self.tokenizer_manager

        # A prompt starting with 7 waits in SGLang's queue when aborted (e.g. parked by RETRACT):
        # TokenizerManager._handle_abort_req answers with the last token again and the
        # cumulative logprobs, completion_tokens unchanged.
        waiting = input_ids[0] == 7
        top_k = int(kwargs.get("top_logprobs_num") or 0)
        # logprob_start_len=0: SGLang scores the prompt from position 0 (the first logprob None).
        prompt_lps = (
            [(None if k == 0 else -0.5 * k, t, None) for k, t in enumerate(input_ids)]
            if kwargs.get("logprob_start_len") == 0
            else None
        )

        async def stream_() -> AsyncIterator[dict[str, Any]]:
            done = 0
            for i, ids in enumerate(chunks):
                await asyncio.sleep(0.01)
                aborted = sid in tm.aborted
                if aborted and waiting and done:
                    cumulative = [(-0.01 * (k + 1), t, None) for k, t in enumerate(t for c in chunks[:i] for t in c)]
                    meta = {"id": sid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                            "completion_tokens": done, "weight_version": tm.server_args.weight_version,
                            "output_token_logprobs": cumulative}  # fmt: skip
                    yield {"output_ids": [chunks[i - 1][-1]], "meta_info": meta, "index": 0}
                    return
                last = i == len(chunks) - 1 or aborted
                finish = {"type": "abort", "message": "Abort"} if aborted else ({"type": "length"} if last else None)
                done += len(ids)
                meta = {
                    "id": sid, "finish_reason": finish, "prompt_tokens": len(input_ids),
                    "completion_tokens": done, "cached_tokens": 0, "weight_version": tm.server_args.weight_version,
                    "output_token_logprobs": [(-0.01 * (done - len(ids) + k + 1), t, None) for k, t in enumerate(ids)],
                }  # fmt: skip
                if top_k:  # per chunk under incremental streaming output, [logprob, id, text] each
                    meta["output_top_logprobs"] = [
                        [
                            (-0.01 * (done - len(ids) + k + 1), t, None),
                            *((-9.0 - j, 900 + j, None) for j in range(top_k - 1)),
                        ]
                        for k, t in enumerate(ids)
                    ]
                if prompt_lps is not None and done == len(ids):
                    meta["input_token_logprobs"] = prompt_lps
                yield {"output_ids": ids, "meta_info": meta, "index": 0}
                if last:
                    return

        return stream_()


def _handler(cls: Any, model_path: str, scripts: dict[str, list[list[int]]]) -> Any:
    from dynamo.common.constants import DisaggregationMode
    from dynamo.common.utils.input_params import InputParamManager

    h = object.__new__(cls)
    h.serving_mode = DisaggregationMode.AGGREGATED
    h.use_sglang_tokenizer = False
    h.enable_trace = False
    h._enable_frontend_decoding = False
    h._image_loader = None
    h._mm_hashes_supported = False
    h._routed_experts_kwargs = {}
    h._engine_supports_priority = False
    h.lora_id_for_name = {}
    h.shutdown_event = None
    h.input_param_manager = InputParamManager(None)
    h.config = types.SimpleNamespace(
        dynamo_args=types.SimpleNamespace(enable_rl=False), server_args=types.SimpleNamespace()
    )
    h.engine = Engine(TokenizerManager(model_path), scripts)
    return h


def _request(prompt: list[int], rid: str, **extra: Any) -> dict[str, Any]:
    return {
        "token_ids": prompt, "annotations": [f"rid:{rid}"], "stop_conditions": {"max_tokens": 64, "ignore_eos": True},
        "sampling_options": {"temperature": 0.0}, "output_options": {"logprobs": 0}, "eos_token_ids": [], **extra,
    }  # fmt: skip


async def _run(model_path: str) -> dict[str, Any]:
    sys.meta_path.insert(0, _StubSGLang())
    from dynamo.sglang.request_handlers.handler_base import RLMixin
    from dynamo.sglang.request_handlers.llm.decode_handler import DecodeWorkerHandler

    from rollout_backends.adapters.dynamo import _sglang_shim as shim

    patched = {
        "logprobs": shim.patch_logprobs(),
        "token_stream": shim.patch_token_stream(DecodeWorkerHandler),
        "control_results": shim.patch_control_results(RLMixin),
    }
    six = [[21], [22], [23], [24], [25], [26]]
    # The reference engine's greedy run for [5, 6, 7, 8] on the tiny model ("Jran6eld bell..."), 2 per output.
    free = [44, 374, 24, 483, 493, 391, 380, 133, 273, 494, 226, 355, 241, 6, 147, 106]
    scripts = {
        "5": [[11], [12, 13], [14]],
        "6": six,
        "7": six,
        "387": [[102, 129, 146], [112]],
        "9": [free[i : i + 2] for i in range(0, len(free), 2)],
    }
    h = _handler(DecodeWorkerHandler, model_path, scripts)

    async def collect(req: dict[str, Any], cid: str) -> list[dict[str, Any]]:
        return [o async for o in h.generate(req, Context(cid))]

    out: dict[str, Any] = {"patched": patched}
    out["plain"] = await collect(_request([5, 1], "r-plain"), "c1")
    shim.allow_top_logprobs()
    scored = {"logprobs": 2, "prompt_logprobs": 0, "return_tokens_as_token_ids": True}
    out["top_and_prompt"] = await collect(_request([5, 1, 3], "r-top", output_options=scored), "c1b")
    out["text"] = await collect(_request([387, 370, 121, 139], "r-text"), "c2")
    out["text_stop_strings"] = await collect(
        _request([387, 370, 121, 139], "r-stop", stop_conditions={"max_tokens": 8, "stop": ["zz"]}), "c3"
    )
    # Abort one request by our id while it streams: through the shim's registry to SGLang's id.
    task = asyncio.ensure_future(collect(_request([6, 1], "r-abort"), "c4"))
    await asyncio.sleep(0.025)
    out["abort_found"] = shim.REQUESTS.abort("r-abort")
    out["aborted"] = await task
    task = asyncio.ensure_future(collect(_request([7, 1], "r-waiting"), "c5"))
    await asyncio.sleep(0.025)
    shim.REQUESTS.abort("r-waiting")
    out["aborted_waiting"] = await task
    out["abort_calls"] = list(h.engine.tokenizer_manager.aborted)
    # Stop strings for the shim to match (patch 8), as the wire sends them: not in stop_conditions.
    stop = _request([9, 6, 7, 8], "r-stop-shim", annotations=["rid:r-stop-shim", 'stop-strings:["an"]'])
    out["shim_stop_strings"] = await collect(stop, "c6")
    out["shim_stop_abort_calls"] = h.engine.tokenizer_manager.aborted[len(out["abort_calls"]) :]
    out["registry_empty"] = not shim.REQUESTS.by_context and not shim.REQUESTS.by_rid
    import msgspec

    class FlushCacheReqOutput(msgspec.Struct):  # SGLang 0.5.16's io_struct shape
        rid: Any = None
        http_worker_ipc: Any = None
        success: bool = False
        message: str = ""

    out["flush_result"] = h._normalize_result(FlushCacheReqOutput(success=False, message="not idle"))
    out["tuple_result"] = h._normalize_result((True, "ok"))
    # What POST /engine/call_tokenizer_manager answers (1.4.2's own passthrough, the shim's patch on).
    out["internal_state"] = await h.call_tokenizer_manager({"method": "get_internal_state", "args": [], "kwargs": {}})
    return out


def main() -> None:
    print(json.dumps(asyncio.run(_run(sys.argv[1])), default=str))


if __name__ == "__main__":
    main()
