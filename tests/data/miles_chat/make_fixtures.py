"""Write ``sglang_chat_answers.json``: stock SGLang's chat answers for given generated texts.

    .venv/bin/python tests/data/miles_chat/make_fixtures.py   # needs the extra sglang-parsers

Each case is a chat request, the text SGLang's detokenizer would hand ``serving_chat`` and the
finish reason; the answer is what SGLang 0.5.16's own ``OpenAIServingChat._build_chat_response``
(``sglang/srt/entrypoints/openai/serving_chat.py``) returns for it, with its parser classes, its
``ChatCompletionRequest`` and its ``UsageProcessor``: nothing of it is restated here.

``serving_chat`` does not import on a CPU as shipped (``managers.io_struct`` and two template
modules import ``srt.utils.common``: triton, a torchvision built for the torch), so four modules it
names but ``_build_chat_response`` never calls are stood in for below, in this script only:
``serving_base.OpenAIServingBase`` (a base class keeping ``tokenizer_manager``),
``io_struct.GenerateReqInput``, ``conversation.generate_chat_conv`` and
``jinja_template_utils.process_content_for_template_format``. The server state the method reads is
set as ``OpenAIServingChat.__init__`` sets it (parser names, the reasoning detector, the template's
reasoning pattern from SGLang's ``detect_reasoning_pattern``) and ``--enable-cache-report`` on (the
facade reports cached tokens in ``usage`` as SGLang does with it). ``meta_info`` carries no
``reasoning_tokens``: SGLang's scheduler counts them from token ids, outside this method (the GPU
comparison, bench/rb_bench/miles_chat.py, covers them).

The tokenizer is the one ``rollout-backends make-model`` writes (the tiny model's), with its chat
template or the ``thinking`` variant below; tests/miles/test_chat_parsers.py feeds each text through
the facade (as the tokens of a scripted generation) and compares.
"""

from __future__ import annotations

import copy
import json
import sys
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "sglang_chat_answers.json"

#: A Qwen3-style toggle (``enable_thinking`` defaults on): SGLang treats the output as reasoning
#: from its first token unless the request turns thinking off.
THINKING_TEMPLATE_SUFFIX = (
    "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _deepseek(marker: str) -> str:
    """DeepSeek's markers (U+FF5C fullwidth bars around words joined by U+2581) from plain words."""
    return "<\uff5c" + marker.replace(" ", "\u2581") + "\uff5c>"


DEEPSEEK_CALL = (
    f"{_deepseek('tool calls begin')}{_deepseek('tool call begin')}function{_deepseek('tool sep')}get_weather\n"
    f'```json\n{{"city": "Paris"}}\n```{_deepseek("tool call end")}{_deepseek("tool calls end")}'
)
STOP = {"type": "stop", "matched": 0}
#: The length finish's count is set to the generation's token count below.
LENGTH = {"type": "length"}
#: What SGLang's scheduler reports for an aborted request (``FINISH_ABORT``'s ``to_json``).
ABORT = {"type": "abort", "message": "Abort request.", "status_code": None, "err_type": None}

# (name, tool parser, reasoning parser, template, request keys, generated text, finish reason)
CASES: list[tuple[str, str | None, str | None, str, dict[str, Any], str, dict[str, Any]]] = [
    ("qwen25 one call", "qwen25", None, "tiny", {"tools": [WEATHER]},
     'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', STOP),
    ("qwen25 two calls", "qwen25", None, "tiny", {"tools": [WEATHER, TIME]},
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>', STOP),
    ("qwen25 no call", "qwen25", None, "tiny", {"tools": [WEATHER]}, "It is sunny in Paris.", STOP),
    ("qwen25 tool_choice none", "qwen25", None, "tiny", {"tools": [WEATHER], "tool_choice": "none"},
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', STOP),
    ("qwen25 cut by length", "qwen25", None, "tiny", {"tools": [WEATHER]},
     '<tool_call>\n{"name": "get_weather", "arguments": {"ci', LENGTH),
    ("qwen25 bad json", "qwen25", None, "tiny", {"tools": [WEATHER]},
     '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>', STOP),
    ("qwen25 unknown tool", "qwen25", None, "tiny", {"tools": [WEATHER]},
     '<tool_call>\n{"name": "get_stock", "arguments": {"sym": "X"}}\n</tool_call>', STOP),
    ("no parser, tools", None, None, "tiny", {"tools": [WEATHER]},
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', STOP),
    ("llama3 python_tag", "llama3", None, "tiny", {"tools": [WEATHER]},
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', STOP),
    ("llama3 plain json", "llama3", None, "tiny", {"tools": [WEATHER]},
     '{"name": "get_weather", "parameters": {"city": "Paris"}}', STOP),
    ("mistral", "mistral", None, "tiny", {"tools": [WEATHER]},
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', STOP),
    ("deepseekv3", "deepseekv3", None, "tiny", {"tools": [WEATHER]},
     DEEPSEEK_CALL, STOP),
    ("glm45", "glm45", None, "tiny", {"tools": [WEATHER]},
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", STOP),
    ("kimi_k2 first call", "kimi_k2", None, "tiny", {"tools": [WEATHER]},
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
     '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>', STOP),
    ("kimi_k2 after two calls", "kimi_k2", None, "tiny",
     {"tools": [WEATHER], "messages": [*USER,
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
             {"id": "functions.get_weather:1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
         {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "rain"},
         {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "snow"}]},
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:2<|tool_call_argument_begin|>"
     '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>', STOP),
    ("pythonic", "pythonic", None, "tiny", {"tools": [WEATHER]}, '[get_weather(city="Paris")]', STOP),
    ("qwen3_coder", "qwen3_coder", None, "tiny", {"tools": [WEATHER]},
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", STOP),
    ("deepseek-r1 reasoning", None, "deepseek-r1", "tiny", {}, "Paris is in France.</think>It is sunny.", STOP),
    ("qwen3 reasoning", None, "qwen3", "tiny", {}, "<think>Paris is in France.</think>\n\nIt is sunny.", STOP),
    ("qwen3 no reasoning block", None, "qwen3", "tiny", {}, "It is sunny.", STOP),
    ("qwen3 separate_reasoning false", None, "qwen3", "tiny", {"separate_reasoning": False},
     "<think>Paris is in France.</think>\n\nIt is sunny.", STOP),
    ("qwen3 thinking template", None, "qwen3", "thinking", {}, "Paris is in France.</think>\n\nIt is sunny.", STOP),
    ("qwen3 thinking template, thinking off", None, "qwen3", "thinking",
     {"chat_template_kwargs": {"enable_thinking": False}}, "It is sunny.", STOP),
    ("qwen3-thinking cut in reasoning", None, "qwen3-thinking", "tiny", {}, "Paris is in",
     LENGTH),
    ("qwen3 + qwen25", "qwen25", "qwen3", "tiny", {"tools": [WEATHER]},
     '<think>I need the weather.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
     "\n</tool_call>", STOP),
    ("glm45 + glm45", "glm45", "glm45", "tiny", {"tools": [WEATHER]},
     "<think>Weather first.</think><tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
     "</arg_value>\n</tool_call>", STOP),
    ("kimi reasoning", None, "kimi", "tiny", {}, "◁think▷Paris is in France.◁/think▷It is sunny.", STOP),
    ("deepseek-r1 + deepseekv3 abort", "deepseekv3", "deepseek-r1", "tiny", {"tools": [WEATHER]},
     "I will call the tool.</think>" + DEEPSEEK_CALL, ABORT),
]  # fmt: skip


def _stand_in(name: str, **attrs: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def import_serving_chat() -> Any:
    from rollout_backends.integrations.miles._chat_parsers import load_sglang_parsers

    load_sglang_parsers()  # enters the sglang package without its __init__, as the facade does

    class OpenAIServingBase:
        def __init__(self, tokenizer_manager: Any) -> None:
            self.tokenizer_manager = tokenizer_manager

    _stand_in("sglang.srt.entrypoints.openai.serving_base", OpenAIServingBase=OpenAIServingBase)
    _stand_in("sglang.srt.managers.io_struct", GenerateReqInput=object)
    _stand_in("sglang.srt.parser.conversation", generate_chat_conv=None)
    _stand_in("sglang.srt.parser.jinja_template_utils", process_content_for_template_format=None)
    import sglang.srt.entrypoints.openai.serving_chat as serving_chat  # type: ignore[import-not-found,import-untyped,unused-ignore]

    return serving_chat


def tokenizer_for(template: str) -> Any:
    from transformers import AutoTokenizer

    from rollout_backends.adapters.reference._backend import cached_tiny_model

    tok = AutoTokenizer.from_pretrained(str(cached_tiny_model()))
    if template == "thinking":
        tok.chat_template = tok.chat_template + THINKING_TEMPLATE_SUFFIX
    return tok


def server(serving_chat: Any, tool_parser: str | None, reasoning_parser: str | None, tok: Any) -> Any:
    """An ``OpenAIServingChat`` holding what ``__init__`` sets that ``_build_chat_response`` reads."""
    from sglang.srt.parser.reasoning_parser import ReasoningParser  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from sglang.srt.parser.template_detection import detect_reasoning_pattern  # type: ignore[import-not-found,import-untyped,unused-ignore]

    chat = serving_chat.OpenAIServingChat.__new__(serving_chat.OpenAIServingChat)
    chat.tokenizer_manager = types.SimpleNamespace(
        tokenizer=tok, server_args=types.SimpleNamespace(enable_cache_report=True)
    )
    force, config = detect_reasoning_pattern(tok.chat_template)
    chat.template_manager = types.SimpleNamespace(force_reasoning=force, reasoning_config=config)
    chat.tool_call_parser = tool_parser
    chat.reasoning_parser = reasoning_parser
    chat._reasoning_detector = (
        ReasoningParser(reasoning_parser, stream_reasoning=True, tokenizer=tok).detector if reasoning_parser else None
    )
    return chat


def main() -> int:
    serving_chat = import_serving_chat()
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest as Request  # type: ignore[import-not-found,import-untyped,unused-ignore]

    out = []
    for name, tool_parser, reasoning_parser, template, keys, text, finish in CASES:
        tok = tokenizer_for(template)
        body = {"model": "tiny", "messages": USER, **copy.deepcopy(keys)}
        request = Request.model_validate(copy.deepcopy(body))
        # The generation's tokens: the text's, and the stop token where the stop matched one.
        n_tokens = len(tok.encode(text, add_special_tokens=False)) + (finish.get("matched") == 0)
        if finish["type"] == "length":
            finish = {**finish, "length": n_tokens}
        meta = {"id": "fixture", "finish_reason": copy.deepcopy(finish), "prompt_tokens": 7,
                "completion_tokens": n_tokens, "cached_tokens": 3, "weight_version": "1"}  # fmt: skip
        chat = server(serving_chat, tool_parser, reasoning_parser, tok)
        answer = chat._build_chat_response(request, [{"text": text, "meta_info": meta}], 0)
        out.append(
            {
                "name": name,
                "tool_call_parser": tool_parser,
                "reasoning_parser": reasoning_parser,
                "template": template,
                "request": body,
                "text": text,
                "finish_reason": finish,
                "answer": answer.model_dump(mode="json"),
                "meta_info_after": meta,
            }
        )
    import importlib.metadata

    doc = {
        "made_by": "tests/data/miles_chat/make_fixtures.py",
        "sglang": importlib.metadata.version("sglang"),
        "cases": out,
    }
    OUT.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(out)} cases to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
