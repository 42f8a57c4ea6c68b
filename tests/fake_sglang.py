"""An in-memory stand-in for SGLang workers behind a MockTransport (no network, no engine).

It keeps per-worker state (paused, version, session) and records every call, and can be told to
fail one step on one worker, so fan-out and the weight-update transaction can be checked exactly.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import attrs

from rollout_backends.adapters.sglang import SGLangWire
from rollout_backends.kit import HttpClient, HttpFleetBackend, HttpRequest, HttpResponse, MockTransport, Worker


@attrs.define
class FakeWorker:
    url: str
    paused: str | None = None
    version: str = "v0"
    in_session: bool = False
    flushed: int = 0
    fail: set[str] = attrs.field(factory=set)  # paths that answer success:false
    down: bool = False


class FakeSGLangFleet:
    def __init__(self, n: int = 2, *, begin_end: bool = True) -> None:
        self.workers = {f"http://w{i}:3000{i}": FakeWorker(f"http://w{i}:3000{i}") for i in range(n)}
        self.begin_end = begin_end
        self.calls: list[tuple[str, str, Any]] = []
        self.transport = MockTransport(self.handle)

    def handle(self, req: HttpRequest) -> HttpResponse:
        parts = urlsplit(req.url)
        base = f"{parts.scheme}://{parts.netloc}"
        path = parts.path
        body = req.json
        self.calls.append((base, path, body))
        w = self.workers[base]
        if w.down:
            from rollout_backends import ConnectionFailed

            raise ConnectionFailed(f"{req.method} {req.url}: cannot connect (refused)")
        if path in w.fail and path == "/flush_cache":
            return HttpResponse(400, b"Cannot flush: injected failure")
        if path in w.fail:
            return HttpResponse.from_json({"success": False, "message": f"injected failure at {path}"})
        if path == "/pause_generation":
            w.paused = body["mode"]
        elif path == "/continue_generation":
            w.paused = None
        elif path == "/flush_cache":
            w.flushed += 1
            return HttpResponse(200, b"Cache flushed.")
        elif path == "/begin_weight_update":
            w.in_session = True
        elif path == "/end_weight_update":
            w.in_session = False
        elif path == "/update_weight_version":
            assert body["abort_all_requests"] is False
            w.version = body["new_version"]
        elif path == "/model_info":
            return HttpResponse.from_json({"weight_version": w.version})
        elif path in ("/health", "/health_generate"):
            # Stock SGLang (0.5.x, SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION on by default) serves both
            # by generating one token: while paused that blocks SGLANG_HEALTH_CHECK_TIMEOUT (20 s),
            # then answers 503. The wait is left out; the answer is not.
            return HttpResponse(503, b"") if w.paused else HttpResponse(200, b"")
        elif path == "/generate":
            n = body["sampling_params"]["max_new_tokens"]
            out = list(range(1, n + 1))

            def answer(k: int, finished: bool) -> dict[str, Any]:
                return {
                    "output_ids": out[:k],
                    "meta_info": {
                        "id": body["rid"],
                        "finish_reason": {"type": "length", "length": n} if finished else None,
                        "prompt_tokens": len(body["input_ids"]),
                        "completion_tokens": k,
                        "cached_tokens": 0,
                        "weight_version": w.version,
                        "output_token_logprobs": [[-0.5, t, None] for t in out[:k]],
                    },
                }

            if body.get("stream"):
                # SGLang 0.5.16's streamed answer: the answer so far in each event (one per token
                # here), the last one the non-streamed answer, then [DONE].
                events = [answer(k, False) for k in range(1, n)] + [answer(n, True)]
                sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                return HttpResponse(200, sse.encode(), {"Content-Type": "text/event-stream; charset=utf-8"})
            return HttpResponse.from_json(answer(n, True))
        return HttpResponse.from_json({"success": True, "message": "ok"})

    def backend(self) -> HttpFleetBackend:
        wire = SGLangWire(entry_url=next(iter(self.workers)), has_begin_end=self.begin_end)
        workers = [Worker(id=f"w{i}", control_url=u, generate_url=u) for i, u in enumerate(self.workers)]
        return HttpFleetBackend(wire, workers, client=HttpClient(self.transport, retry=None))

    def paths(self, worker_url: str) -> list[str]:
        return [p for b, p, _ in self.calls if b == worker_url]

    @staticmethod
    def dumps(x: Any) -> str:
        return json.dumps(x)
