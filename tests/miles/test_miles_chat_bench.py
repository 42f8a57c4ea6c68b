"""``rb_bench.miles_chat``'s comparison (the GPU stage of issue 27): equal answers compare equal
whatever tool-call ids SGLang drew; a planted difference in any compared part is found."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from rb_bench.miles_chat import compare, compare_turn


def _answer(call_id: str = "call_0123456789abcdef01234567") -> dict[str, Any]:
    return {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "The tool knows.",
                    "tool_calls": [
                        {"id": call_id, "index": 0, "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    ],
                },
                "finish_reason": "tool_calls",
                "matched_stop": None,
                "meta_info": {
                    "finish_reason": {"type": "tool_calls", "matched": None},
                    "output_token_logprobs": [[-0.0001, 512, None], [-0.0002, 0, None]],
                },
            }
        ],
        "usage": {"prompt_tokens": 57, "completion_tokens": 2, "total_tokens": 59, "reasoning_tokens": 1,
                  "prompt_tokens_details": {"cached_tokens": 16}},
    }  # fmt: skip


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def plant(answer: dict[str, Any]) -> None:
        node = answer
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return plant


def test_answers_equal_but_for_random_ids_and_cache_details_compare_equal() -> None:
    other = _answer("call_fedcba9876543210fedcba98")
    other["usage"]["prompt_tokens_details"] = None
    assert compare_turn("turn1", _answer(), other) == {"equal": True, "differences": [], "max_abs_dlogprob": 0.0}


@pytest.mark.parametrize(
    "plant",
    [
        _set(("choices", 0, "message", "content"), None),
        _set(("choices", 0, "message", "tool_calls", 0, "id"), "functions.get_weather:0"),
        _set(("choices", 0, "message", "tool_calls", 0, "function", "arguments"), '{"city": "Rome"}'),
        _set(("choices", 0, "finish_reason"), "stop"),
        _set(("choices", 0, "matched_stop"), 0),
        _set(("choices", 0, "meta_info", "finish_reason"), {"type": "stop", "matched": 0}),
        _set(("choices", 0, "meta_info", "output_token_logprobs", 1), [-0.0002, 7, None]),
        _set(("choices", 0, "meta_info", "output_token_logprobs", 0), [-0.5, 512, None]),
        _set(("usage", "reasoning_tokens"), 2),
    ],
)
def test_a_planted_difference_is_found(plant: Callable[[dict[str, Any]], None]) -> None:
    other = copy.deepcopy(_answer())
    plant(other)
    result = compare_turn("turn1", _answer(), other)
    assert not result["equal"] and result["differences"]


def test_the_aborted_turn_needs_abort_and_content_on_both_sides() -> None:
    aborted = _answer()
    aborted["choices"][0]["finish_reason"] = "abort"
    assert compare_turn("turn4_abort", aborted, copy.deepcopy(aborted))["equal"]
    finished = copy.deepcopy(aborted)
    finished["choices"][0]["finish_reason"] = "length"
    assert not compare_turn("turn4_abort", aborted, finished)["equal"]


def test_stock_is_the_baseline_where_it_ran() -> None:
    turns = {"turn1": _answer()}
    ran = {"ok": True, "turns": turns}
    base, comparisons = compare({"stock": ran, "facade-sglang": ran, "facade-dynamo": {"ok": False}})
    assert base == "stock" and list(comparisons) == ["facade-sglang"]
    base, comparisons = compare({"stock": {"ok": False}, "facade-sglang": ran, "facade-dynamo": ran})
    assert base == "facade-sglang" and list(comparisons) == ["facade-dynamo"]
