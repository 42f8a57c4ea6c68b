"""The dynamo.sglang shim's patches, on SGLang-0.5.16-shaped incremental chunks (no SGLang needed)."""

from __future__ import annotations

import asyncio
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


def test_unpatched_1_4_2_loses_logprobs_after_first_chunk() -> None:
    got = _run_cursor_loop(logprobs.extract_from_sglang_meta)
    if len(got) == 4:
        pytest.skip("installed Dynamo already treats SGLang logprobs as deltas")
    assert got == [-0.1, -0.3]  # the bug seen on the H200: ids are fine, logprobs are not


def test_patched_extracts_every_token() -> None:
    mod = types.SimpleNamespace(extract_from_sglang_meta=logprobs.extract_from_sglang_meta)
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
