"""`rollout-backends launch dynamo` brings a fleet up, prints a URL that opens it, and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rollout_backends as rb
from tests.dynamo.conftest import _children, _has_dynamo

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _has_dynamo(), reason="ai-dynamo is not installed"),
]


async def test_launch_cli_serves_and_stops(tiny_model: Path) -> None:
    before = _children()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_backends._cli", "launch", "dynamo", "--model-path", str(tiny_model),
         "--workers", "2", "--worker-kind", "reference", "--router-mode", "round-robin"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    url = None
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("connect:"):
                url = line.split(None, 1)[1].strip()
            if line.startswith("ready"):
                break
        assert url is not None and url.startswith("dynamo://"), "no connect line printed"
        backend = await rb.open_backend(url)
        async with backend:
            assert len(backend.workers) == 2
            gen = await backend.generate(
                rb.GenerateRequest(input_ids=[1, 2, 3], sampling=rb.SamplingParams(temperature=0, max_new_tokens=4))
            )
            assert len(gen.output_ids) == 4 and gen.logprobs is not None and len(gen.logprobs) == 4
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    # Every process the launcher started is gone.
    deadline = time.monotonic() + 10
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not (_children() - before)
