"""vLLM's own answers read by the adapter, and the fake compared with them.

``rb_bench.vllm_capture`` records, on a GPU, every call the adapter sends to vLLM 0.26 and what
vLLM answered; its file goes to ``tests/data/vllm-0.26.0-answers.json``. Here:

* every captured answer goes through the wire's parser as the adapter would read it (a refusal
  names the field; a generation's logprobs align; a flush refused under IN_PLACE is a failure);
* the same scenario is played on the fake (``fake_vllm.py``) and each of its answers must have the
  status and the JSON shape of vLLM's (``KNOWN_DIFFERENCES`` aside, each with its reason).

Without a capture the scenario's own answers from the fake are read, so the reading is tested in
any case; the comparison with vLLM skips, saying so.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import rollout_backends as rb
from rb_bench.vllm_capture import DYNAMO_FILE, VLLM_FILE, Recorder, vllm_scenario
from rollout_backends import GenerateRequest, SamplingParams
from rollout_backends.adapters.vllm import VllmWire
from rollout_backends.kit import FlushCache, HttpResponse, SseDecoder, Worker
from tests.vllm.fake_vllm import KNOWN_DIFFERENCES, fake_vllm

CAPTURED = Path(__file__).resolve().parents[1] / "data" / VLLM_FILE
W = Worker(id="h:1", control_url="http://h:1", generate_url="http://h:1")
#: The field each refusal of the scenario must be read as naming.
REFUSALS = {
    "bad_temperature": "sampling.temperature",
    "bad_token_id": "input_ids",
    "bad_empty": "input_ids",
    "bad_max_tokens": "sampling.max_new_tokens",
    "bad_logprobs": "sampling.top_logprobs",
    "bad_negative_token": "input_ids",
}


def _request_of(body: dict[str, Any]) -> GenerateRequest:
    """The ``GenerateRequest`` a captured body stands for (the adapter asks k+1 top logprobs)."""
    sp = body["sampling_params"]
    asked = sp.get("logprobs")
    return GenerateRequest(
        input_ids=body["token_ids"],
        sampling=SamplingParams(
            max_new_tokens=sp["max_tokens"], temperature=sp["temperature"], top_logprobs=max(0, (asked or 0) - 1)
        ),
        request_id=body["request_id"],
        return_logprobs=asked is not None or sp.get("prompt_logprobs") is not None,
        prompt_logprobs_start=0 if sp.get("prompt_logprobs") is not None else None,
    )


def _read_stream(wire: VllmWire, request: GenerateRequest, body: str) -> rb.Generation:
    parser = wire.stream_parser(request, HttpResponse(200, b""), worker=W.id)
    final = None
    for data in SseDecoder().feed(body.encode()):
        chunk = parser.event(data, 0.0)
        if chunk is None:
            break
        final = chunk.final or final
    assert final is not None, "the stream ended without its generation"
    return final


def read_exchange(wire: VllmWire, ex: dict[str, Any]) -> None:
    """One exchange as the adapter reads it; raises where the adapter would be wrong."""
    body, status = ex["request"], ex["status"]
    if ex["path"] == "/inference/v1/generate" and isinstance(body, dict) and body.get("token_ids") is not None:
        if ex["name"] in REFUSALS:
            with pytest.raises(rb.InvalidRequest) as exc:
                wire.parse_generation(GenerateRequest(input_ids=[1]), HttpResponse(status, ex["body"].encode()), 0.0)
            assert exc.value.field.startswith(REFUSALS[ex["name"]]), (ex["name"], exc.value.field)
            return
        request = _request_of(body)
        if body.get("stream"):
            gen = _read_stream(wire, request, ex["body"])
        else:
            gen = wire.parse_generation(request, HttpResponse(status, ex["body"].encode()), 0.0, worker=W.id)
        if ex["name"].startswith(("aborted", "stream_aborted", "in_flight_abort")):
            assert gen.aborted, ex["name"]
        elif ex["name"] == "greedy":
            assert len(gen.output_ids) == 8 and gen.logprobs is not None
    elif ex["path"] == "/reset_prefix_cache" and ex["name"].startswith("flush_while_paused"):
        response = HttpResponse(status, ex["body"].encode())
        if ex["name"].endswith("in_place"):  # requests frozen with their KV: refused
            with pytest.raises(rb.ControlFailed):
                wire.parse_control(FlushCache(), W, response)
        else:  # abort: none left; retract: preempted (vLLM's keep + clear_cache)
            wire.parse_control(FlushCache(), W, response)


async def _fake_capture(model: Path, alt: Path) -> dict[str, Any]:
    async with fake_vllm(model) as (_, url), aiohttp.ClientSession() as session:
        rec = Recorder(session, url, "the fake (tests/vllm/fake_vllm.py)")
        await vllm_scenario(rec, alt, model)
        return rec.doc


@pytest.fixture(scope="module")
def fake_doc(tiny_model: Path, tiny_model_b: Path) -> dict[str, Any]:
    return asyncio.run(_fake_capture(tiny_model, tiny_model_b))


def _captured() -> dict[str, Any] | None:
    return json.loads(CAPTURED.read_text()) if CAPTURED.is_file() else None


def test_the_adapter_reads_the_scenario_answers(fake_doc: dict[str, Any]) -> None:
    wire = VllmWire(entry_url="http://h:1", max_logprobs=21)
    docs = [d for d in (fake_doc, _captured()) if d is not None]
    for doc in docs:
        names = [ex["name"] for ex in doc["exchanges"]]
        assert {"greedy", "stream", "aborted_one", "flush_while_paused_in_place"} <= set(names), doc["_about"]
        for ex in doc["exchanges"]:
            read_exchange(wire, ex)


def _shape(value: Any, path: str = "") -> dict[str, str]:
    """``{path: type}`` of a JSON value, list items collapsed to ``[*]`` and dict keys that are
    token ids to ``*``."""
    if isinstance(value, dict):
        out: dict[str, str] = {path or ".": "object"}
        for k, v in value.items():
            key = "*" if k.isdigit() else k
            out.update(_shape(v, f"{path}.{key}" if path else key))
        return out
    if isinstance(value, list):
        out = {path: "array"}
        for v in value:
            out.update(_shape(v, f"{path}[*]"))
        return out
    if value is None:
        return {path: "null"}
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {path: "number" if number else type(value).__name__}


def _ignored(path: str) -> bool:
    pattern = {p.replace("[*]", "").replace(".*", "") for p in KNOWN_DIFFERENCES}
    return any(path.replace("[*]", "").replace(".*", "").startswith(p) for p in pattern)


def _shape_differences(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """Paths typed differently (``null`` goes with any type: optional fields), and keys one side's
    object has and the other's lacks (an empty list on one side hides its items: not counted)."""
    out = []
    for path in sorted(set(ours) | set(theirs)):
        a, b = ours.get(path), theirs.get(path)
        if _ignored(path) or a == b or "null" in (a, b) or path.endswith("[*]"):
            continue
        parent = path.rsplit(".", 1)[0] if "." in path else "."
        if a is not None and b is not None:
            out.append(f"{path}: fake {a}, vLLM {b}")
        elif ours.get(parent) == "object" and theirs.get(parent) == "object":
            out.append(f"{path}: {'only the fake' if b is None else 'only vLLM'} has it")
    return out


def test_the_fake_answers_as_vllm_does(fake_doc: dict[str, Any]) -> None:
    captured = _captured()
    if captured is None:
        pytest.skip(
            f"no GPU capture of vLLM 0.26 yet ({CAPTURED.name}: PYTHONPATH=bench python -m rb_bench.vllm_capture)"
        )
    fake = {ex["name"]: ex for ex in fake_doc["exchanges"]}
    differences = []
    for ex in captured["exchanges"]:
        mine = fake.get(ex["name"])
        if mine is None:
            differences.append(f"{ex['name']}: not played on the fake")
            continue
        if mine["status"] != ex["status"]:
            differences.append(f"{ex['name']}: HTTP {mine['status']}, vLLM {ex['status']}")
            continue
        try:
            ours, theirs = _shape(json.loads(mine["body"])), _shape(json.loads(ex["body"]))
        except ValueError:
            continue  # streams and text bodies: read by the test above
        differences += [f"{ex['name']}: {d}" for d in _shape_differences(ours, theirs)]
    assert not differences, "\n".join(differences)


def test_the_shape_comparison_can_fail() -> None:
    ours = _shape({"a": 1, "b": {"c": None, "e": [1]}, "created": 1})
    theirs = _shape({"a": "x", "b": {"c": 2, "d": 2, "e": []}, "created": "now"})
    # a: typed differently; b.d: only vLLM has it; b.c: null on one side is not a difference;
    # created: a known difference.
    assert _shape_differences(ours, theirs) == ["a: fake number, vLLM str", "b.d: only vLLM has it"]


DYNAMO_CAPTURED = CAPTURED.with_name(DYNAMO_FILE)


def test_the_dynamo_adapter_reads_dynamo_vllm_answers() -> None:
    """The frontend's answers in front of dynamo.vllm, and the worker's engine routes', read as the
    Dynamo wire's ``vllm`` flavor reads them."""
    if not DYNAMO_CAPTURED.is_file():
        pytest.skip(f"no GPU capture of dynamo.vllm 1.4.2 yet ({DYNAMO_CAPTURED.name}: rb_bench.vllm_capture)")
    from rollout_backends.adapters.dynamo import DynamoWire
    from rollout_backends.kit import Pause, Resume, UpdateFromDisk

    wire = DynamoWire(frontend_url="http://f:1", model="tiny", flavor="vllm", version_source=rb.VersionSource.STAMPED)
    worker = Worker(id="h:2", control_url="http://h:2")
    ex = {e["name"]: e for e in json.loads(DYNAMO_CAPTURED.read_text())["exchanges"]}

    def response(name: str) -> HttpResponse:
        return HttpResponse(ex[name]["status"], ex[name]["body"].encode())

    greedy = wire.parse_generation(
        GenerateRequest(input_ids=ex["greedy"]["request"]["prompt"], sampling=SamplingParams(max_new_tokens=8)),
        response("greedy"),
        0.0,
    )
    assert len(greedy.output_ids) == 8 and greedy.logprobs is not None and len(greedy.logprobs) == 8
    aborted = wire.parse_generation(
        GenerateRequest(
            input_ids=ex["aborted_one"]["request"]["prompt"],
            sampling=SamplingParams(max_new_tokens=1500, ignore_eos=True),
        ),
        response("aborted_one"),
        0.0,
    )
    assert aborted.aborted, "abort_request by the context id ended the request, read as an abort"
    for name in ("pause_abort", "pause_retract", "resume_abort"):
        wire.parse_control(Pause(rb.PauseMode.ABORT) if name.startswith("pause") else Resume(), worker, response(name))
    with pytest.raises(rb.ControlFailed):  # dynamo.vllm refuses a load unless paused
        wire.parse_control(
            UpdateFromDisk(path="/m", version=None, load_format=None, flush_cache=False),
            worker,
            response("disk_unpaused"),
        )
