"""``rb_bench.miles_chat`` (the GPU stage of issue 27) on CPU: equal answers compare equal whatever
tool-call ids SGLang drew; a planted difference in any compared part is found; every target is sent
the same prompts; one ``--gpus`` value serves one-worker and two-worker fleets; reruns of a subset
against an earlier run's stock."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from rb_bench import miles_chat
from rb_bench.fanout import MEM_FRACTION
from rb_bench.miles_chat import TARGETS, compare, compare_turn
from rb_bench.miles_session import ABORT_TURN_TOKENS
from rb_bench.tool_call_model import make_tool_call_model

#: rb_bench.miles_chat's results of 2026-12-05 on one H100: stock SGLang 0.5.16's answers.
STOCK_H100 = Path(__file__).parents[2] / "docs" / "data" / "miles-chat-2026-12-05-stock-h100.json"


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


# -- the prompts every target is sent ------------------------------------------------------------


def _router(seen: list[str]) -> httpx.MockTransport:
    """A router answering every chat turn with a tool call (Miles' abort answered too)."""
    count = itertools.count()

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path != "/v1/chat/completions":
            return httpx.Response(404 if request.url.path == "/workers" else 200, json={})
        answer = _answer(f"call_{next(count):024x}")
        answer["choices"][0]["meta_info"]["completion_tokens"] = 2
        if json.loads(request.content)["max_tokens"] == ABORT_TURN_TOKENS:
            answer["choices"][0]["finish_reason"] = "abort"
        return httpx.Response(200, json=answer)

    return httpx.MockTransport(handle)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout_backends.adapters.reference._backend import cached_tiny_model

    return make_tool_call_model(tmp_path_factory.mktemp("tool-model"), cached_tiny_model())


async def test_every_target_is_sent_the_same_prompts(
    tool_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU run of 2026-12-05 found stock's prompt_tokens 8 below the facades' on every turn: the
    session's user message carried the target's name. Same session, same prompt ids, any target."""

    @contextlib.asynccontextmanager
    async def router(*_: Any) -> AsyncIterator[str]:
        yield "http://router"

    monkeypatch.setattr(miles_chat, "_open", router)
    cfg = miles_chat.Config(out=tmp_path, engine="reference")
    seen: list[str] = []
    results = {
        kind: await miles_chat.run_target(kind, cfg, tool_model, 60, transport=_router(seen)) for kind in TARGETS
    }
    assert all(r["ok"] for r in results.values()), results
    assert seen.count("/abort_request") == len(TARGETS)  # the session ran to its aborted turn
    first = results["stock"]["prompts"]
    assert list(first) == list(results["stock"]["turns"]) and all(first.values())
    for kind in TARGETS[1:]:
        assert results[kind]["prompts"] == first, kind
    _, comparisons = miles_chat.compare(results)
    assert all(c["equal"] for turns in comparisons.values() for c in turns.values()), comparisons


def test_a_prompt_difference_is_reported_as_one() -> None:
    base = {"ok": True, "turns": {"turn1": _answer()}, "prompts": {"turn1": [1, 2, 3]}}
    other = {"ok": True, "turns": {"turn1": _answer()}, "prompts": {"turn1": [1, 2, 4, 5]}}
    _, comparisons = compare({"stock": base, "facade-dynamo": other})
    turn = comparisons["facade-dynamo"]["turn1"]
    assert not turn["equal"]
    assert turn["differences"] == ["input_ids: baseline 3 ids, target 4 ids, first difference at 2"]
    unrecorded = {k: v for k, v in base.items() if k != "prompts"}  # a baseline from before the fix
    assert compare({"stock": unrecorded, "facade-dynamo": other})[1]["facade-dynamo"]["turn1"]["equal"]
    aborted = compare_turn("turn4_abort", _aborted(), _aborted(), ([1], [2]))
    assert not aborted["equal"] and aborted["differences"][0].startswith("input_ids")


def _aborted() -> dict[str, Any]:
    answer = _answer()
    answer["choices"][0]["finish_reason"] = "abort"
    return answer


# -- GPUs, memory and fleets ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "stock", "facade"),
    [(("0",), ("0",), ("0", "0")), (("0", "0"), ("0",), ("0", "0")), (("0", "1"), ("0",), ("0", "1"))],
)
def test_one_gpus_value_serves_every_target(
    gpus: tuple[str, ...], stock: tuple[str, ...], facade: tuple[str, ...], tmp_path: Path
) -> None:
    """The GPU runs of 2026-12-05: --gpus 0 refused both facades, --gpus 0,0 refused stock."""
    cfg = miles_chat.Config(out=tmp_path, gpus=gpus)
    assert cfg.gpus_of("stock") == stock
    assert cfg.gpus_of("facade-sglang") == cfg.gpus_of("facade-dynamo") == facade
    model = tmp_path / "model"
    model.mkdir()
    configs = {
        "stock": miles_chat._sglang_config("stock", cfg, model, tmp_path, 60, router="none"),
        "facade-sglang": miles_chat._sglang_config("facade-sglang", cfg, model, tmp_path, 60, router="smg"),
    }
    assert configs["stock"].cuda_visible_devices == stock and configs["stock"].workers == 1
    assert configs["facade-sglang"].cuda_visible_devices == facade and configs["facade-sglang"].workers == 2
    dynamo = miles_chat._dynamo_config("facade-dynamo", cfg, model, 60)
    assert tuple(dynamo.gpus) == facade and dynamo.workers == 2


def test_workers_sharing_a_gpu_get_the_shared_gpu_recipe(tmp_path: Path) -> None:
    """A high static fraction with a capped pool (fanout/grpo's recipe): at 0.12 the second
    dynamo.sglang worker found no memory left for its KV cache (SGLang 0.5.16, H100)."""
    cfg = miles_chat.Config(out=tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    stock = miles_chat._sglang_config("stock", cfg, model, tmp_path, 60, router="none", extra_server_args=("--x",))
    assert stock.mem_fraction_static == MEM_FRACTION >= 0.5
    assert list(stock.extra_server_args) == ["--x", "--max-total-tokens", str(miles_chat.KV_TOKENS)]
    args = list(miles_chat._dynamo_config("facade-dynamo", cfg, model, 60).sglang_args)
    assert args[args.index("--mem-fraction-static") + 1] == str(MEM_FRACTION)
    assert args[args.index("--max-total-tokens") + 1] == str(miles_chat.KV_TOKENS)
    reference = miles_chat.Config(out=tmp_path, engine="reference")
    assert miles_chat._dynamo_config("facade-dynamo", reference, model, 60).sglang_args == ()


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"gpus": ("0", "")}, "--gpus"),
        ({"gpus": ()}, "--gpus"),
        ({"targets": ("stock", "facade-vllm")}, "--targets"),
        ({"targets": ()}, "--targets"),
        ({"baseline": Path("x.json")}, "--baseline"),
    ],
)
def test_bad_options_are_refused_naming_them(kw: dict[str, Any], field: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=field):
        miles_chat.Config(out=tmp_path, **kw)


async def test_the_next_target_waits_for_the_gpus_to_be_released() -> None:
    answers = iter([[11, 12], [12], [], [99]])
    done = await miles_chat.wait_gpus_released(timeout=10, query=lambda: next(answers))
    assert done["released"] and done["waited_s"] >= 1.5  # polled until the list was empty
    held = await miles_chat.wait_gpus_released(timeout=0, query=lambda: [7])
    assert held == {"released": False, "waited_s": 0.0, "held_by": [7]}
    assert (await miles_chat.wait_gpus_released(query=lambda: None))["nvidia_smi"] is False


# -- --targets and --baseline --------------------------------------------------------------------


def _earlier_run(tmp_path: Path, **changes: Any) -> Path:
    doc = {
        "engine": "sglang",
        "parsers": {"tool_call_parser": "qwen25", "reasoning_parser": "qwen3"},
        "targets": {"stock": {"ok": True, "seconds": 133.5, "turns": {"turn1": _answer()}}},
        **changes,
    }
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"targets": {"stock": {"ok": False, "error": "InvalidRequest: x"}}}, "did not run"),
        ({"engine": "reference"}, "engine"),
        ({"parsers": {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}}, "parsers"),
        ({"model_sha256": "0" * 64}, "model sha256"),
    ],
)
def test_a_baseline_that_cannot_stand_for_stock_is_refused(changes: dict[str, Any], why: str, tmp_path: Path) -> None:
    cfg = miles_chat.Config(out=tmp_path, targets=("facade-dynamo",), baseline=Path("unused"))
    with pytest.raises(miles_chat.BaselineError, match=why):
        miles_chat.load_baseline(_earlier_run(tmp_path, **changes), cfg, "f" * 64)


async def test_a_rerun_of_one_target_against_an_earlier_stock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    async def run_target(kind: str, *_: Any, **__: Any) -> dict[str, Any]:
        ran.append(kind)
        other = _answer("call_fedcba9876543210fedcba98")
        other["usage"]["prompt_tokens"] += 8  # what the GPU run found
        return {"ok": True, "seconds": 1.0, "turns": {"turn1": other}, "prompts": {"turn1": [1]}}

    monkeypatch.setattr(miles_chat, "run_target", run_target)
    monkeypatch.setattr(miles_chat, "wait_gpus_released", lambda: _released())
    monkeypatch.setattr(miles_chat, "make_tool_call_model", lambda out, base: _model(tmp_path))
    monkeypatch.setattr("rollout_backends.adapters.reference.make_tiny_model", lambda *_, **__: tmp_path)
    cfg = miles_chat.Config(out=tmp_path / "out", targets=("facade-dynamo",), baseline=_earlier_run(tmp_path))
    doc = await miles_chat.run(cfg)
    assert ran == ["facade-dynamo"] and doc["baseline"] == "stock"
    assert doc["targets"]["stock"]["baseline_file"] == str(cfg.baseline)
    assert doc["targets"]["facade-sglang"] == {"ok": False, "skipped": "not in --targets"}
    assert doc["targets"]["facade-dynamo"]["gpu_release"] == {"released": True}
    (turn,) = doc["comparisons"]["facade-dynamo"].values()
    assert doc["verdict"] == "different" and turn["differences"][0].startswith("usage:")
    assert doc["model_sha256"] == hashlib.sha256(b"weights").hexdigest()
    assert json.loads((tmp_path / "out" / "results.json").read_text())["verdict"] == "different"


async def _released() -> dict[str, Any]:
    return {"released": True}


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "model.safetensors").write_bytes(b"weights")
    return model


def test_the_command_line_refuses_a_baseline_with_stock_among_the_targets(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        miles_chat.main(["--out", "x", "--targets", "stock,facade-dynamo", "--baseline", "x.json"])
    assert exc.value.code == 2 and "--baseline stands for stock" in capsys.readouterr().err


async def test_a_facade_target_sends_what_stock_was_sent_on_the_gpu(
    tool_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stock SGLang's answers of the H100 run (docs/data), replayed to a facade target's session:
    the prompts it sends are as long as stock counted them (``meta_info.prompt_tokens``), so a
    rerun's facade answers compare with that baseline (they were 8 tokens longer)."""
    baseline = json.loads(STOCK_H100.read_text(encoding="utf-8"))["targets"]["stock"]["turns"]
    answers = iter(baseline.values())

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(200, json=next(answers))
        return httpx.Response(404 if request.url.path == "/workers" else 200, json={})

    @contextlib.asynccontextmanager
    async def router(*_: Any) -> AsyncIterator[str]:
        yield "http://router"

    monkeypatch.setattr(miles_chat, "_open", router)
    cfg = miles_chat.Config(out=tmp_path, engine="reference")
    result = await miles_chat.run_target("facade-dynamo", cfg, tool_model, 60, transport=httpx.MockTransport(handle))
    assert result["ok"], result
    sent = {name: len(ids) for name, ids in result["prompts"].items()}
    assert sent == {name: a["choices"][0]["meta_info"]["prompt_tokens"] for name, a in baseline.items()}
