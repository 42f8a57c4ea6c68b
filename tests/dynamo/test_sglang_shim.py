"""The dynamo.sglang shim's patches, on SGLang-0.5.16-shaped incremental chunks (no SGLang needed)."""

from __future__ import annotations

import asyncio
import inspect
import types
from typing import Any

import pytest

logprobs = pytest.importorskip("dynamo.common.backend.logprobs")

from rollout_backends.adapters.dynamo._sglang_shim import patch_engine_data, patch_logprobs  # noqa: E402

# Three incremental chunks as SGLang 0.5.16 emits them with incremental_streaming_output: output_ids
# and meta_info.output_token_logprobs are both per-chunk deltas (the second chunk coalesced 2 steps).
CHUNKS: list[dict[str, Any]] = [
    {"output_ids": [11], "meta_info": {"output_token_logprobs": [(-0.1, 11, None)], "finish_reason": None}},
    {
        "output_ids": [12, 13],
        "meta_info": {"output_token_logprobs": [(-0.2, 12, None), (-0.3, 13, None)], "finish_reason": None},
    },
    {
        "output_ids": [14],
        "meta_info": {
            "output_token_logprobs": [(-0.4, 14, None)],
            "finish_reason": {"type": "abort"},
            "weight_version": "v5",
        },
    },
]


def _run_cursor_loop(fn: Any) -> list[float]:
    """What 1.4.2's _process_token_stream does: carry the returned cursor from chunk to chunk."""
    cursor, out = 0, []
    for c in CHUNKS:
        lps, _top, cursor = fn(c["meta_info"], cursor)
        out.extend(lps or [])
    return out


def _takes_cursor(fn: Any) -> bool:
    """1.4.x: ``extract_from_sglang_meta(meta_info, n_so_far)``; 1.6.x dropped the cursor."""
    params = list(inspect.signature(fn).parameters.values())
    return len(params) >= 2 and params[1].kind in (params[1].POSITIONAL_ONLY, params[1].POSITIONAL_OR_KEYWORD)


def test_installed_extractor_on_incremental_chunks() -> None:
    fn = logprobs.extract_from_sglang_meta
    if _takes_cursor(fn):  # ai-dynamo 1.4.x
        # The bug seen on the H200: ids are fine, logprobs after the first chunk are not.
        assert _run_cursor_loop(fn) == [-0.1, -0.3]
    else:  # ai-dynamo 1.6.x: fixed upstream, each chunk's logprobs are taken as its own
        assert [lp for c in CHUNKS for lp in fn(c["meta_info"])[0] or []] == [-0.1, -0.2, -0.3, -0.4]


def test_patched_extracts_every_token() -> None:
    mod = types.SimpleNamespace(extract_from_sglang_meta=logprobs.extract_from_sglang_meta)
    if not _takes_cursor(mod.extract_from_sglang_meta):
        # 1.6.x: nothing to fix; the shim leaves the function alone.
        assert patch_logprobs(mod) is False and mod.extract_from_sglang_meta is logprobs.extract_from_sglang_meta
        return
    assert patch_logprobs(mod) is True
    assert _run_cursor_loop(mod.extract_from_sglang_meta) == [-0.1, -0.2, -0.3, -0.4]
    assert patch_logprobs(mod) is True  # idempotent


def test_engine_data_stamped_on_final_chunk() -> None:
    class Handler:
        async def _process_token_stream(self, stream_source: Any, context: Any, *a: Any, **kw: Any) -> Any:
            async for res in stream_source:
                out = {"index": 0, "token_ids": res["output_ids"]}
                if res["meta_info"]["finish_reason"]:
                    out["finish_reason"] = "cancelled"
                yield out

    patch_engine_data(Handler)

    async def source() -> Any:
        for c in CHUNKS:
            yield c

    async def collect() -> list[dict[str, Any]]:
        return [o async for o in Handler()._process_token_stream(source(), None)]

    outs = asyncio.run(collect())
    assert [o.get("engine_data") for o in outs[:-1]] == [None, None]
    assert outs[-1]["engine_data"] == {"weight_version": "v5", "finish_reason": "abort"}


def test_version_route_is_added() -> None:
    from rollout_backends.adapters.dynamo._sglang_shim import patch_version_route

    class Handler:
        def __init__(self) -> None:
            sa = types.SimpleNamespace(weight_version="v9")
            self.engine = types.SimpleNamespace(tokenizer_manager=types.SimpleNamespace(server_args=sa))

        def register_engine_routes(self, runtime: Any) -> None:
            runtime.register_engine_route("control/update_weight_version", None)

    class Runtime:
        def __init__(self) -> None:
            self.routes: dict[str, Any] = {}

        def register_engine_route(self, path: str, fn: Any) -> None:
            self.routes[path] = fn

    assert patch_version_route(Handler) and patch_version_route(Handler)  # idempotent
    rt = Runtime()
    Handler().register_engine_routes(rt)
    assert set(rt.routes) == {"control/update_weight_version", "rollout/weight_version"}
    assert asyncio.run(rt.routes["rollout/weight_version"]({})) == {"weight_version": "v9"}
