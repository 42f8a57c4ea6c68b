"""A stand-in for Miles' session server (v1, linear trajectory), driving a router over HTTP.

Restated, not copied, from radixark/miles ``31f1ca961a94`` (docs/miles.md, "The session contract"):

* ``miles/rollout/session/core.py``: ``prepare_chat_request`` (the backend call is never streamed;
  ``logprobs``, ``return_meta_info`` forced true, ``no_stop_trim`` false, ``input_ids`` from the
  session), ``chat_completions`` (``POST {router}/v1/chat/completions`` with header
  ``X-SMG-Routing-Key: <session id>``; a non-200 answer goes back unrecorded), ``extract_completion``
  (:func:`extract_completion`);
* ``linear_trajectory.py``: the first turn rendered by the chat template, later ones the stored
  tokens plus the appended messages' tokens; a request that diverges from the stored messages
  rolls back at most one generated assistant step (``MAX_ASSISTANT_ROLLBACK_STEPS = 1``), compared by
  ``strict_message_matches`` (role, content, reasoning_content, tool_calls without ``index``); each
  answer appends a checkpoint ``prompt ids + output ids`` that must extend the previous one;
* ``samples/merge.py`` + ``generate_utils/sample_utils.py``: a sample per record (tokens = the
  request's ``input_ids`` + the output ids of ``meta_info.output_token_logprobs``, their logprobs,
  status from the OpenAI ``finish_reason``), merged turn after turn while the turn so far is
  COMPLETED, the tokens between two turns (the tool message) masked out with logprob 0.

Used by tests/miles/test_session.py (CPU fleets) and by :mod:`rb_bench.miles_chat` (GPU).
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

import attrs
import httpx


class Status(Enum):
    """Miles' ``Sample.Status`` values the session assembly sets."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


class UpstreamResponseError(AssertionError):
    """Miles' session server refuses the router's answer (``core.UpstreamResponseError``)."""


def extract_completion(response: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[int]]:
    """``core.extract_completion``: ``meta_info.output_token_logprobs`` present, one per completion
    token, ``content`` not null; returns the choice, the message and the output ids."""
    choice = response.get("choices", [{}])[0]
    meta = choice.get("meta_info")
    if not isinstance(meta, dict) or "output_token_logprobs" not in meta:
        raise UpstreamResponseError("meta_info and output_token_logprobs must be in choice")
    message = choice.get("message") or {}
    if message.get("content") is None:
        raise UpstreamResponseError("assistant message content is None")
    if len(meta["output_token_logprobs"]) != meta["completion_tokens"]:
        raise UpstreamResponseError("len(output_token_logprobs) != completion_tokens")
    return choice, message, [t[1] for t in meta["output_token_logprobs"]]


MAX_ROLLBACK_STEPS = 1
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
_STATUS = {
    "stop": Status.COMPLETED,
    "tool_calls": Status.COMPLETED,
    "length": Status.TRUNCATED,
    "abort": Status.ABORTED,
}
_MATCHED_KEYS = ("role", "content", "reasoning_content", "tool_calls")


def _blank(value: Any) -> Any:
    """Empty and absent compare equal (Miles' ``_normalize_value``)."""
    return None if value in (None, "", [], {}) else value


def messages_match(stored: dict[str, Any], new: dict[str, Any]) -> bool:
    """Miles' strict matcher: the keys a chat template reads, tool calls without their ``index``."""
    for key in _MATCHED_KEYS:
        a, b = _blank(stored.get(key)), _blank(new.get(key))
        if key == "tool_calls" and a is not None and b is not None:
            a = [{k: v for k, v in call.items() if k != "index"} for call in a]
            b = [{k: v for k, v in call.items() if k != "index"} for call in b]
        if a != b:
            return False
    return True


@attrs.define
class TurnSample:
    """The fields of Miles' ``Sample`` the session assembly sets."""

    tokens: list[int]
    rollout_log_probs: list[float]
    loss_mask: list[int]
    response_length: int
    status: Status
    weight_versions: list[str]
    cached_tokens: int
    prompt_tokens: int


@attrs.define
class SessionServer:
    """One session of Miles' session server, proxying to ``router_url``."""

    client: httpx.AsyncClient
    router_url: str
    tokenizer: Any
    session_id: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    messages: list[dict[str, Any]] = attrs.field(factory=list)
    checkpoints: list[list[int]] = attrs.field(factory=list)
    checkpoint_ends: list[int] = attrs.field(factory=list)
    records: list[tuple[dict[str, Any], dict[str, Any]]] = attrs.field(factory=list)
    #: Bodies exactly as sent to the router, every attempt (the test checks their shape).
    sent: list[dict[str, Any]] = attrs.field(factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.checkpoints[-1] if self.checkpoints else []

    async def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The agent's ``POST /sessions/{id}/v1/chat/completions``."""
        request = copy.deepcopy(body)
        request.pop("stream", None)
        request.pop("stream_options", None)
        request.update(logprobs=True, return_meta_info=True, no_stop_trim=False)
        messages = request.get("messages", [])
        self._rollback(messages)
        request["input_ids"] = prompt_ids = self._prompt_ids(messages, request.get("tools"))
        self.sent.append(request)
        resp = await self.client.post(
            f"{self.router_url}/v1/chat/completions", json=request, headers={ROUTING_KEY_HEADER: self.session_id}
        )
        answer = resp.json()
        if resp.status_code != 200:
            return resp.status_code, answer
        _, message, completion_ids = extract_completion(answer)
        self._commit(messages, message, prompt_ids + completion_ids)
        self.records.append((request, answer))
        return resp.status_code, answer

    def _render(self, messages: list[dict[str, Any]], tools: Any, *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )
        return str(text)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prompt_ids(self, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        """The first turn rendered whole; later turns: the stored tokens, then the appended messages
        rendered after a stand-in system and assistant message (the text they add)."""
        if not self.token_ids:
            return self._encode(self._render(messages, tools, generation_prompt=True))
        for stored, new in zip(self.messages, messages, strict=False):
            assert messages_match(stored, new), "the request does not extend the stored messages"
        appended = messages[len(self.messages) :]
        assert appended, "nothing appended to the session's messages"
        last = self.messages[-1]
        base: list[dict[str, Any]] = [
            {"role": "system", "content": "dummy system"},
            {"role": "assistant", "content": "", "reasoning_content": " ", "tool_calls": last.get("tool_calls") or []},
        ]
        without = self._render(base, tools, generation_prompt=False)
        with_new = self._render(base + appended, tools, generation_prompt=True)
        assert with_new.startswith(without)
        return self.token_ids + self._encode(with_new[len(without) :])

    def _rollback(self, messages: list[dict[str, Any]]) -> None:
        """Back to the last generated checkpoint inside the matching prefix, one step at most."""
        if not self.messages or not self.checkpoints:
            return
        match = 0
        for stored, new in zip(self.messages, messages, strict=False):
            if not messages_match(stored, new):
                break
            match += 1
        if match >= len(self.messages):
            return
        keep = max((i + 1 for i, end in enumerate(self.checkpoint_ends) if end <= match), default=0)
        if len(self.checkpoints) - keep > MAX_ROLLBACK_STEPS:
            raise AssertionError(f"rollback of {len(self.checkpoints) - keep} steps refused")
        self.messages = self.messages[: self.checkpoint_ends[keep - 1] if keep else 0]
        del self.checkpoints[keep:], self.checkpoint_ends[keep:], self.records[keep:]

    def _commit(self, messages: list[dict[str, Any]], assistant: dict[str, Any], all_ids: list[int]) -> None:
        previous = self.token_ids
        assert all_ids[: len(previous)] == previous, "the new checkpoint does not extend the stored tokens"
        self.messages = self.messages + messages[len(self.messages) :] + [assistant]
        self.checkpoints.append(all_ids)
        self.checkpoint_ends.append(len(messages) + 1)

    def turn_samples(self) -> list[TurnSample]:
        out = []
        for request, answer in self.records:
            choice = answer["choices"][0]
            meta = choice["meta_info"]
            output = meta["output_token_logprobs"]
            out.append(
                TurnSample(
                    tokens=list(request["input_ids"]) + [e[1] for e in output],
                    rollout_log_probs=[e[0] for e in output],
                    loss_mask=[1] * len(output),
                    response_length=len(output),
                    status=_STATUS.get(choice["finish_reason"], Status.PENDING),
                    weight_versions=[meta["weight_version"]] if "weight_version" in meta else [],
                    cached_tokens=meta.get("cached_tokens", 0),
                    prompt_tokens=meta.get("prompt_tokens", 0),
                )
            )
        return out

    def sample(self) -> TurnSample:
        """``collect_samples``: the turns merged while the trajectory so far is COMPLETED."""
        turns = self.turn_samples()
        acc = turns[0]
        for nxt in turns[1:]:
            if acc.status is not Status.COMPLETED:
                break
            gap = len(nxt.tokens) - len(acc.tokens) - nxt.response_length
            assert gap > 0 and nxt.tokens[: len(acc.tokens)] == acc.tokens
            acc = TurnSample(
                tokens=nxt.tokens,
                rollout_log_probs=acc.rollout_log_probs + [0.0] * gap + nxt.rollout_log_probs,
                loss_mask=acc.loss_mask + [0] * gap + nxt.loss_mask,
                response_length=acc.response_length + gap + nxt.response_length,
                status=nxt.status,
                weight_versions=acc.weight_versions + nxt.weight_versions,
                cached_tokens=acc.cached_tokens + nxt.cached_tokens,
                prompt_tokens=acc.prompt_tokens + nxt.prompt_tokens,
            )
        return acc


def assistant_echo(answer: dict[str, Any]) -> dict[str, Any]:
    """The assistant message an OpenAI agent appends to its history: the answer's, as returned."""
    message = answer["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None}


def tool_result(answer: dict[str, Any], content: str) -> dict[str, Any]:
    call = answer["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]), call
    return {"role": "tool", "tool_call_id": call["id"], "content": content}


SYSTEM = {"role": "system", "content": "You answer with the weather tool."}
MAX_TOKENS = 64
#: The aborted turn's budget: far more than the abort leaves it time for.
ABORT_TURN_TOKENS = 2000


async def _turn(
    session: SessionServer, messages: list[dict[str, Any]], tools: list[Any], **extra: Any
) -> dict[str, Any]:
    """One agent call: what an OpenAI/litellm agent sends (a streaming flag and a litellm key among it)."""
    body = {"model": "tiny", "messages": messages, "tools": tools, "temperature": 0.0, "max_tokens": MAX_TOKENS,
            "stream": True, "prompt_cache_key": session.session_id, **extra}  # fmt: skip
    status, answer = await session.chat(body)
    if status != 200:
        raise UpstreamResponseError(f"HTTP {status}: {answer}")
    return answer


async def tool_session(
    session: SessionServer, tools: list[Any], tag: str, abort: Callable[[], Awaitable[None]], abort_after_s: float = 1.0
) -> dict[str, dict[str, Any]]:
    """The session the tests and the GPU comparison run, by name of turn: turn 1; turn 2 cut by
    ``max_tokens`` (length); turn 2 retried with another tool result (one-step rollback); turn 3;
    turn 4 aborted mid-generation by ``abort`` (Miles' abort loop) ``abort_after_s`` in."""
    user = {"role": "user", "content": f"What is the weather in Paris? ({tag})"}
    out: dict[str, dict[str, Any]] = {"turn1": await _turn(session, [SYSTEM, user], tools)}
    history = [SYSTEM, user, assistant_echo(out["turn1"])]
    out["turn2_length"] = await _turn(session, [*history, tool_result(out["turn1"], "sunny")], tools, max_tokens=3)
    history.append(tool_result(out["turn1"], "sunny, 21 C"))
    out["turn2_retry"] = await _turn(session, history, tools)
    history += [assistant_echo(out["turn2_retry"]), tool_result(out["turn2_retry"], "still sunny")]
    out["turn3"] = await _turn(session, history, tools)
    history += [assistant_echo(out["turn3"]), tool_result(out["turn3"], "done")]
    task = asyncio.ensure_future(_turn(session, history, tools, ignore_eos=True, max_tokens=ABORT_TURN_TOKENS))
    await asyncio.sleep(abort_after_s)
    await abort()
    out["turn4_abort"] = await asyncio.wait_for(task, 120)
    return out
