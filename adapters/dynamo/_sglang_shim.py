"""Run ``dynamo.sglang`` (ai-dynamo 1.4.x) with two in-process patches, no change to Dynamo's code.

``python -m rollout_backends.adapters.dynamo._sglang_shim <dynamo.sglang args>`` behaves like
``python -m dynamo.sglang <args>`` except:

1. **Per-token logprobs.** ``dynamo.sglang`` forces SGLang's ``incremental_streaming_output``, under
   which SGLang 0.5.16 slices ``meta_info.output_token_logprobs`` / ``output_top_logprobs`` to the
   current chunk (``_slice_streaming_output_meta_info``, and ``_coalesce_streaming_chunks``
   concatenates them when chunks queue up). ai-dynamo 1.4.2's
   ``dynamo.common.backend.logprobs.extract_from_sglang_meta(meta_info, n_so_far)`` slices them
   again as if cumulative (``[n_so_far:]``), so only the first chunk's logprobs survive. The patch
   calls the original with ``n_so_far=0`` (the per-chunk arrays are already aligned with the
   chunk's ``output_ids``). This is what ai-dynamo 1.6.1 does upstream (the cursor argument is
   gone there). Applied only when the installed function still takes the cursor.
2. **engine_data on the final chunk.** ``DecodeWorkerHandler._process_token_stream`` is wrapped to
   add ``engine_data.weight_version`` (SGLang's ``meta_info.weight_version``) and
   ``engine_data.finish_reason`` (SGLang's raw finish type, e.g. ``"abort"``; the 1.4.2 frontend
   reports Dynamo's ``"cancelled"`` as ``"stop"``). The frontend forwards it as
   ``nvext.engine_data`` when the client asks for ``extra_fields: ["engine_data"]``.

Both patches live in the worker's main process (where the handler runs); SGLang's scheduler
subprocesses are not involved.
"""

from __future__ import annotations

import inspect
import logging
import runpy
import sys
from collections.abc import AsyncIterator
from typing import Any

logger = logging.getLogger("rollout_backends.dynamo_sglang_shim")

_PATCHED = "_rollout_backends_patched"


def patch_logprobs(module: Any = None) -> bool:
    """Make ``extract_from_sglang_meta`` treat SGLang's per-chunk logprobs as deltas. Idempotent."""
    if module is None:
        import dynamo.common.backend.logprobs as module
    orig = module.extract_from_sglang_meta
    if getattr(orig, _PATCHED, False):
        return True
    params = list(inspect.signature(orig).parameters.values())
    if len(params) < 2 or params[1].kind not in (params[1].POSITIONAL_ONLY, params[1].POSITIONAL_OR_KEYWORD):
        logger.info("extract_from_sglang_meta takes no cursor (fixed upstream); not patching")
        return False

    def extract_from_sglang_meta(meta_info: dict[str, Any], num_output_logprobs_so_far: int, **kw: Any) -> Any:
        log_probs, top, _ = orig(meta_info, 0, **kw)
        # The caller's cursor is meaningless for deltas; keep returning 0 so it stays 0.
        return log_probs, top, 0

    setattr(extract_from_sglang_meta, _PATCHED, True)
    module.extract_from_sglang_meta = extract_from_sglang_meta
    return True


def patch_engine_data(handler_cls: Any = None) -> bool:
    """Wrap ``_process_token_stream`` to stamp weight version and raw finish reason. Idempotent."""
    if handler_cls is None:
        from dynamo.sglang.request_handlers.llm.decode_handler import DecodeWorkerHandler as handler_cls
    orig = handler_cls._process_token_stream
    if getattr(orig, _PATCHED, False):
        return True

    async def _process_token_stream(
        self: Any, stream_source: AsyncIterator[dict[str, Any]], *args: Any, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        seen: dict[str, Any] = {}

        async def tap() -> AsyncIterator[dict[str, Any]]:
            async for res in stream_source:
                meta = res.get("meta_info") or {}
                if meta.get("weight_version") is not None:
                    seen["weight_version"] = meta["weight_version"]
                fr = meta.get("finish_reason")
                if isinstance(fr, dict) and fr.get("type"):
                    seen["finish_reason"] = fr["type"]
                yield res

        async for out in orig(self, tap(), *args, **kwargs):
            if out.get("finish_reason"):
                ed = dict(out.get("engine_data") or {})
                ed.setdefault("weight_version", seen.get("weight_version"))
                ed.setdefault("finish_reason", seen.get("finish_reason"))
                out["engine_data"] = ed
            yield out

    setattr(_process_token_stream, _PATCHED, True)
    handler_cls._process_token_stream = _process_token_stream
    return True


def main() -> None:
    patch_logprobs()
    patch_engine_data()
    sys.argv = ["dynamo.sglang", *sys.argv[1:]]
    runpy.run_module("dynamo.sglang", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
