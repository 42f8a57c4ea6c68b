"""vLLM's own answers read by the adapter, and the fake compared with them.

``rb_bench.vllm_capture`` records, on a GPU, every call the adapter sends to vLLM 0.26 and what
vLLM answered; its file goes to ``tests/data/vllm-0.26.0-answers.json``. Here:

* every captured answer goes through the wire's parser as the adapter would read it (a refusal
  names the field; a generation's logprobs align; a flush refused under IN_PLACE is a failure);
* the same scenario is played on the fake (``fake_vllm.py``) and each of its answers must have the
  status and the JSON shape of vLLM's (``KNOWN_DIFFERENCES`` aside, each with its reason).

Without a capture the scenario's own answers from the fake are read, so the reading is tested in
any case; the comparison with vLLM skips, saying so. An exchange the capture's client got no answer
to (``status`` -1: the request never reached the server, see ``Recorder``) tells nothing: each check
that needs one skips, naming it and the client's error.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import rollout_backends as rb
from rb_bench.vllm_capture import DYNAMO_FILE, LONG, PROMPT, VLLM_FILE, Recorder, vllm_scenario
from rollout_backends import GenerateRequest, SamplingParams
from rollout_backends.adapters.vllm import VllmWire
from rollout_backends.kit import FlushCache, HttpResponse, Ready, ResumeMemory, SseDecoder, UpdateFromDisk, Worker
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


def _read_stream(wire: Any, request: GenerateRequest, body: str, *, skip: bytes | None = None) -> rb.Generation:
    """A streamed answer through the wire's parser (events holding ``skip`` left out)."""
    parser = wire.stream_parser(request, HttpResponse(200, b""), worker=W.id)
    final = None
    for data in SseDecoder().feed(body.encode()):
        if skip is not None and skip in data:
            continue
        chunk = parser.event(data, 0.0)
        if chunk is None:
            break
        final = chunk.final or final
    assert final is not None, "the stream ended without its generation"
    return final


#: The call each aborted exchange was aborted by: judged only where that call was answered.
ABORTED_BY = {
    "aborted_one": "abort_one",
    "aborted_all": "abort_all",
    "stream_aborted": "abort_stream",
    "in_flight_abort": "pause_abort",
}


def unanswered(doc: dict[str, Any]) -> dict[str, str]:
    """``{name: the client's error}`` of the exchanges that got no answer (``status`` -1)."""
    return {ex["name"]: ex["body"][:120] for ex in doc["exchanges"] if ex["status"] == -1}


def read_exchange(wire: VllmWire, ex: dict[str, Any], missing: dict[str, str]) -> None:
    """One exchange as the adapter reads it; raises where the adapter would be wrong. ``missing``:
    the capture's unanswered exchanges (``unanswered``); an exchange that needs one is not judged."""
    body, status = ex["request"], ex["status"]
    if ex["name"] in missing or ABORTED_BY.get(ex["name"]) in missing:
        return
    if ex["path"] == "/inference/v1/generate" and isinstance(body, dict) and body.get("token_ids") is not None:
        if ex["name"] in REFUSALS:
            with pytest.raises(rb.InvalidRequest) as exc:
                wire.parse_generation(GenerateRequest(input_ids=[1]), HttpResponse(status, ex["body"].encode()), 0.0)
            assert exc.value.field.startswith(REFUSALS[ex["name"]]), (ex["name"], exc.value.field)
            return
        request = _request_of(body)
        if status >= 500:  # an engine that died (a failed reload before it): never read as tokens
            with pytest.raises(rb.BackendUnavailable):
                wire.parse_generation(request, HttpResponse(status, ex["body"].encode()), 0.0, worker=W.id)
            return
        if body.get("stream"):
            gen = _read_stream(wire, request, ex["body"])
        else:
            gen = wire.parse_generation(request, HttpResponse(status, ex["body"].encode()), 0.0, worker=W.id)
        if ex["name"] in ABORTED_BY:
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


def _captured(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


CAPTURED_DOC = _captured(CAPTURED)


def test_the_adapter_reads_the_scenario_answers(fake_doc: dict[str, Any]) -> None:
    wire = VllmWire(entry_url="http://h:1", max_logprobs=21)
    docs = [d for d in (fake_doc, CAPTURED_DOC) if d is not None]
    assert not unanswered(fake_doc), unanswered(fake_doc)
    for doc in docs:
        names = [ex["name"] for ex in doc["exchanges"]]
        assert {"greedy", "stream", "aborted_one", "flush_while_paused_in_place"} <= set(names), doc["_about"]
        for ex in doc["exchanges"]:
            read_exchange(wire, ex, unanswered(doc))


def _vllm_read(name: str) -> tuple[rb.Generation, dict[str, Any]]:
    """One captured generation read by the wire, with vLLM's raw answer (a stream: its chunks'
    ``token_ids`` and logprob entries joined)."""
    assert CAPTURED_DOC is not None
    ex = next(e for e in CAPTURED_DOC["exchanges"] if e["name"] == name)
    wire, request = VllmWire(entry_url="http://h:1", max_logprobs=21), _request_of(ex["request"])
    if not ex["request"].get("stream"):
        data = json.loads(ex["body"])
        return wire.parse_generation(request, HttpResponse(200, ex["body"].encode()), 0.0), data
    events = [json.loads(line[6:]) for line in ex["body"].splitlines() if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events if e["choices"]]
    content = [c for ch in choices for c in ch["logprobs"]["content"]]
    joined = {"token_ids": [t for ch in choices for t in ch["token_ids"]], "logprobs": {"content": content}}
    return _read_stream(wire, request, ex["body"]), {"choices": [joined], "usage": events[-1]["usage"]}


def _raw(data: dict[str, Any]) -> tuple[list[int], list[float]]:
    choice = data["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]


@pytest.mark.skipif(CAPTURED_DOC is None, reason="no GPU capture of vLLM 0.26 yet")
def test_the_adapter_reads_vllm_exactly() -> None:
    """vLLM 0.26's own answers (the H100 capture) read to the token and the logprob: what each
    exchange's ``note`` in ``rb_bench.vllm_capture`` asks."""
    for name in ("greedy", "stop_probe", "stream", "aborted_one", "in_flight_retract", "in_flight_in_place"):
        gen, data = _vllm_read(name)
        ids, lps = _raw(data)
        assert list(gen.output_ids) == ids and list(gen.logprobs or ()) == lps, name
        assert gen.cached_tokens == data["usage"]["prompt_tokens_details"]["cached_tokens"], name
    in_place = _vllm_read("in_flight_in_place")[0]
    full = in_place.output_ids
    # An abort keeps the tokens so far: the greedy continuation's first ones.
    for name in ("aborted_one", "aborted_all", "in_flight_abort", "stream_aborted"):
        gen = _vllm_read(name)[0]
        assert gen.aborted and 0 < len(gen.output_ids) < LONG and gen.output_ids == full[: len(gen.output_ids)], name
    # A RETRACT pause preempts the request; after /resume vLLM recomputes its KV from prompt +
    # tokens: the same tokens and bit-equal logprobs up to there, then logprobs that differ (the
    # recomputed KV is not the decoded one) and, on the tiny model's flat distributions, other
    # greedy tokens later (docs/vllm.md, "Pause modes").
    retract = _vllm_read("in_flight_retract")[0]
    assert retract.logprobs is not None and in_place.logprobs is not None
    k = next(i for i, (a, b) in enumerate(zip(retract.logprobs, in_place.logprobs, strict=True)) if a != b)
    assert k > len(_vllm_read("in_flight_abort")[0].output_ids) // 2 and retract.output_ids[:k] == full[:k]
    # stop_token_ids: vLLM keeps the stop token, the last of token_ids (SGLang's way).
    stop, probe = _vllm_read("stop_token")[0], _vllm_read("stop_probe")[0]
    assert stop.finish_reason is rb.FinishReason.STOP and stop.output_ids == probe.output_ids[:3]
    assert stop.matched_stop == probe.output_ids[2]
    # Weights from disk: other weights answer other tokens; the base again answers the base's.
    greedy = _vllm_read("greedy")[0].output_ids
    assert _vllm_read("greedy_alt")[0].output_ids != greedy
    for name in ("greedy_base_again", "greedy_after_wake"):  # woken tag by tag, the adapter's way
        assert _vllm_read(name)[0].output_ids == greedy, name


@pytest.mark.skipif(CAPTURED_DOC is None, reason="no GPU capture of vLLM 0.26 yet")
def test_a_failed_reload_kills_vllm_and_every_later_call_is_read_as_unavailable() -> None:
    """vLLM 0.26 after ``reload_weights`` from a missing path (HTTP 500): its engine core died
    (``EngineDeadError``), and every later call answered HTTP 500, the reload of the good
    checkpoint too (H100 capture of 2026-12-06 06:21). The adapter reads the load as failed and
    each generation after it as the backend unavailable: no tokens from half-loaded weights."""
    assert CAPTURED_DOC is not None
    ex = {e["name"]: e for e in CAPTURED_DOC["exchanges"]}
    after = ("greedy_after_failed_reload", "reload_base_after_failure", "greedy_after_recovery")
    if any(ex.get(n, {"status": -1})["status"] == -1 for n in ("reload_missing", *after)):
        pytest.skip("the capture's client got no answer to the failed reload or the calls after it")
    wire = VllmWire(entry_url="http://h:1")
    disk = UpdateFromDisk(path="/m", version=None, load_format=None, flush_cache=False)
    for name in ("reload_missing", "reload_base_after_failure"):
        with pytest.raises(rb.ControlFailed):
            wire.parse_control(disk, W, HttpResponse(ex[name]["status"], ex[name]["body"].encode()))
    for name in ("greedy_after_failed_reload", "greedy_after_recovery"):
        assert "EngineCore encountered an issue" in ex[name]["body"], name
        with pytest.raises(rb.BackendUnavailable):
            wire.parse_generation(_request_of(ex[name]["request"]), HttpResponse(500, ex[name]["body"].encode()), 0.0)


def test_vllm_fails_a_plain_wake_up_after_a_partial_one_and_the_adapter_never_sends_it() -> None:
    """vLLM 0.26 after ``/sleep`` and ``/wake_up?tags=weights``: a plain ``/wake_up`` answered HTTP
    500 (the woken weights mapped again) and the next generation got no answer in 120 s. Read as a
    failure; the adapter never sends it (its resume: one call per tag, tests/vllm/test_vllm_wire.py)."""
    plain = _captured(CAPTURED.with_name("vllm-0.26.0-plain-wake-up.json"))
    assert plain is not None
    ex = {e["name"]: e for e in plain["exchanges"]}
    if ex["wake_up"]["status"] == -1:
        pytest.skip(f"the capture's client got no answer to wake_up ({ex['wake_up']['body'][:80]})")
    assert ex["wake_up_weights"]["status"] == 200 and json.loads(ex["is_sleeping_half"]["body"])["is_sleeping"]
    assert ex["wake_up"]["status"] == 500 and "CUDA Error: invalid argument" in ex["wake_up"]["body"]
    wire = VllmWire(entry_url="http://h:1")
    with pytest.raises(rb.ControlFailed, match="CUDA Error"):
        wire.parse_control(ResumeMemory(None), W, HttpResponse(500, ex["wake_up"]["body"].encode()))


@pytest.mark.skipif(CAPTURED_DOC is None, reason="no GPU capture of vLLM 0.26 yet")
def test_the_adapter_reads_vllm_top_and_prompt_logprobs_exactly() -> None:
    """Top logprobs: asked k + 1 with the sampled token listed first, the k best of vLLM's entries,
    best first; prompt logprobs: each prompt token's own, the first ``None``."""
    gen, data = _vllm_read("top3_asked_4_sampled")
    assert gen.top_logprobs is not None and len(gen.top_logprobs) == len(gen.output_ids)
    for i, (top, entry) in enumerate(zip(gen.top_logprobs, data["choices"][0]["logprobs"]["content"], strict=True)):
        offered = sorted((e["logprob"] for e in entry["top_logprobs"]), reverse=True)
        assert [lp for _, lp in top] == offered[:3], i
        assert all(entry_lp in offered for _, entry_lp in top)
    gen, data = _vllm_read("prompt_logprobs")
    own = [None] + [data["prompt_logprobs"][i][str(t)]["logprob"] for i, t in enumerate(PROMPT) if i]
    assert gen.prompt_logprobs == tuple(own)
    wire = VllmWire(entry_url="http://h:1")
    assert CAPTURED_DOC is not None
    by_name = {e["name"]: e for e in CAPTURED_DOC["exchanges"]}
    assert wire.parse_probe(Ready(), W, HttpResponse(200, by_name["is_sleeping"]["body"].encode())) is True
    for name in ("rpc_unknown", "start_weight_update_unconfigured"):  # HTTP 500: a failed load
        with pytest.raises(rb.ControlFailed):
            wire.parse_control(
                UpdateFromDisk(path="/m", version=None, load_format=None, flush_cache=False),
                W,
                HttpResponse(by_name[name]["status"], by_name[name]["body"].encode()),
            )


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


_NO_CAPTURE = f"no GPU capture of vLLM 0.26 yet ({CAPTURED.name}: PYTHONPATH=bench python -m rb_bench.vllm_capture)"


@pytest.mark.parametrize(
    "name",
    [ex["name"] for ex in CAPTURED_DOC["exchanges"]]
    if CAPTURED_DOC
    else [pytest.param("-", marks=pytest.mark.skip(reason=_NO_CAPTURE))],
)
def test_the_fake_answers_as_vllm_does(fake_doc: dict[str, Any], name: str) -> None:
    """Each captured answer against the fake's to the same call: its status and JSON shape."""
    assert CAPTURED_DOC is not None
    ex = next(e for e in CAPTURED_DOC["exchanges"] if e["name"] == name)
    if ex["status"] == -1:
        pytest.skip(f"the capture's client got no answer to {name} ({ex['body'][:100]}): nothing to compare")
    mine = {e["name"]: e for e in fake_doc["exchanges"]}.get(name)
    assert mine is not None, f"{name}: not played on the fake"
    assert mine["status"] == ex["status"], f"{name}: HTTP {mine['status']}, vLLM {ex['status']}"
    try:
        ours, theirs = _shape(json.loads(mine["body"])), _shape(json.loads(ex["body"]))
    except ValueError:
        return  # streams and text bodies: read by the test above
    differences = _shape_differences(ours, theirs)
    assert not differences, "\n".join(differences)


def test_the_shape_comparison_can_fail() -> None:
    ours = _shape({"a": 1, "b": {"c": None, "e": [1]}, "created": 1})
    theirs = _shape({"a": "x", "b": {"c": 2, "d": 2, "e": []}, "created": "now"})
    # a: typed differently; b.d: only vLLM has it; b.c: null on one side is not a difference;
    # created: a known difference.
    assert _shape_differences(ours, theirs) == ["a: fake number, vLLM str", "b.d: only vLLM has it"]


DYNAMO_CAPTURED = CAPTURED.with_name(DYNAMO_FILE)
DYNAMO_DOC = _captured(DYNAMO_CAPTURED)
_NO_DYNAMO = f"no GPU capture of dynamo.vllm 1.4.2 yet ({DYNAMO_CAPTURED.name}: rb_bench.vllm_capture)"


def _dynamo() -> tuple[Any, dict[str, HttpResponse], dict[str, dict[str, Any]]]:
    """The Dynamo wire's ``vllm`` flavor, and the capture's answers and exchanges by name."""
    if DYNAMO_DOC is None:
        pytest.skip(_NO_DYNAMO)
    from rollout_backends.adapters.dynamo import DynamoWire

    wire = DynamoWire(frontend_url="http://f:1", model="tiny", flavor="vllm", version_source=rb.VersionSource.STAMPED)
    ex = {e["name"]: e for e in DYNAMO_DOC["exchanges"]}
    return wire, {n: HttpResponse(e["status"], e["body"].encode()) for n, e in ex.items()}, ex


def test_the_dynamo_adapter_reads_dynamo_vllm_generations() -> None:
    """The frontend's ``/v1/completions`` answers in front of dynamo.vllm, read as the Dynamo wire's
    ``vllm`` flavor reads them: tokens and logprobs as ``engine_data`` gives them."""
    wire, response, ex = _dynamo()
    for name in ("greedy", "top3", "greedy_after_wake"):
        data = json.loads(ex[name]["body"])
        gen = wire.parse_generation(
            GenerateRequest(input_ids=ex[name]["request"]["prompt"], sampling=SamplingParams(max_new_tokens=8)),
            response[name],
            0.0,
        )
        assert list(gen.output_ids) == data["nvext"]["completion_token_ids"], name
        assert gen.logprobs == tuple(data["nvext"]["engine_data"]["completion_logprobs"]), name
        assert gen.finish_reason is rb.FinishReason.LENGTH and not gen.aborted, name
    stream = _read_dynamo_stream(wire, ex["stream"])
    assert (
        stream.output_ids
        == wire.parse_generation(
            GenerateRequest(input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=8)), response["top3"], 0.0
        ).output_ids
    )


def test_dynamo_vllm_serves_no_generation_after_a_failed_load() -> None:
    """dynamo.vllm 1.4.2 after a load from a missing checkpoint (answered ``{"status": "error"}``)
    and a resume: the next completion is an HTTP 500 ("Failed to fold completions stream"; H100
    capture of 2026-12-06), read as the backend unavailable, never as tokens of half-loaded weights."""
    wire, response, ex = _dynamo()
    if ex["greedy_after_failed_load"]["status"] == -1 or ex["disk_missing"]["status"] == -1:
        pytest.skip("the capture's client got no answer to the failed load or the generation after it")
    assert json.loads(ex["disk_missing"]["body"])["status"] == "error"
    with pytest.raises(rb.BackendUnavailable, match="Failed to fold completions stream"):
        wire.parse_generation(
            GenerateRequest(input_ids=ex["greedy_after_failed_load"]["request"]["prompt"]),
            response["greedy_after_failed_load"],
            0.0,
        )


def _read_dynamo_stream(wire: Any, ex: dict[str, Any]) -> rb.Generation:
    """The capture asked ``stream_options.include_usage``, which the wire does not: the frontend's
    closing ``choices: []`` usage chunk is not one the wire is sent, so it is left out here."""
    request = GenerateRequest(input_ids=ex["request"]["prompt"], sampling=SamplingParams(max_new_tokens=8))
    return _read_stream(wire, request, ex["body"], skip=b'"choices":[]')


def test_dynamo_vllm_returns_no_prompt_logprobs() -> None:
    """Why the ``vllm`` flavor declares no prompt logprobs: asked ``prompt_logprobs: 0`` through the
    1.4.2 frontend, dynamo.vllm's ``engine_data.prompt_logprobs`` held one entry for a 17-token prompt
    (the H100 capture of 2026-12-05), which the wire refuses to read as the prompt's."""
    wire, _, ex = _dynamo()
    assert not wire.capabilities().prompt_logprobs
    data = json.loads(ex["prompt_logprobs"]["body"])
    assert len(data["nvext"]["engine_data"]["prompt_logprobs"]) < len(PROMPT)
    with pytest.raises(rb.InvalidRequest, match="prompt logprobs"):
        wire.generate(GenerateRequest(input_ids=PROMPT, prompt_logprobs_start=0), None)


def _dynamo_engine_checks() -> dict[str, tuple[str | None, Any, bool]]:
    """``{exchange: (the call it needs answered, the command it answers, whether it succeeds)}``."""
    from rollout_backends.kit import (
        AbortRequest,
        Pause,
        ReleaseMemory,
        Resume,
        ResumeMemory,
        UpdateFromDisk,
        UpdateFromDistributed,
    )

    disk = UpdateFromDisk(path="/m", version=None, load_format=None, flush_cache=False)
    bucket = rb.WeightBucket((rb.TensorSpec("a", "bfloat16", (2,)),))
    session = UpdateFromDistributed(bucket=bucket, group_name="g", version=None, flush_cache=False)
    return {
        "abort_one": (None, AbortRequest(request_id="long"), True),
        "pause_abort": (None, Pause(rb.PauseMode.ABORT), True),
        "flush_abort": (None, FlushCache(), True),
        "resume_abort": (None, Resume(), True),
        "pause_retract": (None, Pause(rb.PauseMode.RETRACT), True),
        "flush_retract": (None, FlushCache(), True),
        "disk_while_paused": (None, disk, True),
        "start_session_unconfigured": (None, session, False),  # no --weight-transfer-config
        "resume_retract": (None, Resume(), True),
        "disk_unpaused": (None, disk, False),  # dynamo.vllm refuses a load unless paused
        "sleep": (None, ReleaseMemory(tags=None), True),
        "wake_up": (None, ResumeMemory(tags=None), True),
        "disk_missing": ("pause_for_missing", disk, False),
    }


@pytest.mark.parametrize("name", [*_dynamo_engine_checks(), "aborted_one", "in_flight_abort"])
def test_the_dynamo_adapter_reads_dynamo_vllm_engine_routes(name: str) -> None:
    """The worker's engine routes' answers (and the generations they abort), as the ``vllm`` flavor
    reads them. An exchange the capture's client never got answered (or whose abort it never got
    answered) tells nothing: skipped, naming the client's error."""
    wire, response, ex = _dynamo()
    needs = ABORTED_BY.get(name) or _dynamo_engine_checks().get(name, (None,))[0]
    missing = unanswered(DYNAMO_DOC or {"exchanges": []})
    for n in (name, needs):
        if n in missing:
            pytest.skip(f"the capture's client got no answer to {n} ({missing[n]}): re-capture (docs/vllm.md)")
    if name in ABORTED_BY:
        request = GenerateRequest(
            input_ids=ex[name]["request"]["prompt"], sampling=SamplingParams(max_new_tokens=1500, ignore_eos=True)
        )
        gen = wire.parse_generation(request, response[name], 0.0)
        assert gen.aborted and 0 < len(gen.output_ids) < 1500, f"{name}: {len(gen.output_ids)} tokens, not aborted"
        return
    _, op, ok = _dynamo_engine_checks()[name]
    worker = Worker(id="h:2", control_url="http://h:2")
    if ok:
        wire.parse_control(op, worker, response[name])
    else:
        with pytest.raises(rb.ControlFailed):
            wire.parse_control(op, worker, response[name])


def test_the_recorder_reaches_whole_urls_on_a_fresh_connection() -> None:
    """The capture's client: a whole URL (a Dynamo worker's system port) is called as given, not
    under the frontend's; each call opens its own connection, so one the server closed after an
    HTTP 500 cannot swallow the next call (both lost every engine route of the first H100 capture)."""
    from aiohttp import web

    from tests.aiohttp_app import serving

    peers: list[tuple[str, object]] = []

    async def answer(request: web.Request) -> web.Response:
        peers.append((request.path, request.transport.get_extra_info("peername") if request.transport else None))
        return web.json_response({"status": "ok"}, status=500 if request.path == "/fail" else 200)

    async def play() -> dict[str, Any]:
        apps = []
        for _ in range(2):
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", answer)
            apps.append(app)
        async with serving(apps[0]) as front, serving(apps[1]) as system, aiohttp.ClientSession() as session:
            rec = Recorder(session, front, "test")
            await rec.call("a", "POST", "/fail")
            await rec.call("b", "POST", f"{system}/engine/abort_request", {"request_id": "x"})
            await rec.call("c", "GET", "/health")
            return rec.doc

    doc = asyncio.run(play())
    assert [ex["status"] for ex in doc["exchanges"]] == [500, 200, 200]
    assert [p for p, _ in peers] == ["/fail", "/engine/abort_request", "/health"]
    assert len({peer for _, peer in peers}) == 3, peers
