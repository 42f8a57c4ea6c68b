"""The facade's chat answers with ``--tool-call-parser`` / ``--reasoning-parser`` equal stock SGLang's.

``tests/data/miles_chat/sglang_chat_answers.json`` holds, per case, a chat request, a generated
text and SGLang 0.5.16's own answer for it (``OpenAIServingChat._build_chat_response``, see
``make_fixtures.py`` there). Here the same text is the token ids of a scripted generation behind
the facade started with the same parser flags; the answers must be equal but for what SGLang draws
at random or per request (tool-call ids ``call_<24 hex>``, the response ``id``, ``created``), the
version stamps of the external-rollout contract (``weight_version_start``/``_end``) and
``usage.reasoning_tokens``, which SGLang's scheduler counts outside that method (the GPU comparison
covers it).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import rollout_backends as rb
from rollout_backends.integrations.miles import MilesFacade, start_facade
from rollout_backends.integrations.miles._chat_parsers import ChatParsing, load_sglang_parsers
from tests.miles.scripted import ScriptedBackend

try:
    load_sglang_parsers()
    HAVE_PARSERS = True
except ImportError:  # pragma: no cover - CI installs the extra (Makefile)
    HAVE_PARSERS = False

pytestmark = pytest.mark.skipif(not HAVE_PARSERS, reason="SGLang's parsers are not installed (extra sglang-parsers)")

FIXTURES = json.loads(
    (Path(__file__).parents[1] / "data" / "miles_chat" / "sglang_chat_answers.json").read_text(encoding="utf-8")
)
CASES = {case["name"]: case for case in FIXTURES["cases"]}
THINKING_TEMPLATE_SUFFIX = (
    "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}"
)
_RANDOM_ID = re.compile(r"^call_[0-9a-f]{24}$")
_FINISH = {"stop": rb.FinishReason.STOP, "length": rb.FinishReason.LENGTH, "abort": rb.FinishReason.ABORT}


def _tokenizer(tokenizer: Any, template: str) -> Any:
    tok = copy.deepcopy(tokenizer)
    if template == "thinking":
        tok.chat_template = tok.chat_template + THINKING_TEMPLATE_SUFFIX
    return tok


def _generation(case: dict[str, Any], tok: Any) -> rb.Generation:
    """The generation whose text SGLang's detokenizer would give as ``case["text"]``: its tokens,
    and the stop token where the stop matched one (trimmed from the text, no_stop_trim false)."""
    ids = list(tok.encode(case["text"], add_special_tokens=False))
    assert tok.decode(ids, skip_special_tokens=False) == case["text"]  # the tokenizer round-trips it
    finish = case["finish_reason"]
    if finish.get("matched") == 0:
        ids.append(0)
    return rb.Generation(
        request_id="fixture",
        output_ids=tuple(ids),
        logprobs=tuple(-0.5 for _ in ids),
        finish_reason=_FINISH[finish["type"]],
        weight_version="1",
        prompt_tokens=7,
        cached_tokens=3,
        matched_stop=finish.get("matched"),
    )


def _normalized(answer: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(answer)
    out.pop("id", None)
    out.pop("created", None)
    # The external-rollout contract's stamps (Stitch's, not SGLang's; docs/miles.md).
    out.pop("weight_version_start", None)
    out.pop("weight_version_end", None)
    out["usage"].pop("reasoning_tokens", None)
    for choice in out["choices"]:
        choice.pop("meta_info", None)
        for call in choice["message"].get("tool_calls") or ():
            if _RANDOM_ID.match(call["id"]):
                call["id"] = "call_<random>"
    return out


def differences(case: dict[str, Any], answer: dict[str, Any]) -> list[str]:
    """Where the facade's answer differs from SGLang's (empty: equal)."""
    want, got = _normalized(case["answer"]), _normalized(answer)
    diffs = [f"{key}: SGLang {want.get(key)!r}, facade {got.get(key)!r}" for key in want if want[key] != got.get(key)]
    diffs += [f"{key}: only the facade has it" for key in got if key not in want]
    meta_finish = answer["choices"][0]["meta_info"]["finish_reason"]
    if meta_finish != case["meta_info_after"]["finish_reason"]:  # SGLang changes it in place
        diffs.append(
            f"meta_info.finish_reason: SGLang {case['meta_info_after']['finish_reason']}, facade {meta_finish}"
        )
    return diffs


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as c:
        yield c


async def _facade_answer(case: dict[str, Any], tokenizer: Any, client: httpx.AsyncClient) -> dict[str, Any]:
    tok = _tokenizer(tokenizer, case["template"])
    backend = ScriptedBackend(("w0",))
    backend.script.append(_generation(case, tok))
    facade = MilesFacade(
        backend,
        tokenizer=tok,
        model_path="tiny",
        tool_call_parser=case["tool_call_parser"],
        reasoning_parser=case["reasoning_parser"],
    )
    running = await start_facade(facade, port=0)
    body = {**case["request"], "input_ids": [1, 2, 3, 4, 5, 6, 7], "return_meta_info": True}
    try:
        resp = await client.post(f"{running.url}/v1/chat/completions", json=body)
    finally:
        await running.stop()
    assert resp.status_code == 200, resp.text
    (req,) = backend.requests
    assert list(req.input_ids) == body["input_ids"]
    return dict(resp.json())


@pytest.mark.parametrize("name", sorted(CASES))
async def test_the_facade_answers_what_sglang_answers(name: str, tokenizer: Any, client: httpx.AsyncClient) -> None:
    case = CASES[name]
    answer = await _facade_answer(case, tokenizer, client)
    assert differences(case, answer) == []
    message = answer["choices"][0]["message"]
    assert message["content"] is not None  # Miles' extract_completion refuses null content


def _break_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tool calls parsed, but the finish reason left as the engine's (``stop``)."""
    real = ChatParsing.answer

    def answer(self: ChatParsing, prepared: Any, text: str, finish: Any) -> dict[str, Any]:
        return real(self, prepared, text, dict(finish) if finish is not None else None)

    monkeypatch.setattr(ChatParsing, "answer", answer)


def _break_content(monkeypatch: pytest.MonkeyPatch) -> None:
    """``content`` null where nothing but markup was generated."""
    real = ChatParsing.answer

    def answer(self: ChatParsing, prepared: Any, text: str, finish: Any) -> dict[str, Any]:
        out = real(self, prepared, text, finish)
        return {**out, "content": out["content"] or None}

    monkeypatch.setattr(ChatParsing, "answer", answer)


def _break_reasoning_force(monkeypatch: pytest.MonkeyPatch) -> None:
    """The template's / request's reasoning mode ignored (the output's start taken as content)."""
    monkeypatch.setattr(ChatParsing, "reasoning_requested", lambda self, request: False)


@pytest.mark.parametrize(
    ("bug", "case"),
    [
        (_break_finish, "qwen25 one call"),
        (_break_content, "mistral"),
        (_break_reasoning_force, "qwen3 thinking template"),
    ],
)
async def test_a_planted_difference_is_found(
    bug: Callable[[pytest.MonkeyPatch], None],
    case: str,
    tokenizer: Any,
    client: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bug(monkeypatch)
    assert differences(CASES[case], await _facade_answer(CASES[case], tokenizer, client)) != []
