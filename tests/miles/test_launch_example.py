"""``examples/miles/launch_dynamo_fleet.py`` end to end on the reference backend (a real subprocess)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "miles" / "launch_dynamo_fleet.py"


def test_launch_script_serves_the_facade_and_prints_miles_flags(model_dir: Any) -> None:
    url = f"reference://{model_dir}?workers=2"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--rollout-backend-url", url, "--tokenizer", str(model_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if line.startswith("--custom-generate-function-path"):
                break
        text = "\n".join(lines)
        m = re.search(r"--sglang-router-ip (\S+) --sglang-router-port (\d+)", text)
        assert m, text
        assert (
            f"--custom-generate-function-path rollout_backends.integrations.miles.generate --rollout-backend-url {url}"
            in text
        )
        base = f"http://{m.group(1)}:{m.group(2)}"
        workers = httpx.get(f"{base}/workers", timeout=30).json()["workers"]
        assert [w["url"] for w in workers] == [f"{base}/w/ref-0", f"{base}/w/ref-1"]
        payload = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
        body = httpx.post(f"{base}/generate", json=payload, timeout=60).json()
        assert len(body["meta_info"]["output_token_logprobs"]) == 3 and isinstance(body["text"], str)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, "\n".join(lines)


def test_k8s_example_manifest_is_a_valid_job_for_the_1648_workload() -> None:
    import yaml

    path = SCRIPT.parent / "k8s-job.yaml"
    assert path.read_text().startswith("# EXAMPLE ONLY")
    job = yaml.safe_load(path.read_text())
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    script = container["args"][0]
    for needle in (
        "for i in 0 1",  # 2 engines
        "--tp 2",
        "--stream-interval 50",
        "--rollout-num-gpus-per-engine 2",
        "--actor-num-gpus-per-node 4",
        "--custom-generate-function-path rollout_backends.integrations.miles.generate",
        "--sglang-router-port 30000",
    ):
        assert needle in script, needle
    assert "--colocate" not in script
