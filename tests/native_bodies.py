"""Bad ``/generate`` bodies shared by the codec's tests and each server boundary's property test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web
from hypothesis import strategies as st

from tests.aiohttp_app import serving


def _nested_list(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = [v]
    return v


def _nested_dict(keys: str) -> Any:
    v: Any = {}
    for k in reversed(keys):
        v = {k: v}
    return v


#: (where in the body, a wrong value, the field the refusal must name)
BAD_VALUES: list[tuple[tuple[str, ...], Any, str]] = [
    (("return_logprob",), "false", "return_logprob"),
    (("return_logprob",), 1, "return_logprob"),
    (("rid",), 7, "rid"),
    (("rid",), "", "rid"),
    (("stream",), "no", "stream"),
    (("input_ids",), [1, True], "input_ids[1]"),
    (("input_ids",), [1, 2**70], "input_ids[1]"),
    (("input_ids",), [1, -1], "input_ids[1]"),
    (("input_ids",), [1, 2.0], "input_ids[1]"),
    (("input_ids",), [[1], [2]], "input_ids"),
    (("input_ids",), [], "input_ids"),
    (("input_ids",), "1 2", "input_ids"),
    (("sampling_params",), [{}], "sampling_params"),
    (("sampling_params",), "greedy", "sampling_params"),
    (("sampling_params", "max_new_tokens"), 2**64, "sampling_params.max_new_tokens"),
    (("sampling_params", "max_new_tokens"), 16.0, "sampling_params.max_new_tokens"),
    (("sampling_params", "max_new_tokens"), True, "sampling_params.max_new_tokens"),
    (("sampling_params", "max_new_tokens"), -1, "sampling_params.max_new_tokens"),
    (("sampling_params", "max_new_tokens"), 0, "sampling_params.max_new_tokens"),
    (("sampling_params", "temperature"), "0.5", "sampling_params.temperature"),
    (("sampling_params", "temperature"), -1.0, "sampling_params.temperature"),
    (("sampling_params", "top_p"), 0.0, "sampling_params.top_p"),
    (("sampling_params", "top_k"), 0, "sampling_params.top_k"),
    (("sampling_params", "top_k"), 2**64, "sampling_params.top_k"),
    (("sampling_params", "ignore_eos"), "false", "sampling_params.ignore_eos"),
    (("sampling_params", "ignore_eos"), 0, "sampling_params.ignore_eos"),
    (("sampling_params", "sampling_seed"), "7", "sampling_params.sampling_seed"),
    (("sampling_params", "sampling_seed"), 2**63, "sampling_params.sampling_seed"),
    (("sampling_params", "stop_token_ids"), [2**70], "sampling_params.stop_token_ids[0]"),
    (("sampling_params", "stop_token_ids"), [1, "2"], "sampling_params.stop_token_ids[1]"),
    (("sampling_params", "stop_token_ids"), 2, "sampling_params.stop_token_ids"),
    (("sampling_params", "min_new_tokens"), 10**6, "sampling_params.min_new_tokens"),
    (("sampling_params", "n"), 2, "sampling_params.n"),
    (("sampling_params", "stop"), ["</s>"], "sampling_params.stop"),
    (("sampling_params", "logit_bias"), {"5": 1.0}, "sampling_params.logit_bias"),
    (("sampling_params", "seed"), 1, "sampling_params.seed"),
    (("sampling_params", "skip_special_tokens"), "yes", "sampling_params.skip_special_tokens"),
    (("return_logprobs",), True, "return_logprobs"),
    (("return_routed_experts",), True, "return_routed_experts"),
    (("return_hidden_states",), True, "return_hidden_states"),
    (("image_data",), "http://x/cat.png", "image_data"),
    (("custom_logit_processor",), "{}", "custom_logit_processor"),
    (("lora_path",), "adapter", "lora_path"),
    (("logprob_start_len",), -2, "logprob_start_len"),
    (("logprob_start_len",), "0", "logprob_start_len"),
    (("logprob_start_len",), 2**20, "logprob_start_len"),
    (("logprob_start_len",), True, "logprob_start_len"),
    (("top_logprobs_num",), -1, "top_logprobs_num"),
    (("top_logprobs_num",), 21, "top_logprobs_num"),
    (("top_logprobs_num",), "5", "top_logprobs_num"),
    (("top_logprobs_num",), True, "top_logprobs_num"),
    (("log_metrics",), "true", "log_metrics"),
    (("priority",), 2**64, "priority"),
    (("text",), "hello", "text"),
    (("deep",), _nested_list(20), "deep" + "[0]" * 15),
    (
        ("sampling_params", "custom_params"),
        _nested_dict("abcdefghijklmnop"),
        "sampling_params.custom_params.a.b.c.d.e.f.g.h.i.j.k.l.m.n",
    ),
]


def with_value(body: dict[str, Any], where: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(body))
    node = out
    for key in where[:-1]:
        node = node.setdefault(key, {})
    node[where[-1]] = value
    return out


@st.composite
def valid_bodies(draw: st.DrawFn, *, vocab: int, context: int) -> dict[str, Any]:
    """A valid body for a server with this vocabulary and context (SGLang's keys, JSON values)."""
    ids = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=min(8, context // 4)))
    sp: dict[str, Any] = {"max_new_tokens": draw(st.integers(1, min(8, context - len(ids) - 1)))}
    if draw(st.booleans()):
        sp["temperature"] = draw(st.one_of(st.just(0.0), st.floats(0.1, 2.0)))
    if draw(st.booleans()):
        sp["top_k"] = draw(st.one_of(st.just(-1), st.integers(1, vocab)))
    if draw(st.booleans()):
        sp["stop_token_ids"] = draw(st.lists(st.integers(0, vocab - 1), max_size=3))
    if draw(st.booleans()):
        sp["sampling_seed"] = draw(st.integers(0, 2**63 - 1))
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": sp, "return_logprob": draw(st.booleans())}
    return body


@contextlib.contextmanager
def serve_in_thread(make_app: Callable[[], Awaitable[web.Application]]) -> Iterator[str]:
    """Serve the app ``make_app`` builds on its own event loop in a thread (so a synchronous
    hypothesis test can post to it); yield its base URL."""
    loop = asyncio.new_event_loop()
    ready: queue.Queue[str | BaseException] = queue.Queue()
    stop = asyncio.Event()

    async def main() -> None:
        try:
            app = await make_app()
            async with serving(app) as url:
                ready.put(url)
                await stop.wait()
        except BaseException as exc:  # reported to the test thread
            ready.put(exc)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    got = ready.get(timeout=30)
    if isinstance(got, BaseException):
        raise got
    try:
        yield got
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)
        loop.close()
