"""Our Python Dynamo worker (``adapters/dynamo/_worker.py``) over the no-compute engine.

``python -m bench.probes.nocompute_worker --engine bench.probes.nocompute_worker:engine
--engine-arg '{"output_tokens": 128, "vocab_size": 512}' <the _worker flags>``

Everything is the library's worker (request mapping, chunking, worker-side text, engine_data);
only the engine is ``NoComputeEngine`` (every answer at once, no model), so what costs CPU is
the worker's Dynamo path and the frontend. Probe knobs, read from the environment (all off by
default, i.e. the library's behaviour):

* ``PROBE_TOKENS_PER_CHUNK=N`` (default 1, what the library does): chunks of N tokens instead of
  one chunk per token (what SGLang's ``--stream-interval N`` does on a GPU). The library's own
  ``_add_text`` then gives each N-token chunk its ``tokens`` and ``text``, as the shim does for
  SGLang's multi-token chunks.
* ``PROBE_PER_TOKEN_DETOK=1``: the earlier per-token detokenizer (``per_token_detok.py``).
* ``PROBE_PUSH_EGRESS=1`` (ai-dynamo 1.6.x): ``generate`` takes the ``response_sender`` keyword,
  so Dynamo drives it on its push egress path (``response_sender.send(chunk)`` under the GIL the
  handler holds, no per-chunk hop to a tokio thread; what 1.6.1's TRT-LLM worker does with
  ``push_egress_capable``). 1.4.2 has no such path (the keyword is never passed).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from rollout_backends.adapters.dynamo import _worker
from rollout_backends.adapters.reference import NoComputeEngine


def engine(arg: str) -> NoComputeEngine:
    kw = dict(json.loads(arg)) if arg else {}
    return NoComputeEngine(
        int(kw.get("output_tokens", 128)),
        worker_id=str(kw.get("worker_id", "no-compute")),
        weight_version=str(kw.get("weight_version", "default")),
        vocab_size=int(kw.get("vocab_size", 512)),
    )


def _grouped(n: int) -> Any:
    orig = _worker.DynamoWorker._chunks

    def _chunks(self: Any, gen: Any, request: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        decoder, self.text_decoder = self.text_decoder, None  # per-token chunks without text ...
        try:
            per_token = orig(self, gen, request)
        finally:
            self.text_decoder = decoder
        out: list[dict[str, Any]] = []
        for i in range(0, len(per_token), n):
            group = per_token[i : i + n]
            c: dict[str, Any] = {"token_ids": [t for g in group for t in g["token_ids"]], "index": 0}
            if "log_probs" in group[0]:
                c["log_probs"] = [lp for g in group for lp in g["log_probs"]]
            for k, v in group[-1].items():  # finish_reason, usage, engine_data of the last chunk
                c.setdefault(k, v)
            out.append(c)
        self._add_text(out, request or {})  # ... then the library's text, per N-token chunk
        return out

    return _chunks


def _push(orig: Any) -> Any:
    def generate(self: Any, request: dict[str, Any], context: Any = None, response_sender: Any = None) -> Any:
        stream = orig(self, request, context)
        if response_sender is None:
            return stream

        async def drive() -> Any:
            async for chunk in stream:
                response_sender.send(chunk)
            response_sender.close()
            if False:  # an async generator that yields nothing (Dynamo calls __anext__ once)
                yield

        return drive()

    return generate


def main() -> None:
    n = int(os.environ.get("PROBE_TOKENS_PER_CHUNK", "1"))
    if n > 1:
        _worker.DynamoWorker._chunks = _grouped(n)  # type: ignore[method-assign]
    if os.environ.get("PROBE_PER_TOKEN_DETOK") == "1":
        from bench.probes import per_token_detok

        per_token_detok.patch()
    if os.environ.get("PROBE_PUSH_EGRESS") == "1":
        _worker.DynamoWorker.generate = _push(_worker.DynamoWorker.generate)  # type: ignore[method-assign]
    _worker.main()


if __name__ == "__main__":
    main()
