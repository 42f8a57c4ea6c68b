"""Tool calls and reasoning in the facade's chat answers, parsed by SGLang's own parser code.

Stock SGLang started with ``--tool-call-parser NAME`` / ``--reasoning-parser NAME`` splits the
generated text of a ``/v1/chat/completions`` answer into ``reasoning_content``, ``content`` and
``tool_calls`` (``sglang/srt/entrypoints/openai/serving_chat.py``, 0.5.16:
``OpenAIServingChat._build_chat_response`` and ``_process_tool_calls``). The facade does the same
with the same parser classes (``sglang.srt.function_call.function_call_parser.FunctionCallParser``,
``sglang.srt.parser.reasoning_parser.ReasoningParser``) and the same request model
(``sglang.srt.entrypoints.openai.protocol.ChatCompletionRequest``); what ``serving_chat`` itself does
around them is restated here, step for step, because ``serving_chat`` imports SGLang's engine
(``managers.io_struct`` -> ``srt.utils.common``: triton, torchvision) and so does not import on a
CPU. ``tests/data/miles_chat/`` holds answers made by ``serving_chat`` itself that this code must
reproduce (docs/miles.md, "Tool calls and reasoning").

The parser modules import without SGLang's package initialiser: ``sglang/__init__.py`` (0.5.16)
loads the frontend language and ``sglang.srt.utils.common``, which need triton and a torchvision
built for the installed torch, and the parsers use none of it. So unless ``sglang`` is already
imported, the package is entered without running its ``__init__`` (:func:`load_sglang_parsers`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rollout_backends import InvalidRequest

__all__ = [
    "ChatParseFailed",
    "ChatParsing",
    "PreparedChat",
    "SGLangParsers",
    "load_sglang_parsers",
    "plain_tool_rules",
    "tool_choice_of",
]

logger = logging.getLogger(__name__)

#: Chat keys that reach SGLang's ``ChatCompletionRequest`` here: what its parsers and
#: ``serving_chat``'s parsing steps read. The others are the facade codec's (sampling, ids).
_PARSE_KEYS = (
    "messages", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "reasoning",
    "chat_template_kwargs", "continue_final_message", "separate_reasoning", "skip_special_tokens",
)  # fmt: skip
#: ``serving_chat._patch_reasoning_skip_special_tokens``: parsers whose markers are special tokens.
_KEEPS_SPECIAL_TOKENS = frozenset({"apertus2509", "inkling"})


@attrs.frozen
class SGLangParsers:
    """The SGLang classes the chat route uses, and the installed SGLang's version."""

    function_call_parser: Any
    reasoning_parser: Any
    chat_request: Any
    detect_reasoning_pattern: Any
    version: str | None

    @property
    def tool_call_parsers(self) -> list[str]:
        return sorted(self.function_call_parser.ToolCallParserEnum)

    @property
    def reasoning_parsers(self) -> list[str]:
        return sorted(self.reasoning_parser.DetectorMap)


def _enter_sglang_without_init() -> None:
    """Register the ``sglang`` package without running its ``__init__`` (see the module doc)."""
    if "sglang" in sys.modules:
        return
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'sglang'", name="sglang")
    package = importlib.util.module_from_spec(spec)
    sys.modules["sglang"] = package


def load_sglang_parsers() -> SGLangParsers:
    """SGLang's parser classes; ``ImportError`` names what is missing."""
    _enter_sglang_without_init()
    fcp = importlib.import_module("sglang.srt.function_call.function_call_parser")
    rp = importlib.import_module("sglang.srt.parser.reasoning_parser")
    protocol = importlib.import_module("sglang.srt.entrypoints.openai.protocol")
    detection = importlib.import_module("sglang.srt.parser.template_detection")
    try:
        version: str | None = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return SGLangParsers(
        function_call_parser=fcp.FunctionCallParser,
        reasoning_parser=rp.ReasoningParser,
        chat_request=protocol.ChatCompletionRequest,
        detect_reasoning_pattern=detection.detect_reasoning_pattern,
        version=version,
    )


def tool_choice_of(body: Mapping[str, Any]) -> Any:
    """``ChatCompletionRequest.set_tool_choice_default``: absent or null is ``"none"`` without
    tools, ``"auto"`` with them."""
    choice = body.get("tool_choice")
    if choice is None:
        return "none" if body.get("tools") is None else "auto"
    return choice


def _is_forced(tool_choice: Any) -> bool:
    """``"required"`` or a named tool: SGLang constrains decoding to a tool call for these."""
    return tool_choice == "required" or not isinstance(tool_choice, str)


_CONSTRAINED = (
    "SGLang answers this with decoding constrained to a tool call ({kind}), which the protocol does not "
    "carry: send tool_choice 'auto' or 'none' (and no strict tools)"
)


def _check_tool_choice(choice: Any, tool_names: list[Any] | None) -> None:
    """``serving_chat._validate_request``'s tool-choice refusals (SGLang's words)."""
    if isinstance(choice, str):
        if choice == "required" and not tool_names:
            raise InvalidRequest("tool_choice", "Tools cannot be empty if tool choice is set to required.")
        return
    if not tool_names:
        raise InvalidRequest("tool_choice", "Tools cannot be empty if tool choice is set to a specific tool.")
    name = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else choice.function.name
    if name not in tool_names:
        raise InvalidRequest("tool_choice", f"Tool '{name}' not found in tools list.")


def _tool_names(tools: Any) -> list[Any]:
    out = []
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else tool.function
        out.append(function.get("name") if isinstance(function, Mapping) else getattr(function, "name", None))
    return out


def plain_tool_rules(body: Mapping[str, Any]) -> bool | None:
    """Without parsers (SGLang started without ``--tool-call-parser``): ``required`` or a named
    tool is answered by SGLang under a JSON-schema constraint (refused here, as in
    :meth:`ChatParsing.prepare`); tools keep special tokens in the text. Returns the
    ``skip_special_tokens`` override (``None``: the caller's)."""
    choice = tool_choice_of(body)
    if isinstance(choice, str) and choice not in ("auto", "required", "none"):
        raise InvalidRequest("tool_choice", f"must be 'auto', 'required', 'none' or a named tool, got {choice!r}")
    if not isinstance(choice, (str, Mapping)):
        raise InvalidRequest("tool_choice", f"must be a string or a named tool, got {type(choice).__name__}")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("tools", f"must be a list of tools, got {type(tools).__name__}")
    _check_tool_choice(choice, _tool_names(tools))
    if not tools or choice == "none":
        return None
    if _is_forced(choice):
        raise InvalidRequest("tool_choice", _CONSTRAINED.format(kind="json_schema"))
    return False


class ChatParseFailed(Exception):
    """SGLang answers 500 "Failed to parse reasoning content" where its reasoning parser raises."""


def _field_of(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


@attrs.frozen
class PreparedChat:
    """One chat request as ``serving_chat`` holds it when the answer is built."""

    request: Any  #: SGLang's ``ChatCompletionRequest`` (the parsing keys only)
    #: ``False`` where SGLang decodes with special tokens kept; ``None``: the caller's choice.
    skip_special_tokens: bool | None


@attrs.define
class ChatParsing:
    """The facade's ``--tool-call-parser`` / ``--reasoning-parser``, over SGLang's parsers."""

    sglang: SGLangParsers
    tool_call_parser: str | None
    reasoning_parser: str | None
    tokenizer: Any = None
    #: ``TemplateManager.force_reasoning`` / ``reasoning_config`` of the tokenizer's chat template.
    template_forces_reasoning: bool = False
    reasoning_config: Any = None
    #: ``OpenAIServingChat._reasoning_detector.reasoning_default``.
    reasoning_default: str | None = None
    #: The scheduler's ``think_end_id``: the first id of the detector's ``think_end_token``.
    think_end_id: int | None = None

    @classmethod
    def for_flags(
        cls, tool_call_parser: str | None, reasoning_parser: str | None, tokenizer: Any
    ) -> ChatParsing | None:
        """The parsing the flags ask for (``None``: neither flag); a refusal names the flag."""
        if tool_call_parser is None and reasoning_parser is None:
            return None
        if tokenizer is None:
            flag = "--tool-call-parser" if tool_call_parser else "--reasoning-parser"
            raise InvalidRequest(flag, "parses the generated text: needs a tokenizer (--tokenizer)")
        return cls.create(tool_call_parser, reasoning_parser, tokenizer)

    @classmethod
    def create(cls, tool_call_parser: str | None, reasoning_parser: str | None, tokenizer: Any) -> ChatParsing:
        """Checked names (a refusal names the flag); needs SGLang's parser modules importable."""
        try:
            sglang = load_sglang_parsers()
        except ImportError as exc:
            flag = "--tool-call-parser" if tool_call_parser else "--reasoning-parser"
            raise InvalidRequest(
                flag,
                f"needs SGLang's parsers, which do not import here ({exc}): pip install "
                "'rollout-backends[sglang-parsers]' and then, without their CUDA requirements, "
                "pip install --no-deps sglang==0.5.16 xgrammar==0.2.1",
            ) from None
        if tool_call_parser is not None and tool_call_parser not in sglang.tool_call_parsers:
            raise InvalidRequest(
                "--tool-call-parser",
                f"unknown parser {tool_call_parser!r} (SGLang {sglang.version} has {sglang.tool_call_parsers})",
            )
        if reasoning_parser is not None and reasoning_parser.lower() not in sglang.reasoning_parsers:
            raise InvalidRequest(
                "--reasoning-parser",
                f"unknown parser {reasoning_parser!r} (SGLang {sglang.version} has {sglang.reasoning_parsers})",
            )
        forced, config = sglang.detect_reasoning_pattern(getattr(tokenizer, "chat_template", None))
        default, think_end = None, None
        if reasoning_parser is not None:
            # serving_chat.__init__: a streaming detector, only for its ``reasoning_default``;
            # Scheduler.__init__: think_end_id, for the usage's reasoning_tokens.
            detector = sglang.reasoning_parser(reasoning_parser, stream_reasoning=True, tokenizer=tokenizer).detector
            default = getattr(detector, "reasoning_default", None)
            end_ids = tokenizer.encode(detector.think_end_token, add_special_tokens=False)
            think_end = int(end_ids[0]) if end_ids else None
        return cls(sglang, tool_call_parser, reasoning_parser, tokenizer, bool(forced), config, default, think_end)

    def reasoning_tokens(self, prepared: PreparedChat, output_ids: Sequence[int]) -> int:
        """``usage.reasoning_tokens``: SGLang's scheduler counts, where the request asks for
        reasoning (``require_reasoning``), the output tokens up to and including ``think_end_id``
        (all of them while it has not come; ``Req.update_reasoning_tokens``)."""
        if self.think_end_id is None or not self.reasoning_requested(prepared.request):
            return 0
        ids = list(output_ids)
        return ids.index(self.think_end_id) + 1 if self.think_end_id in ids else len(ids)

    def prepare(self, body: Mapping[str, Any]) -> PreparedChat:
        """The request's parsing keys through SGLang's ``ChatCompletionRequest`` (its defaults and
        its refusals, naming the field), and ``serving_chat``'s steps before generation."""
        from pydantic import ValidationError

        subset = {k: body[k] for k in _PARSE_KEYS if k in body and body[k] is not None}
        try:
            request = self.sglang.chat_request.model_validate(subset)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise InvalidRequest(_field_of(tuple(err.get("loc", ()))), str(err.get("msg"))) from None
        # _convert_to_internal_request: reasoning_effort in chat_template_kwargs moves to the request.
        effort = request.chat_template_kwargs.pop("reasoning_effort", None) if request.chat_template_kwargs else None
        if effort is not None:
            request.reasoning_effort = effort
        _check_tool_choice(request.tool_choice, _tool_names(request.tools))
        self._refuse_constraints(request)
        return PreparedChat(request=request, skip_special_tokens=self._skip_special_tokens(request))

    def _refuse_constraints(self, request: Any) -> None:
        """SGLang constrains decoding to its tool-call grammar where ``FunctionCallParser.
        get_structure_constraint`` (or, without a parser, ``required`` / a named tool) gives one; the
        protocol carries no such constraint, so these requests are refused, not answered unconstrained."""
        if not request.tools or request.tool_choice == "none":
            return
        constraint = None
        if self.tool_call_parser is not None:
            parser = self.sglang.function_call_parser(request.tools, self.tool_call_parser, tokenizer=self.tokenizer)
            # thinking_mode: serving_chat passes reasoning-on only without a reasoning parser,
            # where _get_reasoning_from_request is False: always False.
            constraint = parser.get_structure_constraint(
                request.tool_choice, parallel_tool_calls=request.parallel_tool_calls, thinking_mode=False
            )
        if constraint is None and _is_forced(request.tool_choice):
            constraint = ("json_schema", None)
        if constraint is not None:
            field = "tool_choice" if _is_forced(request.tool_choice) else "tools"
            raise InvalidRequest(field, _CONSTRAINED.format(kind=constraint[0]))

    def _skip_special_tokens(self, request: Any) -> bool | None:
        """``serving_chat._process_messages``: tools keep special tokens in the text (tool markup
        is often made of them), as do parsers whose reasoning markers are."""
        if request.tools and request.tool_choice != "none":
            return False
        name = (self.reasoning_parser or "").lower()
        if name in _KEEPS_SPECIAL_TOKENS:
            return False
        if name == "mistral" and request.reasoning_effort not in (None, "none"):
            return False
        return None

    def answer(self, prepared: PreparedChat, text: str, finish: dict[str, Any] | None) -> dict[str, Any]:
        """The assistant message of ``_build_chat_response``; ``finish`` (the answer's
        ``meta_info.finish_reason``) becomes ``tool_calls`` in place where SGLang's does."""
        request = prepared.request
        reasoning: str | None = None
        if self.reasoning_parser is not None and request.separate_reasoning:
            force = self.template_forces_reasoning or self.reasoning_requested(request)
            try:
                parser = self.sglang.reasoning_parser(
                    self.reasoning_parser,
                    stream_reasoning=False,
                    force_reasoning=force,
                    request=request,
                    tokenizer=self.tokenizer,
                )
                reasoning, text = parser.parse_non_stream(text)
            except Exception as exc:
                logger.error("Reasoning parsing error: %s", exc)
                raise ChatParseFailed("Failed to parse reasoning content") from exc
        tool_calls = None
        if request.tool_choice != "none" and request.tools and self.tool_call_parser is not None:
            tool_calls, text = self._tool_calls(request, text, finish)
        return {
            "role": "assistant",
            # serving_chat: "content should not be None but empty string" (retokenization).
            "content": text if text else "",
            "reasoning_content": reasoning if reasoning else None,
            "tool_calls": tool_calls,
        }

    def _tool_calls(
        self, request: Any, text: str, finish: dict[str, Any] | None
    ) -> tuple[list[dict[str, Any]] | None, str]:
        """``_process_tool_calls`` for ``tool_choice`` auto (forced choices are refused earlier)."""
        parser = self.sglang.function_call_parser(request.tools, self.tool_call_parser, tokenizer=self.tokenizer)
        if not parser.has_tool_call(text):
            return None, text
        try:
            text, calls = parser.parse_non_stream(text)
        except Exception as exc:  # SGLang logs the parser's failure and answers the text as is
            logger.error("Tool call parsing error: %s", exc)
            return None, text
        if not calls:
            return None, text
        history = _history_tool_calls(request) if self.tool_call_parser == "kimi_k2" else 0
        out = [
            {
                "id": self._tool_call_id(call, history),
                "index": getattr(call, "tool_index", None),
                "type": "function",
                "function": {"name": call.name, "arguments": call.parameters},
            }
            for call in calls
        ]
        if finish is not None and finish.get("type") == "stop":
            finish["type"] = "tool_calls"
            finish["matched"] = None
        return out, text

    def _tool_call_id(self, call: Any, history: int) -> str:
        """``_process_tool_call_id``: a random id, Kimi-K2's ``functions.{name}:{n}`` counted over
        the conversation's earlier tool calls."""
        if self.tool_call_parser != "kimi_k2":
            return f"call_{uuid.uuid4().hex[:24]}"
        return f"functions.{call.name}:{history + call.tool_index}"

    def reasoning_requested(self, request: Any) -> bool:
        """``OpenAIServingChat._get_reasoning_from_request``: whether the template opened the
        reasoning block itself, so the output starts inside it."""
        name = (self.reasoning_parser or "").lower()
        kwargs = request.chat_template_kwargs
        if not name:
            return False
        if name == "minimax-m3":
            return bool((kwargs or {}).get("thinking_mode") == "enabled")
        if name == "hunyuan":
            return request.reasoning_effort not in (None, "none", "no_think")
        config = self.reasoning_config
        if config is None:
            return _default_mode_requests(self.reasoning_default, request)
        if config.special_case == "always":
            return True
        if config.special_case == "mistral":
            return request.reasoning_effort is not None and request.reasoning_effort != "none"
        if config.toggle_param is None or config.default_enabled is None:
            return False
        if config.default_enabled:
            return not kwargs or kwargs.get(config.toggle_param) is not False
        return kwargs is not None and kwargs.get(config.toggle_param) is True


def _default_mode_requests(mode: str | None, request: Any) -> bool:
    """The parser-level default of ``_get_reasoning_from_request`` (no template toggle found)."""
    kwargs = request.chat_template_kwargs
    if mode is None:
        return False
    if mode == "always":
        return True
    if mode == "mistral":
        return request.reasoning_effort is not None and request.reasoning_effort != "none"
    if mode in ("thinking", "enable_thinking"):
        return not kwargs or kwargs.get(mode) is not False
    if mode in ("explicit_thinking", "explicit_enable_thinking"):
        return kwargs is not None and kwargs.get(mode.removeprefix("explicit_")) is True
    logger.warning("Unknown reasoning_default mode '%s', defaulting to reasoning disabled", mode)
    return False


def _history_tool_calls(request: Any) -> int:
    """``_get_history_tool_calls_cnt``: tool calls of the conversation's assistant messages."""
    count = 0
    for msg in request.messages:
        if msg.role == "assistant":
            calls = getattr(msg, "tool_calls", None)
            count += len(list(calls)) if calls is not None else 0
    return count
