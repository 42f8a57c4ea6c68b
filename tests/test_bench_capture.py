"""The wire capture (``rb_bench.capture``) runs end to end on a CPU reference worker: every SGLang
exchange is written with its request and the raw answer, streams as SSE, the abort mid-stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rb_bench import capture

pytestmark = pytest.mark.slow


def test_sglang_exchanges_are_recorded_raw(tmp_path: Path) -> None:
    assert capture.main([str(tmp_path), "--worker-kind", "reference", "--only", "sglang", "--budget-s", "90"]) == 0
    vocab = json.loads((tmp_path / "model" / "config.json").read_text())["vocab_size"]
    names = {*capture.sglang_bodies(capture.PROMPT), "sglang-stream-stop", "sglang-stream-abort"}
    records = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in names}
    assert not [n for n, r in records.items() if "error" in r], records
    plain = records["sglang-plain"]
    assert plain["request"]["input_ids"] == [t % vocab for t in capture.PROMPT]  # the prompt fits the model
    assert plain["status"] == 200 and len(json.loads(plain["body"])["output_ids"]) == 12
    stream = records["sglang-stream"]
    assert stream["status"] == 200 and stream["headers"]["Content-Type"].startswith("text/event-stream")
    assert stream["body"].rstrip().endswith("data: [DONE]"), stream["body"][-200:]
    stop = records["sglang-stream-stop"]["request"]["sampling_params"]["stop"]
    assert len(stop) == 1 and stop[0] in json.loads(plain["body"])["text"]
    abort = records["sglang-stream-abort"]
    assert abort["abort"]["status"] == 200 and '"abort"' in abort["body"]  # cut short: finish_reason abort
