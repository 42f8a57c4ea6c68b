"""Multi-turn sessions through the Miles facade, as Miles' session server sends them (shared by the
Dynamo and smg session-affinity tests).

Each turn is one ``POST /v1/chat/completions`` with the whole conversation's ``input_ids`` and, where
``keyed``, ``X-SMG-Routing-Key: <session id>`` (``miles/rollout/session/core.py`` at radixark/miles
31f1ca961a94); the next turn's ids are this turn's plus the generated ones plus new (tool/user)
tokens, as ``prepare_pretokenized`` appends them. Sessions are interleaved turn by turn, an odd
number of them, so that a round robin over two workers moves every session at each turn.
"""

from __future__ import annotations

import itertools
from typing import Any

import aiohttp

from rollout_backends.sglang_native import ROUTING_KEY_HEADER

#: One turn as measured: (the serving worker's weight-version label, prompt tokens, cached tokens).
Turn = tuple[str, int, int]


async def run_sessions(
    facade_url: str,
    *,
    keyed: bool,
    base: int,
    sessions: int = 3,
    turns: int = 3,
    first: int = 40,
    out: int = 8,
    new: int = 12,
) -> dict[str, list[Turn]]:
    """Run ``sessions`` interleaved sessions of ``turns`` turns; token ids start at ``base`` (give each
    run its own, so no run finds another's prefix cached). Workers are told apart by the weight
    version label each was given."""
    prompts = {f"s{s}": list(range(base + 80 * s, base + 80 * s + first)) for s in range(sessions)}
    result: dict[str, list[Turn]] = {sid: [] for sid in prompts}
    async with aiohttp.ClientSession() as client:
        for t in range(turns):
            for s, sid in enumerate(prompts):
                body: dict[str, Any] = {
                    "input_ids": prompts[sid],
                    "max_tokens": out,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": True,
                    "return_meta_info": True,
                }
                headers = {ROUTING_KEY_HEADER: f"{base}-{sid}"} if keyed else {}
                async with client.post(f"{facade_url}/v1/chat/completions", json=body, headers=headers) as r:
                    answer = await r.json()
                    assert r.status == 200, answer
                meta = answer["choices"][0]["meta_info"]
                # SGLang's usage (--enable-cache-report): prompt_tokens_details is null when nothing was cached.
                details = answer["usage"]["prompt_tokens_details"]
                cached = details["cached_tokens"] if details is not None else 0
                result[sid].append((meta["weight_version"], len(prompts[sid]), cached))
                generated = [e[1] for e in meta["output_token_logprobs"]]
                appended = range(base + 300 + 40 * t + new * s, base + 300 + 40 * t + new * (s + 1))
                prompts[sid] = [*prompts[sid], *generated, *appended]
    return result


def assert_sticky_and_cached(turns: dict[str, list[Turn]], page: int) -> None:
    """Each session on one worker, every turn after the first finding the previous turn's whole
    prompt in that worker's prefix cache (page-aligned)."""
    for sid, rows in turns.items():
        assert len({label for label, _, _ in rows}) == 1, (sid, rows)
        for (_, before, _), (_, _, cached) in itertools.pairwise(rows):
            assert cached >= before // page * page, (sid, rows)


def moved(turns: dict[str, list[Turn]]) -> bool:
    """Whether some session changed worker between turns."""
    return any(len({label for label, _, _ in rows}) > 1 for rows in turns.values())
