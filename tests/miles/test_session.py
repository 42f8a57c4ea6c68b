"""Miles' agentic session through the facade, over reference, SGLang (smg) and Dynamo fleets on CPU.

``rb_bench.miles_session.SessionServer`` stands in for Miles' session server (v1): it sends the router the
requests Miles' ``core.py`` builds (``input_ids`` it rendered itself, ``logprobs``,
``return_meta_info``, ``no_stop_trim: false``, header ``X-SMG-Routing-Key``), keeps the trajectory,
rolls back one step on a retry and assembles the training sample. The agent here is an OpenAI
function-calling agent: it appends each assistant message as returned and a ``tool`` message
answering its call. The model (``rb_bench.tool_call_model``) answers every turn with reasoning
and a ``get_weather`` call, so the facade, started with SGLang's ``--reasoning-parser qwen3``
and ``--tool-call-parser qwen25``, finishes turns with ``tool_calls``.

The session (``rb_bench.miles_session.tool_session``, which the GPU comparison runs too): turn 1;
turn 2 cut by ``max_tokens`` (``length``); turn 2 retried with another tool result (the session
rolls back one step); turn 3; turn 4 aborted mid-generation by Miles' abort (``GET /workers``,
``POST <worker>/abort_request {"abort_all": true}``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

import rollout_backends as rb
from rb_bench.miles_session import ABORT_TURN_TOKENS, SessionServer, Status, tool_session
from rb_bench.tool_call_model import CALL_ARGUMENTS, PIECES, TOOL, make_tool_call_model
from rollout_backends.integrations.miles import MilesFacade, start_facade
from tests.miles.miles_shapes import worker_base_urls

try:
    from rollout_backends.integrations.miles._chat_parsers import load_sglang_parsers

    load_sglang_parsers()
    HAVE_PARSERS = True
except ImportError:  # pragma: no cover - CI installs the extra (Makefile)
    HAVE_PARSERS = False

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(not HAVE_PARSERS, reason="SGLang's parsers are not installed (extra sglang-parsers)"),
]

FLEETS = ["reference", "sglang", "dynamo"]
#: "One worker per session": every turn after the first finds the previous turn's tokens cached on
#: its worker. The routing key reaches smg (policy manual, Miles' default with a session server) and
#: Dynamo's frontend (session affinity, docs/miles.md "Session affinity"); the in-process reference
#: fleet routes round robin and ignores it.
SESSION_AFFINITY = {"reference": False, "sglang": True, "dynamo": True}
#: Dynamo's session affinity keeps a session on its worker while it is used this often.
AFFINITY_TTL_S = 600
#: The fleets' KV page size (the defaults of the reference engine, SGLangFleetConfig, DynamoFleet).
PAGE = 16


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout_backends.adapters.reference._backend import cached_tiny_model

    return make_tool_call_model(tmp_path_factory.mktemp("tool-model"), cached_tiny_model())


async def _fleet(kind: str, model: Path, logs: Path) -> AsyncIterator[Any]:
    if kind == "reference":
        backend = await rb.open_backend(f"reference://{model}?workers=2")
        try:
            yield backend
        finally:
            await backend.aclose()
    elif kind == "sglang":
        from rollout_backends.adapters.sglang import SGLangFleetConfig, launch_sglang_fleet

        config = SGLangFleetConfig(
            model_path=str(model), workers=2, worker_kind="reference", router="smg", router_policy="manual",
            health_check_interval_s=1, log_dir=str(logs), startup_timeout_s=120,
        )  # fmt: skip
        async with launch_sglang_fleet(config) as fleet:
            yield fleet.backend
    else:
        if importlib.util.find_spec("dynamo.frontend") is None:
            pytest.skip("ai-dynamo is not installed")
        from rollout_backends.adapters.dynamo import DynamoFleet, launch_dynamo_fleet

        config = DynamoFleet(
            model_path=model, workers=2, worker_kind="reference", session_affinity_ttl_secs=AFFINITY_TTL_S
        )
        async with launch_dynamo_fleet(config) as running:
            yield await running.connect()


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=FLEETS)
async def facade_url(
    request: pytest.FixtureRequest, tool_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[str, str]]:
    from transformers import AutoTokenizer

    kind = request.param
    async for backend in _fleet(kind, tool_model, tmp_path_factory.mktemp(f"{kind}-logs")):
        await backend.wait_ready(120)
        facade = MilesFacade(
            backend,
            tokenizer=AutoTokenizer.from_pretrained(str(tool_model)),
            model_path=str(tool_model),
            tool_call_parser="qwen25",
            reasoning_parser="qwen3",
        )
        running = await start_facade(facade, port=0)
        try:
            yield kind, running.url
        finally:
            await running.stop()


async def _abort_all(client: httpx.AsyncClient, router: str) -> None:
    """Miles' ``inference_rollout_train.abort``: every worker the router lists, ``abort_all``."""
    for url in worker_base_urls((await client.get(f"{router}/workers")).json(), list_workers=False):
        assert (await client.post(f"{url}/abort_request", json={"abort_all": True})).status_code == 200


def _check_tool_turn(answer: dict[str, Any], chain: list[int]) -> None:
    choice = answer["choices"][0]
    message, meta = choice["message"], choice["meta_info"]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    assert meta["finish_reason"] == {"type": "tool_calls", "matched": None}  # as SGLang leaves it
    assert (message["content"], message["reasoning_content"]) == ("", "The tool knows.")
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": CALL_ARGUMENTS} and call["index"] == 0
    assert call["id"].startswith("call_") and len(call["id"]) == 29
    assert [e[1] for e in meta["output_token_logprobs"]] == chain  # the pieces, then eos
    assert all(-0.01 < e[0] <= 0.0 for e in meta["output_token_logprobs"])


async def test_a_tool_calling_session(facade_url: tuple[str, str], tool_model: Path) -> None:
    from transformers import AutoTokenizer

    kind, router = facade_url
    tok = AutoTokenizer.from_pretrained(str(tool_model))
    chain = [*(int(tok.convert_tokens_to_ids(p)) for p in PIECES), 0]
    async with httpx.AsyncClient(timeout=120) as client:
        session = SessionServer(client, router, tok)
        # The reference workers need ~15 ms a token on two busy cores: 1 s in, turn 4 is generating.
        turns = await tool_session(session, [TOOL], kind, lambda: _abort_all(client, router))
    for name in ("turn1", "turn2_retry", "turn3"):
        _check_tool_turn(turns[name], chain)
    cut = turns["turn2_length"]["choices"][0]
    assert cut["finish_reason"] == "length" and cut["meta_info"]["completion_tokens"] == 3
    assert [answer for _, answer in session.records][1] is turns["turn2_retry"]  # turn 2 rolled back
    aborted = turns["turn4_abort"]["choices"][0]
    assert aborted["finish_reason"] == "abort" and aborted["message"]["content"] is not None
    assert 0 < aborted["meta_info"]["completion_tokens"] < ABORT_TURN_TOKENS
    _check_requests(session)
    _check_samples(session, kind)


def _check_requests(session: SessionServer) -> None:
    """Each request as Miles' core.py builds it; each prompt extends the previous checkpoint."""
    for sent in session.sent:
        assert "stream" not in sent and sent["logprobs"] is True and sent["return_meta_info"] is True
        assert sent["no_stop_trim"] is False and isinstance(sent["input_ids"], list)
    prompts = [request["input_ids"] for request, _ in session.records]
    for (_, answer), prompt, nxt in zip(session.records, prompts, prompts[1:], strict=False):
        out = [e[1] for e in answer["choices"][0]["meta_info"]["output_token_logprobs"]]
        assert nxt[: len(prompt) + len(out)] == prompt + out


def _check_samples(session: SessionServer, kind: str) -> None:
    turns = session.turn_samples()
    assert [t.status for t in turns] == [Status.COMPLETED] * 3 + [Status.ABORTED]
    sample = session.sample()
    assert sample.tokens == session.token_ids and sample.status is Status.ABORTED
    first_prompt = len(session.records[0][0]["input_ids"])
    assert sample.response_length == len(sample.tokens) - first_prompt
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    assert sum(sample.loss_mask) == sum(t.response_length for t in turns)
    generated = [lp for _, a in session.records for lp, *_ in a["choices"][0]["meta_info"]["output_token_logprobs"]]
    assert [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if m] == generated
    assert len(sample.weight_versions) == 4
    if SESSION_AFFINITY[kind]:
        # One worker per session: each turn finds the previous checkpoint (prompt + output, but its
        # last token, whose KV was never computed) cached on its worker, to the page; on another
        # worker only what that one saw earlier. (Round robin, measured: turn 3 finds 64 of 97.)
        for (request, answer), turn in zip(session.records, turns[1:], strict=False):
            checkpoint = len(request["input_ids"]) + answer["choices"][0]["meta_info"]["completion_tokens"]
            wanted = (checkpoint - 1) // PAGE * PAGE
            assert turn.cached_tokens >= wanted, [(t.prompt_tokens, t.cached_tokens) for t in turns]
