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


def test_without_a_tokenizer_it_refuses_to_start_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    # The backend URL would fail to open: the refusal comes first, before anything starts.
    assert cli.main(["--backend", "testbackend://nowhere", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: InvalidRequest: --tokenizer: "), err
    assert "--token-only" in err


def test_the_tokenizer_defaults_to_the_model_path_and_token_only_starts_without(model_dir: Any) -> None:
    parse = cli.build_parser().parse_args
    assert cli.tokenizer_name(parse(["--backend", "x://", "--model-path", str(model_dir)])) == str(model_dir)
    assert cli.tokenizer_name(parse(["--backend", "x://", "--tokenizer", "t", "--model-path", "m"])) == "t"
    assert cli.tokenizer_name(parse(["--backend", "x://", "--token-only"])) is None


def test_parser_flags_are_checked_against_sglangs_names(model_dir: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("partial_json_parser", reason="SGLang's parsers are not installed (extra sglang-parsers)")
    argv = ["--backend", f"reference://{model_dir}", "--port", "0", "--model-path", str(model_dir), "--wait-ready", "0"]
    assert cli.main([*argv, "--tool-call-parser", "qwen2.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: InvalidRequest: --tool-call-parser: unknown parser 'qwen2.5'") and "qwen25" in err
    assert cli.main([*argv, "--reasoning-parser", "r1"]) == 2
    assert capsys.readouterr().err.startswith("error: InvalidRequest: --reasoning-parser: unknown parser 'r1'")
    assert cli.main([*argv, "--token-only", "--model-path", "", "--tool-call-parser", "qwen25"]) == 2
    assert "--tool-call-parser: parses the generated text: needs a tokenizer" in capsys.readouterr().err
