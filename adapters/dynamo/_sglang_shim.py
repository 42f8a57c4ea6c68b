"""Run ``dynamo.sglang`` with in-process patches for what upstream still lacks, no change to Dynamo's code.

``python -m rollout_backends.adapters.dynamo._sglang_shim <dynamo.sglang args>`` behaves like
``python -m dynamo.sglang <args>`` except for the patches below. Which apply is decided once, at
start, from the installed ai-dynamo's own code (:func:`detect_upstream`: signatures and source
lines, never a version string); each patch names the upstream line it works around, and
``tests/dynamo/test_sglang_shim.py`` has an *upstream watch* per patch that fails when that line
changes in the installed version (so a fix upstream is noticed and the patch dropped).

=====  ==============================  ===============  ==================================================
patch  what                            ai-dynamo 1.4.2  ai-dynamo 1.6.1
=====  ==============================  ===============  ==================================================
1      per-token logprobs (cursor)     applied          fixed upstream (no cursor argument): not applied
2      chunks are checked deltas       applied          applied (``output_ids`` still passed through)
3      engine_data version / finish    applied          applied (no weight_version; abort -> "cancelled")
4      worker-side text                applied          applied (the 1.6.1 frontend's decoder no longer
                                                        panics, but loses a split character)
5      rollout/* engine routes         applied          applied (flavor ``sglang16-shim``): abort by id
                                                        with partial tokens, abort all from the loop
6a     top logprobs gate               applied          gone upstream (``logprobs >= 1`` passed through)
6b     prompt logprobs                 applied          returned upstream (``engine_data.prompt_logprobs``)
7      control results (msgspec)       applied          no ``call_tokenizer_manager`` in 1.6.x
8      stop strings in the worker      applied          not applied: ``sglang16`` declares no stop strings
                                                        (refused by the wire, naming ``sampling.stop``)
9      one unregister while paused     no re-sync       applied (file discovery refuses a second one)
=====  ==============================  ===============  ==================================================

1. **Per-token logprobs.** ``dynamo.sglang`` forces SGLang's ``incremental_streaming_output``, under
   which SGLang 0.5.16 slices ``meta_info.output_token_logprobs`` / ``output_top_logprobs`` to the
   current chunk (``_slice_streaming_output_meta_info``, and ``_coalesce_streaming_chunks``
   concatenates them when chunks queue up). ai-dynamo 1.4.2's
   ``dynamo.common.backend.logprobs.extract_from_sglang_meta(meta_info, n_so_far)`` slices them
   again as if cumulative (``[n_so_far:]``), so only the first chunk's logprobs survive. The patch
   calls the original with ``n_so_far=0`` (the per-chunk arrays are already aligned with the
   chunk's ``output_ids``). This is what ai-dynamo 1.6.1 does upstream (the cursor argument is
   gone there). Applied only when the installed function still takes the cursor.
2. **Chunks are deltas, checked.** SGLang answers a request aborted in its waiting queue (e.g. one
   parked by a RETRACT pause) with a final chunk that repeats the last token and carries the
   *cumulative* logprobs (``TokenizerManager._handle_abort_req``). Each chunk is checked against
   SGLang's cumulative ``meta_info.completion_tokens`` and cut back to what is new.
3. **engine_data on the final chunk:** ``weight_version`` (SGLang's ``meta_info.weight_version``)
   and ``finish_reason`` (SGLang's raw finish type, e.g. ``"abort"``; the 1.4.2 frontend reports
   Dynamo's ``"cancelled"`` as ``"stop"``). The frontend forwards it as ``nvext.engine_data`` when
   the client asks for ``extra_fields: ["engine_data"]``. Every chunk also carries
   ``engine_data[CHUNK_VERSION_KEY]``: the ``meta_info.weight_version`` of the SGLang output it was
   built from (the version SGLang's tokenizer manager holds when it builds that output, as in
   SGLang's own streamed events), which the frontend forwards on non-final chunks too (measured,
   1.4.2 and 1.6.1), so a stream's version spans hold across an update.
4. **Worker-side text** (``_detok``): every chunk gets ``text`` and ``tokens`` from our char-safe
   incremental detokenizer, so the 1.4.2 frontend never runs its own decoder, which panics on some
   UTF-8 splits (HTTP 500). Not for requests with ``stop_conditions.stop`` (the frontend matches
   those on its own text); ``ROLLOUT_DYN_WORKER_TEXT=0`` turns it off.
5. **Engine routes** (``register_engine_routes`` wrapped): ``rollout/weight_version`` →
   ``{"weight_version"}`` (1.4.2 has no route that returns it), ``rollout/server_args`` (SGLang's
   resolved ``ServerArgs``, as ``launch_server``'s ``/server_info`` shows them) and ``rollout/abort`` ``{"rid"}`` |
   ``{"abort_all": true}``: aborts one request by *our* id (``nvext.annotations`` ``rid:<id>``,
   mapped to SGLang's id from its first chunk) inside SGLang, so the request still returns its
   partial tokens with finish ``abort`` (cancelling the HTTP call loses them). On 1.6.x too: stock
   1.6.1 has no abort by id, and its ``abort_request`` route (``--engine-route abort_request:tm``)
   runs SGLang 0.5.16's synchronous ``abort_request`` in a bare thread (``engine_routes.py``
   ``_run_in_thread``), which fails for want of an event loop (HTTP 500 "There is no current event
   loop in thread 'dynamo-sglang-engine-route'", H200 tier 2026-12-06); this route calls it from the
   worker's own loop.
6. **Top-k and prompt logprobs.** 1.4.2 refuses ``logprobs >= 1`` unless
   ``DYN_SGL_ALLOW_TOP_LOGPROBS=1`` (``dynamo/common/backend/logprobs.py``: SGLang's tokenizer
   manager detokenizes each alternative serially, sgl-project/sglang#24447). The shim sets it
   (``allow_top_logprobs``): the cost falls only on requests that ask for alternatives, and the
   adapter names them by id (``return_tokens_as_token_ids``). 1.4.2 asks SGLang for prompt logprobs
   (``output_options.prompt_logprobs`` -> ``logprob_start_len=0``) but never returns them: the shim
   puts SGLang's ``meta_info.input_token_logprobs`` on the final chunk as
   ``engine_data.prompt_logprobs`` (the whole prompt's, the first ``None``), as our worker does.
7. **Control results:** ``call_tokenizer_manager`` results that are msgspec structs (SGLang 0.5.16's
   ``FlushCacheReqOutput``, ...) come back as their fields instead of ``{"result": str(struct)}``,
   so ``success: false`` (a refused flush) is visible.
8. **Stop strings, matched here.** dynamo.sglang 1.4.2 runs SGLang with ``skip_tokenizer_init``
   and passes it no stop strings (``_build_sampling_params``, token path); the frontend matched
   them on its own text and ended the stream before the worker's final chunk, so the served
   version and worker id never came (H200 tier 2026-12-02: ``stop_strings`` failed with
   "weight_version is None"). The adapter sends them as an ``nvext.annotations`` entry
   (``_wire.STOP_ANNOTATION``) the frontend does not act on; the shim checks SGLang's rule
   (``sglang_native.StopStrings``, the reference engine's) after each token as outputs arrive, and
   at a match cuts the output after that token (``output_ids`` and the per-token ``meta_info``
   arrays; SGLang keeps the token that completes the string), finishes it as ``stop``, aborts the
   request inside SGLang so it generates no more, and puts the string on the final chunk as
   ``engine_data[MATCHED_STOP_KEY]``. The text sent is the whole output's; the wire cuts it at
   the string (``trim_at_stop``, ``no_stop_trim``). A worker without ``tokenizer.json`` refuses
   such a request (``engine_data.refused`` naming ``sampling.stop``).
9. **One unregister while paused** (1.6.x). After every engine route but the built-in ``control/*``
   ones, 1.6.1 makes discovery match SGLang's pause state
   (``handler_base.py`` ``_invoke_engine_route`` → ``_sync_discovery_with_sglang_pause_state``):
   while paused it unregisters the worker again each time. File discovery refuses the second
   unregister ("Could not find key"; etcd takes it: both measured on CPU 2026-12-06 with the 1.4.2
   and 1.6.1 runtimes), so the route's answer is lost to HTTP 500 "Unable to unregister endpoint
   instance from discovery" and a paused weight update fails at its flush (H200 tier 2026-12-06,
   three checks). The patch skips the sync while the worker is paused and already unregistered by
   it; a resume registers it again as upstream does.

All patches live in the worker's main process (where the handler runs); SGLang's scheduler
subprocesses are not involved. Each feature-detects and is a no-op where the layout differs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import logging
import os
import runpy
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollout_backends import InvalidRequest
from rollout_backends.sglang_native import StopStrings, native_field

from ._detok import IncrementalDetokenizer, TextCodec, TextDecoder, load_text_codec, worker_text_enabled
from ._wire import CHUNK_VERSION_KEY, MATCHED_STOP_KEY, rid_from_annotations, stop_strings_from_annotations
from ._worker import refusal_chunk

logger = logging.getLogger("rollout_backends.dynamo_sglang_shim")

_PATCHED = "_rollout_backends_patched"
#: ai-dynamo 1.4.2's gate on top logprobs (``dynamo.common.backend.logprobs``).
TOP_LOGPROBS_ENV = "DYN_SGL_ALLOW_TOP_LOGPROBS"
#: An abort that arrives before its request: kept this long for the request to show up.
_PENDING_ABORT_S = 60.0
#: SGLang ``meta_info`` arrays aligned with ``output_ids``.
_PER_TOKEN_META = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class _StopMatch:
    """One request's stop strings (patch 8): the output so far, checked after each token."""

    __slots__ = ("decode", "ids", "rule")

    def __init__(self, rule: StopStrings, decode: TextDecoder) -> None:
        self.rule = rule
        self.decode = decode
        self.ids: list[int] = []

    def _tail_text(self, ids: Sequence[int]) -> str:
        # Special tokens kept: HF's decode default, what SGLang's check calls (as the reference engine).
        return self.decode(ids, False)

    def cut(self, res: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """``res`` (a delta) up to the token that completes a stop string, and that string; else
        ``res`` and ``None``. SGLang checks the length limit before stop strings and stop strings
        before stop tokens (``Req.check_finished``, 0.5.16; as the reference engine): a match on
        the last token of an output that finished on length is not one."""
        ids = list(res.get("output_ids") or [])
        meta = res.get("meta_info") or {}
        fr = meta.get("finish_reason")
        length_at_end = isinstance(fr, dict) and fr.get("type") == "length"
        for k, t in enumerate(ids):
            self.ids.append(int(t))
            if length_at_end and k == len(ids) - 1:
                break
            matched = self.rule.match(self.ids, self._tail_text)
            if matched is None:
                continue
            keep = k + 1
            cut_meta = dict(meta)
            for key in _PER_TOKEN_META:
                arr = meta.get(key)
                if isinstance(arr, list) and len(arr) == len(ids):
                    cut_meta[key] = arr[:keep]
            # "matched" stays None: 1.4.2's loop would send the string as stop_reason, which the
            # frontend was never told of; the string travels in engine_data instead.
            cut_meta["finish_reason"] = {"type": "stop", "matched": None}
            cut_meta["completion_tokens"] = len(self.ids)
            return {**res, "output_ids": ids[:keep], "meta_info": cut_meta}, matched
        return res, None


class _Request:
    """What the patches know of one in-flight request (keyed by the frontend's context id)."""

    __slots__ = ("abort_in_engine", "abort_requested", "detok", "prompt_logprobs", "rid", "sglang_rid", "stops")

    def __init__(
        self,
        rid: str | None,
        detok: IncrementalDetokenizer | None,
        abort_in_engine: Callable[[str], Any],
        stops: _StopMatch | None = None,
    ) -> None:
        self.rid = rid
        self.detok = detok
        self.abort_in_engine = abort_in_engine  #: ``abort(sglang_rid)`` in the engine that runs it
        self.sglang_rid: str | None = None
        self.abort_requested = False
        self.stops = stops
        self.prompt_logprobs = True  #: patch 6b: put SGLang's prompt logprobs on the final chunk


class Requests:
    """In-flight requests by context id and by our request id; aborts that came early."""

    def __init__(self) -> None:
        self.by_context: dict[str, _Request] = {}
        self.by_rid: dict[str, _Request] = {}
        self.pending_aborts: dict[str, float] = {}

    def begin(
        self,
        context_id: str,
        request: Mapping[str, Any],
        codec: TextCodec | None,
        abort_in_engine: Callable[[str], Any],
        *,
        worker_text: bool = True,
        stop_strings: bool = True,
        prompt_logprobs: bool = True,
    ) -> _Request:
        """Register a request; ``InvalidRequest`` (naming ``sampling.stop``) for stop strings this
        worker cannot match (no tokenizer, or patch 8 not applied on this ai-dynamo)."""
        rid = rid_from_annotations(request)
        strings = stop_strings_from_annotations(request)
        stops = None
        if strings and not stop_strings:
            # Never dropped silently: the wire sends the annotation only to fleets that declare it.
            raise InvalidRequest(
                "sampling.stop", "this dynamo.sglang matches no stop strings (shim patch 8 not applied)"
            )
        if strings:
            if codec is None:
                raise InvalidRequest("sampling.stop", "this worker has no tokenizer.json: stop strings cannot match")
            stops = _StopMatch(StopStrings.of(strings, codec.count_tokens), codec.decode)
        detok = None
        if codec is not None and worker_text and not (request.get("stop_conditions") or {}).get("stop"):
            skip = bool((request.get("output_options") or {}).get("skip_special_tokens") or False)
            detok = IncrementalDetokenizer(codec.decode, request.get("token_ids") or (), skip_special_tokens=skip)
        r = _Request(rid, detok, abort_in_engine, stops)
        r.prompt_logprobs = prompt_logprobs
        self.by_context[context_id] = r
        if rid is not None:
            self.by_rid[rid] = r
            now = time.monotonic()
            for k in [k for k, t in self.pending_aborts.items() if now - t > _PENDING_ABORT_S]:
                del self.pending_aborts[k]
            r.abort_requested = self.pending_aborts.pop(rid, None) is not None
        return r

    def end(self, context_id: str) -> None:
        r = self.by_context.pop(context_id, None)
        if r is not None and r.rid is not None and self.by_rid.get(r.rid) is r:
            del self.by_rid[r.rid]

    def abort(self, rid: str) -> bool:
        """Abort ``rid`` now if SGLang knows it, else as soon as its first chunk names it."""
        r = self.by_rid.get(rid)
        if r is None:
            self.pending_aborts[rid] = time.monotonic()
            return False
        r.abort_requested = True
        if r.sglang_rid is not None:
            r.abort_in_engine(r.sglang_rid)
        return True


REQUESTS = Requests()


def _context_id(context: Any) -> str:
    return str(context.id()) if context is not None and hasattr(context, "id") else str(id(context))


def _abort_in_engine(handler: Any) -> Callable[[str], Any]:
    def abort(sglang_rid: str) -> Any:
        return handler.engine.tokenizer_manager.abort_request(rid=sglang_rid)

    return abort


_CODECS: dict[str, TextCodec | None] = {}


def _text_codec(handler: Any) -> TextCodec | None:
    """The model's tokenizer, loaded once (the tokenizer path the frontend also reads): for worker
    text and for stop strings (matched even with worker text off)."""
    try:
        args = handler.engine.tokenizer_manager.server_args
        path = str(getattr(args, "tokenizer_path", None) or args.model_path)
    except AttributeError:
        return None
    if path not in _CODECS:
        _CODECS[path] = load_text_codec(path)
    return _CODECS[path]


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


def _as_delta(res: dict[str, Any], seen: int) -> dict[str, Any]:
    """``res`` cut back to the tokens after the first ``seen`` (SGLang's cumulative count decides)."""
    meta = res.get("meta_info") or {}
    total = meta.get("completion_tokens")
    ids = list(res.get("output_ids") or [])
    if not isinstance(total, int) or seen + len(ids) == total:
        return res
    new = max(0, total - seen)
    if new >= len(ids):
        return res  # more new tokens than ids: nothing to cut (and nothing we could invent)
    fixed_meta = dict(meta)
    for key in _PER_TOKEN_META:
        arr = meta.get(key)
        if isinstance(arr, list) and len(arr) == total:  # cumulative: keep the new part
            fixed_meta[key] = arr[seen:]
    return {**res, "output_ids": ids[len(ids) - new :], "meta_info": fixed_meta}


def _note_output(res: dict[str, Any], req: _Request | None, seen: dict[str, Any]) -> Any:
    """From one SGLang output's ``meta_info``: SGLang's id of the request (an abort asked for before
    it was known goes out now), and what the final chunk carries (patches 3 and 6b: the version,
    the prompt logprobs, SGLang's finish type) into ``seen``. Returns the output's finish reason."""
    meta = res.get("meta_info") or {}
    if req is not None and req.sglang_rid is None and meta.get("id"):
        req.sglang_rid = str(meta["id"])
        if req.abort_requested and not meta.get("finish_reason"):
            req.abort_in_engine(req.sglang_rid)
    if meta.get("weight_version") is not None:
        seen["weight_version"] = meta["weight_version"]
    prompt_lps = meta.get("input_token_logprobs")
    wants = req is None or req.prompt_logprobs
    if wants and "prompt_logprobs" not in seen and isinstance(prompt_lps, list) and prompt_lps:
        # [logprob, id, text] per prompt position from 0, the first logprob None; the
        # adapter checks the count against the prompt.
        seen["prompt_logprobs"] = [e[0] if isinstance(e, (list, tuple)) and e else None for e in prompt_lps]
    fr = meta.get("finish_reason")
    if isinstance(fr, dict) and fr.get("type"):
        seen["finish_reason"] = fr["type"]
    return fr


def _annotate_chunk(out: dict[str, Any], seen: Mapping[str, Any], detok: IncrementalDetokenizer | None) -> None:
    """Patches 3, 4 and 8 on one chunk that 1.4.2's loop built, in place: its tokens' version,
    worker-side text, and on the final chunk ``engine_data`` with what ``seen`` recorded."""
    # tap() records each SGLang output's version just before 1.4.2's loop builds this chunk
    # from it (one chunk per output, built as it is pulled): the version of these tokens.
    version = seen.get("weight_version")
    if version is not None:
        out["engine_data"] = {**(out.get("engine_data") or {}), CHUNK_VERSION_KEY: str(version)}
    if detok is not None:
        # ``tokens`` is what the frontend builds logprobs.tokens from.
        final = bool(out.get("finish_reason"))
        out["tokens"], out["text"] = detok.chunk(out.get("token_ids") or [], last=final)
    if out.get("finish_reason"):
        ed = dict(out.get("engine_data") or {})
        ed.setdefault("weight_version", seen.get("weight_version"))
        ed.setdefault("finish_reason", seen.get("finish_reason"))
        if "prompt_logprobs" in seen:
            ed.setdefault("prompt_logprobs", seen["prompt_logprobs"])
        if "matched_stop" in seen:
            ed[MATCHED_STOP_KEY] = seen["matched_stop"]
        out["engine_data"] = ed


def patch_token_stream(
    handler_cls: Any = None, *, stop_strings: bool = True, prompt_logprobs: bool = True, worker_text: bool = True
) -> bool:
    """Wrap ``generate`` and ``_process_token_stream`` (patches 2-4, 6b and 8 where ``prompt_logprobs``
    / ``stop_strings``, and the abort bookkeeping). Idempotent."""
    if handler_cls is None:
        from dynamo.sglang.request_handlers.llm.decode_handler import DecodeWorkerHandler as handler_cls
    orig_stream = handler_cls._process_token_stream
    orig_generate = handler_cls.generate
    if getattr(orig_stream, _PATCHED, False):
        return True

    async def generate(self: Any, request: dict[str, Any], context: Any, *args: Any, **kwargs: Any) -> Any:
        key = _context_id(context)
        try:
            REQUESTS.begin(
                key, request, _text_codec(self), _abort_in_engine(self),
                worker_text=worker_text and worker_text_enabled(), stop_strings=stop_strings,
                prompt_logprobs=prompt_logprobs,
            )  # fmt: skip
        except InvalidRequest as exc:
            # The wire reads it as InvalidRequest naming the field; nothing reaches SGLang.
            yield refusal_chunk(InvalidRequest(native_field(exc.field), exc.reason), request, native=False)
            return
        try:
            async for out in orig_generate(self, request, context, *args, **kwargs):
                yield out
        finally:
            REQUESTS.end(key)

    async def _process_token_stream(
        self: Any, stream_source: AsyncIterator[dict[str, Any]], *args: Any, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        context = args[0] if args else kwargs.get("context")
        req = REQUESTS.by_context.get(_context_id(context))
        seen: dict[str, Any] = {"n": 0}

        async def tap() -> AsyncIterator[dict[str, Any]]:
            async for res in stream_source:
                res = _as_delta(res, seen["n"])
                seen["n"] += len(res.get("output_ids") or [])
                fr = _note_output(res, req, seen)
                if req is not None and req.stops is not None:
                    res, matched = req.stops.cut(res)
                    if matched is not None:
                        if not fr and req.sglang_rid is not None:
                            req.abort_in_engine(req.sglang_rid)  # SGLang generates no more for it
                        seen["finish_reason"] = "stop"
                        seen["matched_stop"] = matched
                        yield res
                        # What SGLang still sends (tokens past the match, its abort): dropped, but
                        # read to its end, so the request leaves SGLang the way an abort does.
                        async for _ in stream_source:
                            pass
                        return
                yield res

        detok = req.detok if req is not None else None
        async for out in orig_stream(self, tap(), *args, **kwargs):
            _annotate_chunk(out, seen, detok)
            yield out

    for fn in (generate, _process_token_stream):
        setattr(fn, _PATCHED, True)
    handler_cls.generate = generate
    handler_cls._process_token_stream = _process_token_stream
    return True


def patch_routes(handler_cls: Any = None) -> bool:
    """Add ``rollout/weight_version`` and ``rollout/abort`` to the handler's engine routes. Idempotent."""
    if handler_cls is None:
        from dynamo.sglang.request_handlers.handler_base import BaseWorkerHandler as handler_cls
    orig = handler_cls.register_engine_routes
    if getattr(orig, _PATCHED, False):
        return True

    def register_engine_routes(self: Any, runtime: Any) -> None:
        orig(self, runtime)

        async def weight_version(body: dict[str, Any]) -> dict[str, Any]:
            return {"weight_version": self.engine.tokenizer_manager.server_args.weight_version}

        async def abort(body: dict[str, Any]) -> dict[str, Any]:
            if body.get("abort_all"):
                # Synchronous in SGLang 0.5.16 (dispatches the abort and returns).
                self.engine.tokenizer_manager.abort_request(abort_all=True)
                return {"status": "ok"}
            rid = body.get("rid")
            if not isinstance(rid, str) or not rid:
                return {"success": False, "message": "rid: must be a non-empty string"}
            return {"status": "ok", "found": REQUESTS.abort(rid)}

        async def server_args(body: dict[str, Any]) -> dict[str, Any]:
            return server_args_dict(self.engine.tokenizer_manager.server_args)

        runtime.register_engine_route("rollout/weight_version", weight_version)
        runtime.register_engine_route("rollout/abort", abort)
        runtime.register_engine_route("rollout/server_args", server_args)

    setattr(register_engine_routes, _PATCHED, True)
    handler_cls.register_engine_routes = register_engine_routes
    return True


#: The attribute patch 9 keeps on a handler: whether its last discovery sync unregistered it.
_UNREGISTERED = "_rollout_backends_unregistered"


def patch_discovery_sync(handler_cls: Any = None) -> bool:
    """Unregister a paused worker from discovery once, not after every engine route (patch 9). Idempotent."""
    if handler_cls is None:
        from dynamo.sglang.request_handlers.handler_base import BaseWorkerHandler as handler_cls
    orig = handler_cls._sync_discovery_with_sglang_pause_state
    if getattr(orig, _PATCHED, False):
        return True

    async def _sync_discovery_with_sglang_pause_state(self: Any) -> None:
        tm = getattr(self.engine, "tokenizer_manager", None) if self.engine is not None else None
        paused = bool(getattr(tm, "is_pause", False))
        if paused and getattr(self, _UNREGISTERED, False):
            return  # out of discovery since the pause: a second unregister is refused (file discovery)
        await orig(self)
        setattr(self, _UNREGISTERED, paused)

    setattr(_sync_discovery_with_sglang_pause_state, _PATCHED, True)
    handler_cls._sync_discovery_with_sglang_pause_state = _sync_discovery_with_sglang_pause_state
    return True


def server_args_dict(server_args: Any) -> dict[str, Any]:
    """SGLang's resolved ``ServerArgs`` as JSON values (what ``launch_server``'s ``/server_info``
    shows), so a benchmark can hold a Dynamo worker's engine settings against an SGLang server's."""
    fields = getattr(server_args, "__dataclass_fields__", None)
    names = list(fields) if isinstance(fields, dict) else list(vars(server_args))
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(server_args, name, None)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)  # nested configs, as /server_info shows them
        # Round-tripped through JSON: a nested value the route's encoder cannot take becomes its str().
        out[name] = json.loads(json.dumps(value, default=str))
    return out


def patch_control_results(mixin_cls: Any = None) -> bool:
    """Return msgspec-struct results of ``call_tokenizer_manager`` as their fields. Idempotent."""
    if mixin_cls is None:
        from dynamo.sglang.request_handlers.handler_base import RLMixin as mixin_cls
    orig = mixin_cls._normalize_result
    if getattr(orig, _PATCHED, False):
        return True
    try:
        import msgspec
    except ImportError:  # SGLang's io_struct uses msgspec; without it there is nothing to convert
        return False

    def _normalize_result(self: Any, result: Any) -> dict[str, Any]:
        if isinstance(result, msgspec.Struct):
            # By field name, not msgspec.to_builtins(result): SGLang 0.5.16's io_struct.BaseReq is
            # ``array_like=True, tag=True``, which to_builtins encodes as a list
            # (["FlushCacheReqOutput", rid, ipc, success, message]); the wire then saw no
            # ``success`` and a flush SGLang refused under pause(IN_PLACE) read as done (the
            # 2026-12-02 H200 tier's one Dynamo failure).
            return {name: msgspec.to_builtins(getattr(result, name)) for name in result.__struct_fields__}
        return orig(self, result)  # type: ignore[no-any-return]

    setattr(_normalize_result, _PATCHED, True)
    mixin_cls._normalize_result = _normalize_result
    return True


def allow_top_logprobs() -> None:
    """Let 1.4.2 pass ``logprobs >= 1`` to SGLang (patch 6a); an explicit setting is kept."""
    os.environ.setdefault(TOP_LOGPROBS_ENV, "1")


# -- what the installed ai-dynamo still lacks, read once from its own code -----------------------

#: dynamo.sglang files read by :func:`detect_upstream` (relative to the ``dynamo`` package).
DECODE_HANDLER = "sglang/request_handlers/llm/decode_handler.py"
HANDLER_BASE = "sglang/request_handlers/handler_base.py"


def dynamo_source(relpath: str) -> str | None:
    """The text of ``dynamo/<relpath>`` as installed, or ``None``; read, not imported (dynamo.sglang's
    handlers import SGLang, which a CPU machine lacks)."""
    spec = importlib.util.find_spec("dynamo")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / relpath
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return None


@attrs.frozen(kw_only=True)
class Upstream:
    """What the installed ai-dynamo does where a patch hooks in (``detect_upstream``)."""

    #: ``extract_from_sglang_meta(meta_info, num_output_logprobs_so_far)`` slices per-chunk logprobs
    #: as cumulative (1.4.x, ``dynamo/common/backend/logprobs.py``); 1.6.x takes no cursor.
    logprob_cursor: bool
    #: ``logprobs >= 1`` refused unless ``DYN_SGL_ALLOW_TOP_LOGPROBS`` (1.4.x's
    #: ``DYN_SGL_ALLOW_TOP_LOGPROBS_ENV``); 1.6.x passes top-k through.
    top_logprobs_gate: bool
    #: The decode handler puts SGLang's prompt logprobs in ``engine_data`` itself (1.6.x:
    #: ``extract_prompt_logprobs_from_sglang_meta`` called in ``_process_token_stream``).
    returns_prompt_logprobs: bool
    #: 1.4.x's ``call_tokenizer_manager`` route (``RLMixin._normalize_result``); 1.6.x serves native
    #: routes (``dynamo/sglang/engine_routes.py``) and the adapter's ``sglang16`` flavor.
    tokenizer_manager_route: bool
    #: Engine routes re-sync discovery with SGLang's pause state (1.6.x ``handler_base.py``
    #: ``_sync_discovery_with_sglang_pause_state``), unregistering a paused worker each time.
    discovery_resync: bool


def detect_upstream() -> Upstream:
    import dynamo.common.backend.logprobs as lp

    params = list(inspect.signature(lp.extract_from_sglang_meta).parameters.values())
    cursor = len(params) >= 2 and params[1].kind in (params[1].POSITIONAL_ONLY, params[1].POSITIONAL_OR_KEYWORD)
    decode = dynamo_source(DECODE_HANDLER) or ""
    base = dynamo_source(HANDLER_BASE) or ""
    return Upstream(
        logprob_cursor=cursor,
        top_logprobs_gate=hasattr(lp, "DYN_SGL_ALLOW_TOP_LOGPROBS_ENV"),
        returns_prompt_logprobs="extract_prompt_logprobs_from_sglang_meta" in decode,
        tokenizer_manager_route="class RLMixin" in base and "_normalize_result" in base,
        discovery_resync="def _sync_discovery_with_sglang_pause_state" in base,
    )


def plan(up: Upstream) -> dict[str, str | None]:
    """Each patch group -> ``None`` (apply) or why it is not applied on this ai-dynamo."""
    legacy = None if up.tokenizer_manager_route else "1.6.x flavor sglang16: native routes, capabilities declared"
    resync = None if up.discovery_resync else "no discovery re-sync after engine routes upstream"
    return {
        "logprobs": None if up.logprob_cursor else "fixed upstream (extract_from_sglang_meta takes no cursor)",
        "top_logprobs": None if up.top_logprobs_gate else "no gate upstream (top-k passed through)",
        "prompt_logprobs": "returned upstream (engine_data.prompt_logprobs)" if up.returns_prompt_logprobs else None,
        "token_stream": None,  # patches 2, 3: still lacking in 1.4.2 and 1.6.1 (see the upstream watches)
        # Patch 4: the frontend's own decoder (Rust) panics on a UTF-8 split (1.4.2) or loses the
        # character (1.6.1); test_watch_patch_4_... checks the installed frontend still does.
        "worker_text": None,
        "stop_strings": legacy,
        "routes": None,  # patch 5: no abort by id upstream (1.4.2, 1.6.1); abort all from the loop
        "control_results": None if up.tokenizer_manager_route else "no call_tokenizer_manager upstream",
        "discovery_sync": resync,
    }


def main() -> None:
    up = detect_upstream()
    todo = plan(up)
    for name, why in todo.items():
        logger.info("shim %s: %s", name, "applied" if why is None else f"not applied, {why}")
    if todo["top_logprobs"] is None:
        allow_top_logprobs()
    if todo["logprobs"] is None:
        patch_logprobs()
    patch_token_stream(
        stop_strings=todo["stop_strings"] is None,
        prompt_logprobs=todo["prompt_logprobs"] is None,
        worker_text=todo["worker_text"] is None,
    )
    patches = (
        ("routes", patch_routes),
        ("control_results", patch_control_results),
        ("discovery_sync", patch_discovery_sync),
    )
    for name, patch in patches:
        if todo[name] is not None:
            continue
        try:
            patch()
        except (ImportError, AttributeError) as exc:  # another layout: the adapter falls back
            logger.warning("%s not applied: %s", patch.__name__, exc)
    sys.argv = ["dynamo.sglang", *sys.argv[1:]]
    runpy.run_module("dynamo.sglang", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
