"""``python -m rollout_backends.integrations.miles.facade`` (what ``rollout-backends facade`` runs)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import pytest

from rollout_backends.integrations.miles import facade as cli


async def test_cli_serves_until_stopped(model_dir: Any, capsys: pytest.CaptureFixture[str]) -> None:
    ns = cli.build_parser().parse_args(
        ["--backend", f"reference://{model_dir}?workers=2", "--port", "0", "--tokenizer", str(model_dir),
         "--worker-port-base", "0", "--server-info", '{"tp_size": 1}']
    )  # fmt: skip
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.ensure_future(cli.serve(ns, ready=ready, stop=stop))
    await asyncio.wait_for(ready.wait(), 60)
    out = capsys.readouterr().out
    m = re.search(r"--sglang-router-ip (\S+) --sglang-router-port (\d+)", out)
    assert m, out
    base = f"http://{m.group(1)}:{m.group(2)}"
    async with httpx.AsyncClient(timeout=60) as client:
        urls = (await client.get(f"{base}/list_workers")).json()["urls"]
        assert urls == [f"{base}/w/ref-0", f"{base}/w/ref-1"]
        payload = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
        body = (await client.post(f"{base}/generate", json=payload)).json()
        assert body["meta_info"]["completion_tokens"] == 2 and body["meta_info"]["weight_version"] == "default"
        worker_urls = re.findall(r"facade: worker (\S+) at (\S+)", out)
        assert [w for w, _ in worker_urls] == ["ref-0", "ref-1"]
        info = (await client.get(f"{worker_urls[1][1]}/get_server_info")).json()
        assert info["tp_size"] == 1 and info["rollout_backends"]["workers"] == ["ref-1"]
    stop.set()
    lines = await asyncio.wait_for(task, 30)
    assert lines[-1] == f"miles flags: --sglang-router-ip {m.group(1)} --sglang-router-port {m.group(2)}"
