"""The dynamo.sglang shim's patches, on SGLang-0.5.16-shaped incremental chunks (no SGLang needed).

``Handler`` has the shape of ai-dynamo 1.4.2's ``DecodeWorkerHandler`` where the shim hooks in:
``generate(request, context)`` feeds the engine's stream to ``_process_token_stream(stream,
context, ...)``, which yields Dynamo chunks (``token_ids``, ``finish_reason``); its engine is a
fake ``tokenizer_manager`` that records aborts.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
from typing import Any

import pytest

logprobs = pytest.importorskip("dynamo.common.backend.logprobs")

from rollout_backends.adapters.dynamo._memory_saver import memory_saver_of  # noqa: E402
from rollout_backends.adapters.dynamo._sglang_shim import (  # noqa: E402
    REQUESTS,
    patch_control_results,
    patch_logprobs,
    patch_routes,
    patch_token_stream,
)
from rollout_backends.conformance._logprobs import _pick_stop as pick_stop  # noqa: E402

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


class Context:
    def __init__(self, cid: str) -> None:
        self._id = cid

    def id(self) -> str:
        return self._id


class Runtime:
    def __init__(self) -> None:
        self.routes: dict[str, Any] = {}

    def register_engine_route(self, path: str, fn: Any) -> None:
        self.routes[path] = fn


async def _dynamo_loop(self: Any, stream_source: Any, context: Any, *a: Any, **kw: Any) -> Any:
    async for res in stream_source:  # what 1.4.2 keeps of each SGLang chunk
        out: dict[str, Any] = {"index": 0, "token_ids": res["output_ids"]}
        if res["meta_info"].get("finish_reason"):
            out["finish_reason"] = "cancelled"
        yield out


def _handler_class(model_path: str = "/nonexistent", loop: Any = _dynamo_loop) -> type:
    class Handler:
        def __init__(self, chunks: list[dict[str, Any]]) -> None:
            self.chunks = chunks
            self.aborted: list[Any] = []
            sa = types.SimpleNamespace(weight_version="v9", model_path=model_path, tokenizer_path=None)
            tm = types.SimpleNamespace(server_args=sa, abort_request=self._abort)
            self.engine = types.SimpleNamespace(tokenizer_manager=tm)

        def _abort(self, rid: str = "", abort_all: bool = False) -> None:  # synchronous, as in 0.5.16
            self.aborted.append("ALL" if abort_all else rid)

        async def source(self) -> Any:
            for c in self.chunks:
                await asyncio.sleep(0)
                yield c

        async def generate(self, request: dict[str, Any], context: Any) -> Any:
            async for out in self._process_token_stream(self.source(), context, False):
                yield out

        _process_token_stream = loop

        def register_engine_routes(self, runtime: Any) -> None:
            runtime.register_engine_route("control/update_weight_version", None)

    assert patch_token_stream(Handler) and patch_token_stream(Handler)  # idempotent
    assert patch_routes(Handler) and patch_routes(Handler)
    return Handler


def _numbered(chunks: list[dict[str, Any]], rid: str = "sg-1") -> list[dict[str, Any]]:
    """Add what SGLang 0.5.16 also puts in meta_info: its request id and the cumulative token count."""
    n, out = 0, []
    for c in chunks:
        n += len(c["output_ids"])
        out.append({**c, "meta_info": {"id": rid, "completion_tokens": n, **c["meta_info"]}})
    return out


def _collect(handler: Any, request: dict[str, Any], cid: str = "ctx-1") -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [o async for o in handler.generate(request, Context(cid))]

    return asyncio.run(run())


def test_engine_data_stamped_on_final_chunk() -> None:
    outs = _collect(_handler_class()(_numbered(CHUNKS)), {"token_ids": [1, 2]})
    assert [o.get("engine_data") for o in outs[:-1]] == [None, None]  # SGLang sent no version yet
    assert outs[-1]["engine_data"] == {"weight_version": "v5", "finish_reason": "abort", "chunk_weight_version": "v5"}
    assert [t for o in outs for t in o["token_ids"]] == [11, 12, 13, 14]
    assert not REQUESTS.by_context and not REQUESTS.by_rid  # forgotten when the request ends


def test_every_chunk_carries_the_version_sglang_built_it_under() -> None:
    """Patch 3: each chunk's engine_data.chunk_weight_version is its SGLang output's
    meta_info.weight_version (an update between outputs shows); the final chunk's weight_version
    is the last one's."""
    versioned = [
        {**c, "meta_info": {**c["meta_info"], "weight_version": v}} for c, v in zip(CHUNKS, "abb", strict=True)
    ]
    outs = _collect(_handler_class()(_numbered(versioned)), {"token_ids": [1, 2]})
    assert [o["engine_data"]["chunk_weight_version"] for o in outs] == ["a", "b", "b"]
    assert [o["engine_data"] for o in outs[:-1]] == [{"chunk_weight_version": "a"}, {"chunk_weight_version": "b"}]
    assert outs[-1]["engine_data"]["weight_version"] == "b"


def test_waiting_queue_abort_chunk_is_cut_back_to_a_delta() -> None:
    # TokenizerManager._handle_abort_req (streaming): output_ids = [last token], cumulative logprobs.
    cumulative = [(-0.1, 11, None), (-0.2, 12, None)]
    meta = {"id": "sg-1", "completion_tokens": 2}
    abort = {"type": "abort"}
    chunks = [
        *_numbered(CHUNKS[:1]),
        {"output_ids": [12], "meta_info": {**meta, "output_token_logprobs": cumulative[1:], "finish_reason": None}},
        {"output_ids": [12], "meta_info": {**meta, "output_token_logprobs": cumulative, "finish_reason": abort}},
    ]
    seen: list[dict[str, Any]] = []

    async def record(self: Any, stream_source: Any, context: Any, *a: Any, **kw: Any) -> Any:
        async for res in stream_source:  # what the shim hands 1.4.2's loop
            seen.append(res)
            yield {"index": 0, "token_ids": res["output_ids"]}

    _collect(_handler_class(loop=record)(chunks), {"token_ids": [1]})
    assert [r["output_ids"] for r in seen] == [[11], [12], []]
    assert seen[-1]["meta_info"]["output_token_logprobs"] == []
    assert seen[1]["meta_info"]["output_token_logprobs"] == cumulative[1:]  # a normal delta is untouched


def test_chunks_carry_text_from_our_detokenizer(tiny_model: Any) -> None:
    from rollout_backends.adapters.dynamo._detok import load_text_decoder

    from .test_detok import SCRIPTED_PANIC, expected_text

    prompt, output = SCRIPTED_PANIC
    chunks = _numbered([
        {"output_ids": output[:3], "meta_info": {"finish_reason": None}},
        {"output_ids": output[3:], "meta_info": {"finish_reason": {"type": "length"}}},
    ])  # fmt: skip
    outs = _collect(_handler_class(str(tiny_model))(chunks), {"token_ids": prompt})
    decode = load_text_decoder(str(tiny_model))
    assert decode is not None
    assert "".join(o["text"] for o in outs) == expected_text(decode, prompt, output)
    assert [len(o["tokens"]) for o in outs] == [3, 1]
    # Text stop sequences are the frontend's: it must keep decoding, so no text from the worker.
    stop = {"token_ids": prompt, "stop_conditions": {"stop": ["x"]}}
    assert not any("text" in o for o in _collect(_handler_class(str(tiny_model))(chunks), stop))


def test_abort_by_our_request_id_reaches_sglang_with_its_id() -> None:
    Handler = _handler_class()
    rt = Runtime()

    async def run() -> tuple[list[dict[str, Any]], Any]:
        h = Handler(_numbered(CHUNKS))
        h.register_engine_routes(rt)
        abort = rt.routes["rollout/abort"]
        # An abort that arrives before its request is kept and applied at the first chunk.
        assert await abort({"rid": "early"}) == {"status": "ok", "found": False}
        outs = [o async for o in h.generate({"token_ids": [1], "annotations": ["rid:early"]}, Context("c-early"))]
        assert h.aborted == ["sg-1"]
        # A running one: aborted by SGLang's id once its first chunk named it.
        h2 = Handler(_numbered(CHUNKS, rid="sg-2"))
        agen = h2.generate({"token_ids": [1], "annotations": ["rid:mine"]}, Context("c-2"))
        first = await agen.__anext__()
        assert await abort({"rid": "mine"}) == {"status": "ok", "found": True}
        rest = [o async for o in agen]
        assert h2.aborted == ["sg-2"] and len([first, *rest]) == 3
        assert await abort({"abort_all": True}) == {"status": "ok"} and h.aborted[-1] == "ALL"
        assert (await abort({"rid": ""}))["success"] is False
        return outs, rt

    outs, _ = asyncio.run(run())
    assert outs[-1]["engine_data"]["finish_reason"] == "abort"
    assert set(rt.routes) == {
        "control/update_weight_version",
        "rollout/weight_version",
        "rollout/abort",
        "rollout/server_args",
    }
    assert asyncio.run(rt.routes["rollout/weight_version"]({})) == {"weight_version": "v9"}
    # SGLang's resolved arguments, as JSON values (what launch_server's /server_info shows)
    args = asyncio.run(rt.routes["rollout/server_args"]({}))
    assert args["weight_version"] == "v9" and json.dumps(args)


def test_msgspec_control_results_keep_success() -> None:
    msgspec = pytest.importorskip("msgspec")

    class BaseReq(msgspec.Struct, tag=True, kw_only=True, array_like=True):  # SGLang 0.5.16's io_struct
        rid: Any = None
        http_worker_ipc: Any = None

    class FlushCacheReqOutput(BaseReq, kw_only=True):
        success: bool
        message: str = ""

    class Mixin:
        def _normalize_result(self, result: Any) -> dict[str, Any]:  # 1.4.2: str() of anything unknown
            return {"result": str(result)} if result is not None else {"status": "ok"}

    assert patch_control_results(Mixin) and patch_control_results(Mixin)
    m = Mixin()
    assert m._normalize_result(FlushCacheReqOutput(success=False, message="busy")) == {
        "rid": None, "http_worker_ipc": None, "success": False, "message": "busy",
    }  # fmt: skip
    assert m._normalize_result(None) == {"status": "ok"}


def test_patches_on_the_real_1_4_2_handler(tiny_model: Any) -> None:
    """ai-dynamo 1.4.2's own generate/_process_token_stream/_normalize_result under the shim
    (SGLang stubbed: ``real_handler.py``), fed SGLang-0.5.16-shaped streams."""
    if not _takes_cursor(logprobs.extract_from_sglang_meta):
        # 1.6.x rewrote dynamo.sglang's handlers (its handler_base needs a real sgl.Engine at import);
        # this is 1.4.x's code path, which the 1.4.2 run of make test covers.
        pytest.skip("needs ai-dynamo 1.4.x's DecodeWorkerHandler; the installed dynamo.sglang is 1.6.x-shaped")
    import json
    import subprocess
    import sys
    from pathlib import Path

    from rollout_backends.adapters.dynamo._detok import load_text_decoder

    from .test_detok import SCRIPTED_PANIC, expected_text

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.dynamo.real_handler", str(tiny_model)],
        capture_output=True, text=True, timeout=120, cwd=root, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["patched"] == {"logprobs": True, "token_stream": True, "control_results": True}

    def ids(chunks: list[dict[str, Any]]) -> list[int]:
        return [t for c in chunks for t in c["token_ids"]]

    def aligned(chunks: list[dict[str, Any]]) -> bool:
        return all(
            len(c.get("log_probs") or []) == len(c["token_ids"]) == len(c.get("tokens", c["token_ids"])) for c in chunks
        )

    # Every token keeps its logprob (1.4.2 alone keeps only the first chunk's); the last chunk is stamped.
    plain = r["plain"]
    assert ids(plain) == [11, 12, 13, 14] and aligned(plain)
    assert [lp for c in plain for lp in c["log_probs"]] == [-0.01, -0.02, -0.03, -0.04]
    assert plain[-1]["engine_data"] == {"weight_version": "v7", "finish_reason": "length", "chunk_weight_version": "v7"}
    # Through 1.4.2's own loop, every chunk carries its SGLang output's version, and nothing else before the last.
    assert [c["engine_data"] for c in plain[:-1]] == [{"chunk_weight_version": "v7"}] * (len(plain) - 1)
    # Top-k alternatives (1.4.2 refuses them without the shim's env) named by id, per token, and
    # the prompt's logprobs from SGLang's first chunk on the final chunk's engine_data.
    top = r["top_and_prompt"]
    assert ids(top) == [11, 12, 13, 14] and aligned(top)
    alternatives = [[(e["token"], e["logprob"]) for e in pos] for c in top for pos in c["top_logprobs"]]
    want = [[(f"token_id:{t}", -0.01 * (k + 1)), ("token_id:900", -9.0)] for k, t in enumerate([11, 12, 13, 14])]
    assert alternatives == want
    assert top[-1]["engine_data"]["prompt_logprobs"] == [None, -0.5, -1.0]
    assert "prompt_logprobs" not in plain[-1]["engine_data"]
    # Worker text on the sequence the frontend's decoder panics on; none with text stop strings.
    decode = load_text_decoder(str(tiny_model))
    assert decode is not None
    prompt, output = SCRIPTED_PANIC
    assert ids(r["text"]) == output and aligned(r["text"])
    assert "".join(c["text"] for c in r["text"]) == expected_text(decode, prompt, output)
    assert not any("text" in c or "tokens" in c for c in r["text_stop_strings"])
    # Abort by our id: SGLang's own id is aborted; the stream ends normally with the partial tokens.
    ab = r["aborted"]
    assert r["abort_found"] is True and 1 <= len(ids(ab)) < 6 and aligned(ab)
    assert ab[-1]["finish_reason"] == "cancelled" and ab[-1]["engine_data"]["finish_reason"] == "abort"
    # Aborted while waiting: SGLang repeats the last token with cumulative logprobs; it is cut back.
    wq = r["aborted_waiting"]
    assert ids(wq) == [21, 22][: len(ids(wq))] and len(set(ids(wq))) == len(ids(wq)) and aligned(wq)
    assert wq[-1]["engine_data"]["finish_reason"] == "abort"
    assert len(r["abort_calls"]) == 2 and all(c.startswith("sg-") for c in r["abort_calls"])
    # Stop strings matched in the shim through 1.4.2's own loop: cut at the token completing "an"
    # (the reference engine's [44, 374]), finished as stop with the string and the version in
    # engine_data (none as stop_reason), SGLang's request aborted; its answer to the abort (the
    # next tokens, finish abort) read but not sent.
    st = r["shim_stop_strings"]
    assert ids(st) == [44, 374] and aligned(st) and len(st) == 1
    assert st[-1]["finish_reason"] == "stop" and "stop_reason" not in st[-1]
    assert st[-1]["engine_data"]["matched_stop"] == "an" and st[-1]["engine_data"]["weight_version"] == "v7"
    assert st[-1]["engine_data"]["finish_reason"] == "stop" and st[-1]["completion_usage"]["completion_tokens"] == 2
    assert "".join(c["text"] for c in st) == decode([44, 374], False)
    assert len(r["shim_stop_abort_calls"]) == 1 and r["shim_stop_abort_calls"][0].startswith("sg-")
    assert r["registry_empty"] is True
    # A refused flush stays refused; tuples as before.
    assert r["flush_result"]["success"] is False and r["flush_result"]["message"] == "not idle"
    assert r["tuple_result"] == {"success": True, "message": "ok"}
    # connect() reads the memory saver from 1.4.2's answer to get_internal_state: {"result": [per DP rank]}.
    assert set(r["internal_state"]) == {"result"} and len(r["internal_state"]["result"]) == 2
    assert memory_saver_of(r["internal_state"]) is False


def test_server_args_come_back_as_json_values_with_nested_configs_as_objects() -> None:
    """What ``rollout/server_args`` answers: nested dataclass configs as objects (as SGLang's own
    ``/server_info`` shows them, so the two can be compared key by key), anything else as its str()."""
    import dataclasses

    from rollout_backends.adapters.dynamo._sglang_shim import server_args_dict

    @dataclasses.dataclass
    class Phase:
        backend: str = "disabled"
        bs: list[int] = dataclasses.field(default_factory=lambda: [1, 2])

    @dataclasses.dataclass
    class Args:
        cuda_graph_config: Phase = dataclasses.field(default_factory=Phase)
        page_size: int = 16
        odd: object = dataclasses.field(default_factory=lambda: frozenset({1}))

    got = server_args_dict(Args())
    assert got == {"cuda_graph_config": {"backend": "disabled", "bs": [1, 2]}, "page_size": 16, "odd": "frozenset({1})"}
    assert json.loads(json.dumps(got)) == got


def _sglang_loop(self: Any, stream_source: Any, context: Any, *a: Any, **kw: Any) -> Any:
    """What 1.4.2's ``_process_token_stream`` keeps of each SGLang output, finish reasons mapped
    as its ``normalize_finish_reason`` does, per-chunk logprobs (the shim's patch 1)."""

    async def run() -> Any:
        async for res in stream_source:
            meta = res["meta_info"]
            out: dict[str, Any] = {"index": 0, "token_ids": res["output_ids"]}
            out["log_probs"] = [e[0] for e in meta.get("output_token_logprobs") or []]
            fr = meta.get("finish_reason")
            if fr:
                out["finish_reason"] = {"abort": "cancelled"}.get(fr["type"], fr["type"])
                if fr.get("matched") is not None:
                    out["stop_reason"] = fr["matched"]
                out["completion_usage"] = {"completion_tokens": meta["completion_tokens"]}
            yield out

    return run()


class _Scheduler:
    """SGLang's side of one request: its outputs in chunks of ``step`` tokens, ending on length
    after the last; an abort ends it at the next output (``finish_reason`` abort, no tokens)."""

    def __init__(self, ids: list[int], step: int, aborted: list[Any], rid: str = "sg-1") -> None:
        self.ids, self.step, self.rid = ids, step, rid
        self.aborted = aborted  # what the handler's tokenizer_manager.abort_request recorded
        self.pulled = 0  # outputs SGLang produced for the request

    async def stream(self) -> Any:
        n = 0
        while n < len(self.ids):
            await asyncio.sleep(0)
            self.pulled += 1
            meta: dict[str, Any] = {"id": self.rid, "weight_version": "v4", "completion_tokens": n}
            if self.aborted:
                meta["finish_reason"] = {"type": "abort", "message": "Abort before"}
                yield {"output_ids": [], "meta_info": meta}
                return
            chunk = self.ids[n : n + self.step]
            n += len(chunk)
            meta["completion_tokens"] = n
            meta["output_token_logprobs"] = [(-0.01 * (n - len(chunk) + k + 1), t, None) for k, t in enumerate(chunk)]
            meta["finish_reason"] = {"type": "length"} if n == len(self.ids) else None
            yield {"output_ids": chunk, "meta_info": meta}


def _as_frontend_answer(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``/v1/completions`` answer the frontend builds from a worker's chunks when it matches
    nothing itself (it passes worker text through; ``engine_data`` from the last chunk)."""
    last = outs[-1]
    return {
        "choices": [
            {
                "text": "".join(o.get("text", "") for o in outs),
                "index": 0,
                "finish_reason": last["finish_reason"],
                "logprobs": {"token_logprobs": [lp for o in outs for lp in o["log_probs"]]},
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": last["completion_usage"]["completion_tokens"]},
        "nvext": {
            "completion_token_ids": [t for o in outs for t in o["token_ids"]],
            "engine_data": last["engine_data"],
        },
    }


@pytest.mark.parametrize("step", [1, 3, 16])
def test_stop_strings_match_the_reference_engine_and_abort_sglang(tiny_model: Any, step: int) -> None:
    """Patch 8 on SGLang outputs of ``step`` tokens (the stream interval): a stop string taken from
    a free run's text ends the run where the reference engine (SGLang's rule) ends it: the same
    ids, logprobs aligned, finish stop with the string, the text cut (kept with no_stop_trim) by
    the wire; the last chunk carries the version; SGLang's request is aborted at the match and
    no token after it is sent. Without the patch the shim ignores the stop strings and streams to
    the length limit."""
    from rollout_backends import FinishReason, GenerateRequest, SamplingParams
    from rollout_backends.adapters.dynamo import DynamoWire
    from rollout_backends.adapters.reference import ReferenceBackend
    from rollout_backends.kit import HttpResponse

    never = "\u2603" * 64
    wire = DynamoWire(frontend_url="http://fe", model="tiny", flavor="sglang14-shim")

    async def run() -> int:
        ref = ReferenceBackend.create(tiny_model, workers=1)
        checked = aborts = 0
        try:
            for prompt in ([5, 6, 7, 8], [11, 12, 13], [100, 200, 300, 400]):
                sp = SamplingParams(temperature=0, max_new_tokens=16, stop=(never,))
                free = await ref.generate(GenerateRequest(input_ids=prompt, sampling=sp))
                assert free.text is not None
                picked = pick_stop(free.text)  # as the conformance check picks it
                assert picked is not None
                sub = picked[0]
                for keep in (False, True):
                    sp = SamplingParams(temperature=0, max_new_tokens=16, stop=(never, sub), no_stop_trim=keep)
                    req = GenerateRequest(input_ids=prompt, sampling=sp)
                    want = await ref.generate(req)
                    body = wire.generate(req, None).json
                    assert "stop" not in body  # the frontend never sees them
                    h = _handler_class(str(tiny_model), loop=_sglang_loop)([])
                    sched = _Scheduler(list(free.output_ids), step, h.aborted)
                    h.source = sched.stream
                    worker_req = {"token_ids": prompt, "annotations": body["nvext"]["annotations"]}
                    outs = [o async for o in h.generate(worker_req, Context(f"c-{prompt[0]}-{keep}"))]
                    assert all(len(o["log_probs"]) == len(o["token_ids"]) for o in outs)
                    assert [bool(o.get("finish_reason")) for o in outs] == [False] * (len(outs) - 1) + [True]
                    got = wire.parse_generation(req, HttpResponse.from_json(_as_frontend_answer(outs)), 0.1)
                    assert (got.finish_reason, got.matched_stop) == (FinishReason.STOP, sub)
                    assert (want.finish_reason, want.matched_stop) == (FinishReason.STOP, sub)
                    assert got.output_ids == want.output_ids and len(want.output_ids) < len(free.output_ids)
                    assert got.text == want.text
                    assert got.weight_version == "v4" and outs[-1]["engine_data"]["finish_reason"] == "stop"
                    assert "stop_reason" not in outs[-1]  # the string is in engine_data, not for the frontend
                    # Aborted inside SGLang by its id, at the output that met the string (unless that
                    # output was SGLang's last); SGLang's answer to the abort is read, not sent on.
                    at = -(-len(want.output_ids) // step)  # outputs up to the one with the match
                    unfinished = at * step < len(free.output_ids)
                    assert h.aborted == (["sg-1"] if unfinished else [])
                    assert sched.pulled == at + unfinished
                    aborts += unfinished
                    checked += 1
        finally:
            await ref.aclose()
        assert aborts == (6 if step < 16 else 0)  # 16 tokens in one output: SGLang had finished it
        return checked

    assert asyncio.run(run()) == 6
    assert not REQUESTS.by_context and not REQUESTS.by_rid


def test_stop_strings_without_a_tokenizer_are_refused_naming_the_field() -> None:
    """No tokenizer.json: the shim cannot match stop strings, so it refuses before SGLang sees the
    request (the wire reads the refusal as InvalidRequest("sampling.stop")); a malformed
    annotation likewise."""
    for annotation in ('stop-strings:["x"]', "stop-strings:[1]"):
        h = _handler_class("/nonexistent", loop=_sglang_loop)(_numbered(CHUNKS))
        pulled: list[Any] = []

        async def source(h: Any = h, pulled: list[Any] = pulled) -> Any:
            for c in h.chunks:
                pulled.append(c)
                yield c

        h.source = source
        outs = _collect(h, {"token_ids": [1, 2], "annotations": ["rid:r", annotation]})
        assert len(outs) == 1 and outs[0]["token_ids"] == [] and not pulled
        assert outs[0]["engine_data"]["refused"]["param"] == "sampling_params.stop"
    assert not REQUESTS.by_context and not REQUESTS.by_rid


def test_a_stop_string_on_the_last_token_of_a_length_finish_is_not_a_match(tiny_model: Any) -> None:
    """SGLang checks the length limit before stop strings (Req.check_finished, 0.5.16; the reference
    engine too): met on the token that reaches max_new_tokens, the finish stays length."""
    from rollout_backends.adapters.dynamo._detok import load_text_decoder

    decode = load_text_decoder(str(tiny_model))
    assert decode is not None
    ids = [44, 374]  # "Jran": "an" is completed by the second token
    assert "an" in decode(ids, False) and "an" not in decode(ids[:1], False)
    h = _handler_class(str(tiny_model), loop=_sglang_loop)([])
    sched = _Scheduler(ids, 2, h.aborted)
    h.source = sched.stream
    outs = _collect(h, {"token_ids": [5, 6, 7, 8], "annotations": ['stop-strings:["an"]']})
    assert [t for o in outs for t in o["token_ids"]] == ids and outs[-1]["finish_reason"] == "length"
    assert "matched_stop" not in outs[-1]["engine_data"] and h.aborted == []
    # One token more in SGLang's output: the same token now completes the string before the limit.
    h = _handler_class(str(tiny_model), loop=_sglang_loop)([])
    sched = _Scheduler([*ids, 24], 3, h.aborted)
    h.source = sched.stream
    outs = _collect(h, {"token_ids": [5, 6, 7, 8], "annotations": ['stop-strings:["an"]']})
    assert [t for o in outs for t in o["token_ids"]] == ids and outs[-1]["engine_data"]["matched_stop"] == "an"


# -- upstream watches: each fails when the installed ai-dynamo changes where a patch hooks in --------
# The shim decides once which patches apply (``detect_upstream`` / ``plan``); these read the installed
# dynamo.sglang's own code (no SGLang needed) so a fix upstream, or a new layout, is noticed.

#: What ``plan(detect_upstream())`` must say per installed ai-dynamo (None = the patch applies).
#: A release not listed here fails ``test_the_patch_plan_is_known_for_the_installed_ai_dynamo``: read
#: its dynamo.sglang against each patch and add it.
_LEGACY = "1.6.x flavor sglang16: native routes, capabilities declared"
EXPECTED_PLAN: dict[str, dict[str, str | None]] = {
    "1.4.2": {
        **dict.fromkeys(
            (
                "logprobs",
                "top_logprobs",
                "prompt_logprobs",
                "token_stream",
                "worker_text",
                "stop_strings",
                "routes",
                "control_results",
            )
        ),
        "discovery_sync": "no discovery re-sync after engine routes upstream",
    },
    "1.6.1": {
        "logprobs": "fixed upstream (extract_from_sglang_meta takes no cursor)",
        "top_logprobs": "no gate upstream (top-k passed through)",
        "prompt_logprobs": "returned upstream (engine_data.prompt_logprobs)",
        "token_stream": None,
        "worker_text": None,
        "stop_strings": _LEGACY,
        "routes": None,
        "control_results": "no call_tokenizer_manager upstream",
        "discovery_sync": None,
    },
}


def _installed_dynamo() -> str:
    import importlib.metadata

    return importlib.metadata.version("ai-dynamo")


def _function_source(text: str, name: str) -> str:
    """The source of the first ``def name`` (sync or async) in ``text``."""
    import ast

    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return ast.get_source_segment(text, node) or ""
    raise AssertionError(f"no def {name} in the installed dynamo.sglang: the layout the shim hooks changed")


def test_the_patch_plan_is_known_for_the_installed_ai_dynamo() -> None:
    from rollout_backends.adapters.dynamo._sglang_shim import detect_upstream, plan

    version = _installed_dynamo()
    assert version in EXPECTED_PLAN, f"ai-dynamo {version}: check each shim patch against it (docs/versions.md)"
    assert plan(detect_upstream()) == EXPECTED_PLAN[version]


def test_watch_patch_2_upstream_passes_sglang_output_ids_through_unchecked() -> None:
    """Patch 2: 1.4.2 and 1.6.1 forward each SGLang output's ``output_ids`` as the chunk's tokens
    without holding them against the cumulative ``completion_tokens`` (SGLang 0.5.16's
    ``_handle_abort_req`` answers a waiting-queue abort with a chunk that repeats its last token)."""
    from rollout_backends.adapters.dynamo._sglang_shim import DECODE_HANDLER, dynamo_source

    body = _function_source(dynamo_source(DECODE_HANDLER) or "", "_process_token_stream")
    assert 'out["token_ids"] = output_ids' in body
    assert 'output_ids = res.get("output_ids"' in body or "output_ids = res['output_ids']" in body
    assert "output_ids[" not in body  # never cut back to what is new


def test_watch_patch_3_upstream_sends_no_weight_version_and_reports_abort_as_cancelled() -> None:
    """Patch 3: no ``weight_version`` in the chunks upstream builds; SGLang's ``abort`` becomes
    Dynamo's ``cancelled`` (``dynamo/common/utils/engine_response.py``), which the frontend reports
    as a stop."""
    from dynamo.common.utils.engine_response import normalize_finish_reason

    from rollout_backends.adapters.dynamo._sglang_shim import DECODE_HANDLER, dynamo_source

    body = _function_source(dynamo_source(DECODE_HANDLER) or "", "_process_token_stream")
    assert "weight_version" not in body
    assert normalize_finish_reason("abort") == "cancelled"


def test_watch_patch_5_upstream_serves_no_route_that_reads_the_weight_version() -> None:
    """Patch 5: the engine routes upstream registers can set a version but not read one."""
    import re

    from rollout_backends.adapters.dynamo._sglang_shim import HANDLER_BASE, dynamo_source

    base = dynamo_source(HANDLER_BASE) or ""
    paths = set(re.findall(r'"((?:control/)?[a-z_]*weight[a-z_]*)"', base))
    assert paths, "no weight route found: the layout patch 5 reads changed"
    assert not {p for p in paths if "get" in p or "info" in p}, paths


def test_watch_patch_5_on_1_6_x_sync_tokenizer_manager_routes_run_in_a_bare_thread() -> None:
    """Patch 5 on 1.6.x: a configured ``tm`` route whose method is synchronous (SGLang 0.5.16's
    ``TokenizerManager.abort_request``) runs in a thread of its own with no event loop
    (``engine_routes.py`` ``_ConfiguredEngineRoute._invoke`` → ``_run_in_thread``), where SGLang's
    abort fails (H200 tier 2026-12-06: "There is no current event loop in thread
    'dynamo-sglang-engine-route'"); and no route aborts one request by id. Fails when upstream calls
    such methods on its loop, or adds an abort by id (then patch 5 may go on 1.6.x)."""
    from rollout_backends.adapters.dynamo._sglang_shim import HANDLER_BASE, dynamo_source

    routes = dynamo_source("sglang/engine_routes.py")
    if routes is None:
        pytest.skip(
            "the installed ai-dynamo (1.4.x) has no configured engine routes: its abort goes by call_tokenizer_manager"
        )
    invoke = _function_source(routes, "_invoke")
    last_branch = invoke.split("else:", 1)[-1].split("if inspect.isawaitable", 1)[0]
    assert "_run_in_thread(self._method" in last_branch, invoke
    thread = _function_source(routes, "_run_in_thread")
    assert "threading.Thread(" in thread and "new_event_loop" not in thread and "set_event_loop" not in thread
    base = dynamo_source(HANDLER_BASE) or ""
    assert "abort" not in " ".join(re.findall(r'"((?:control/)?[a-z_/]+)":', base)), "an abort route upstream"


def test_watch_patch_6a_top_logprobs_gate() -> None:
    """Patch 6a: 1.4.x refuses ``logprobs >= 1`` unless the env it names is set (the shim sets it);
    1.6.x passes top-k through (``build_sglang_logprob_kwargs``)."""
    from rollout_backends.adapters.dynamo._sglang_shim import TOP_LOGPROBS_ENV, detect_upstream

    if detect_upstream().top_logprobs_gate:
        assert logprobs.DYN_SGL_ALLOW_TOP_LOGPROBS_ENV == TOP_LOGPROBS_ENV
    else:
        kwargs = logprobs.build_sglang_logprob_kwargs({"logprobs": 3})
        assert kwargs.get("top_logprobs_num") == 3 and kwargs.get("return_logprob") is True


def test_watch_patch_8_upstream_gives_sglang_no_stop_strings_on_the_token_path() -> None:
    """Patch 8: ``_build_sampling_params`` (token path, SGLang run with ``skip_tokenizer_init``) passes
    stop token ids only; the frontend matches stop strings on its own text and ends the stream
    before the worker's final chunk (version, worker id)."""
    import ast

    from rollout_backends.adapters.dynamo._sglang_shim import DECODE_HANDLER, dynamo_source

    fn = _function_source(dynamo_source(DECODE_HANDLER) or "", "_build_sampling_params")
    token_branch = next(
        n for n in ast.walk(ast.parse(fn)) if isinstance(n, ast.If) and "use_sglang_tokenizer" in ast.unparse(n.test)
    )
    token_path = "\n".join(ast.unparse(s) for s in token_branch.body)
    assert "stop_token_ids" in token_path
    assert "'stop'" not in token_path and "_openai_stop_sampling_params" not in token_path


def test_a_stop_string_annotation_is_refused_where_patch_8_is_not_applied() -> None:
    from rollout_backends import InvalidRequest
    from rollout_backends.adapters.dynamo._sglang_shim import Requests
    from rollout_backends.adapters.dynamo._wire import STOP_ANNOTATION

    request = {"token_ids": [1, 2], "annotations": [f"{STOP_ANNOTATION}{json.dumps(['x'])}"]}
    with pytest.raises(InvalidRequest) as e:
        Requests().begin("c1", request, None, lambda rid: None, stop_strings=False)
    assert e.value.field == "sampling.stop"


async def test_watch_patch_4_the_frontends_own_decoder_on_a_utf8_split(tiny_model: Any) -> None:
    """Patch 4: with worker-side text off, the installed frontend decodes on its own a sequence whose
    window splits a UTF-8 character, and gets it wrong: 1.4.2 (``dynamo-tokenizers`` 1.5.4
    ``DecodeStream::step``, ``lib.rs:423``) panics, HTTP 500; 1.6.1 answers 200 but loses the
    character the first output bytes complete across the prompt boundary (measured 2026-12-05:
    "ǌ��iet…" served as "��iet…"). Fails once the frontend serves the exact text (patch 4 can go)."""
    import aiohttp

    from rollout_backends.adapters.dynamo import DynamoFleetConfig, launch_dynamo_fleet
    from rollout_backends.adapters.dynamo._detok import load_text_decoder

    from .test_detok import expected_text
    from .test_dynamo_reference import UTF8_SPLIT_PROMPT

    cfg = DynamoFleetConfig(
        model_path=str(tiny_model), workers=1, worker_kind="reference", worker_env={"ROLLOUT_DYN_WORKER_TEXT": "0"}
    )
    body = {"prompt": UTF8_SPLIT_PROMPT, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "nvext": {"extra_fields": ["completion_token_ids"]}}  # fmt: skip
    async with launch_dynamo_fleet(cfg) as running, aiohttp.ClientSession() as http:
        url = f"{running.frontend_url}/v1/completions"
        async with http.post(url, json={**body, "model": running.config.model_name}) as resp:
            status, text = resp.status, await resp.text()
    if status == 500:
        return  # 1.4.x: the decoder's thread panicked
    assert status == 200, text[:300]
    data = json.loads(text)
    decode = load_text_decoder(str(tiny_model))
    assert decode is not None
    exact = expected_text(decode, UTF8_SPLIT_PROMPT, data["nvext"]["completion_token_ids"])
    assert data["choices"][0]["text"] != exact, "the frontend decoded the UTF-8 split exactly: patch 4 may go"


# -- patch 9: one unregister while paused (ai-dynamo 1.6.x) ------------------------------------------

#: A second unregister under file discovery, in a runtime of the installed ai-dynamo (what the
#: probe of 2026-12-06 ran): prints one line per call, "ok" or the exception's words.
_UNREGISTER_TWICE = """
import asyncio, sys
from dynamo.runtime import DistributedRuntime

async def gen(request, context=None):
    yield {}

async def main():
    rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    ep = rt.endpoint("ns.comp.generate")
    serving = asyncio.ensure_future(ep.serve_endpoint(gen))
    await asyncio.sleep(1.0)
    for call in ("unregister", "unregister", "register", "register"):
        try:
            await getattr(ep, call + "_endpoint_instance")()
            print(call, "ok", flush=True)
        except Exception as exc:
            print(call, "refused:", exc, flush=True)
    rt.shutdown()
    serving.cancel()

asyncio.run(main())
"""


def _upstream_discovery_sync() -> tuple[str, str]:
    """1.6.x's ``_sync_discovery_with_sglang_pause_state`` and ``_invoke_engine_route`` sources."""
    from rollout_backends.adapters.dynamo._sglang_shim import HANDLER_BASE, detect_upstream, dynamo_source

    if not detect_upstream().discovery_resync:
        pytest.skip("the installed ai-dynamo (1.4.x) does not re-sync discovery after engine routes: no patch 9")
    base = dynamo_source(HANDLER_BASE) or ""
    return (
        _function_source(base, "_sync_discovery_with_sglang_pause_state"),
        _function_source(base, "_invoke_engine_route"),
    )


def test_watch_patch_9_file_discovery_refuses_a_second_unregister(tmp_path: Any) -> None:
    """Patch 9's cause, in the installed runtime: under file discovery a second
    ``unregister_endpoint_instance`` is refused (registering twice is not). Fails once the runtime
    takes it (then stock 1.6.x needs no patch for its repeated unregister)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DYN_FILE_KV": str(tmp_path / "kv"), "DYN_LOG": "error"}
    proc = subprocess.run(
        [sys.executable, "-c", _UNREGISTER_TWICE], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.split(" ", 1)[0] in ("register", "unregister")]
    assert len(lines) == 4, (proc.stdout + proc.stderr)[-2000:]
    assert lines[0] == "unregister ok" and lines[2:] == ["register ok", "register ok"], lines
    assert lines[1].startswith("unregister refused:") and "Unable to unregister" in lines[1], lines


def test_watch_patch_9_upstream_unregisters_after_every_engine_route_while_paused() -> None:
    """1.6.1 syncs discovery in ``finally`` after each wrapped engine route, and unregisters whenever
    SGLang is paused, remembering nothing."""
    sync, invoke = _upstream_discovery_sync()
    assert "finally:" in invoke and "_sync_discovery_with_sglang_pause_state()" in invoke
    paused_branch = sync.split("if tokenizer_manager.is_pause:", 1)[-1].split("else:", 1)[0]
    assert paused_branch.split() == ["await", "self.generate_endpoint.unregister_endpoint_instance()"], (
        "the paused branch changed (it may check whether it unregistered already): patch 9 may go"
    )


def test_patches_5_and_9_on_the_real_1_6_x_handler_over_file_discovery(tmp_path: Any) -> None:
    """ai-dynamo 1.6.x's own ``BaseWorkerHandler`` routes (SGLang stubbed: ``real_handler16.py``) over
    a real runtime's endpoint under file discovery. Stock: a paused flush fails with the runtime's
    words and an abort-all with the engine-route thread's, as on the H200 tier of 2026-12-06; the
    worker is back in discovery after the resume. Under the shim: the paused flush answers, discovery
    holds the worker out until the resume, and ``rollout/abort`` aborts all from the worker's loop."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    _upstream_discovery_sync()  # skips on 1.4.x
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DYN_FILE_KV": str(tmp_path / "kv"), "DYN_LOG": "error"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.dynamo.real_handler16"],
        capture_output=True, text=True, timeout=120, cwd=root, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["instances_at_start"] == 1
    stock = out["stock"]["answered"]
    assert stock[0] == ["pause_generation", "ok", 0] and stock[2] == ["continue_generation", "ok", 1]
    assert stock[1][0] == "flush_cache" and stock[1][2] == 0
    assert stock[1][1].startswith("Exception: Unable to unregister endpoint instance from discovery")
    assert stock[3:6] == stock[:3]  # the same at the next update: back in discovery after each resume
    assert stock[6][0] == "abort_request"
    assert "no current event loop in thread 'dynamo-sglang-engine-route'" in stock[6][1]
    assert len(stock) == 7  # no rollout/abort on stock
    # Two paused updates in a row: out of discovery once per pause, back at each resume.
    shim = out["shim"]["answered"]
    update = [["pause_generation", "ok", 0], ["flush_cache", "ok", 0], ["continue_generation", "ok", 1]]
    assert shim[:6] == update * 2
    assert shim[-1] == ["rollout/abort", "ok", 1]
    assert out["shim"]["engine"] == ["pause:retract", "flush", "continue"] * 2 + ["abort::True"]
