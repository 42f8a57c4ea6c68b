"""The ``rollout-backends`` command: help on every level (with defaults, never a key), the launchers'
``connect:`` URLs opening what they launched, true log paths, and run folders removed on exit."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import rollout_backends as rb
from rollout_backends._cli import _DELEGATES, _build_parser, main
from rollout_backends.adapters.dynamo import launch as dynamo_launch
from rollout_backends.adapters.reference import make_model, serve
from rollout_backends.adapters.sglang import launch as sglang_launch
from rollout_backends.integrations.miles import facade

PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "launch sglang": sglang_launch.build_parser,
    "launch dynamo": dynamo_launch.build_parser,
    "serve-reference": serve.build_parser,
    "make-model": make_model.build_parser,
    "facade": facade.build_parser,
}


def _demo_parser() -> argparse.ArgumentParser:
    root = _build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["demo"]


def _help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


# -- help -----------------------------------------------------------------------------------------


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help_of([], capsys)
    for command in ("demo", "launch", "serve-reference", "make-model", "facade"):
        assert command in out


@pytest.mark.parametrize("argv", [["launch"], ["launch", "--help"]])
def test_launch_alone_and_its_help_list_the_engines(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    if argv[-1] == "--help":
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
    else:
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rollout-backends launch")
    assert "sglang" in out and "dynamo" in out


@pytest.mark.parametrize("command", [*PARSERS, "demo"])
def test_sub_command_help_names_the_command_not_a_module(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _help_of(command.split(), capsys)
    assert out.startswith(f"usage: rollout-backends {command}"), out[:200]
    assert "python -m rollout_backends" not in out


@pytest.mark.parametrize("command", [*PARSERS, "demo"])
def test_every_flag_has_help_and_says_its_default(command: str) -> None:
    parser = PARSERS[command]() if command in PARSERS else _demo_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"{command}: {name} has no help"
        if action.required or not action.option_strings:
            continue  # nothing to default
        text = formatter._get_help_string(action) or ""
        assert "default" in text, f"{command}: {name} does not say its default: {text!r}"


def test_launcher_command_lines_are_delegated() -> None:
    assert {k for k in _DELEGATES if k.startswith("launch ")} == {"launch sglang", "launch dynamo", "launch vllm"}


def test_the_library_cli_keeps_only_its_own_commands() -> None:
    # Benchmarks and the GPU tier live in the checkout's bench/, not in the installed package.
    assert {k.split()[0] for k in _DELEGATES} == {"launch", "serve-reference", "make-model", "facade"}
    assert all(not target.startswith(("rb_bench", "rollout_backends._bench")) for target in _DELEGATES.values())


@pytest.mark.parametrize(
    ("argv", "module"), [(["bench", "fanout", "--smoke"], "rb_bench.<"), (["gpu-tier"], "rb_bench.gpu_tier")]
)
def test_moved_commands_say_where_they_went(argv: list[str], module: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"'rollout-backends {argv[0]}' is not part of the installed library" in err
    assert f"PYTHONPATH=bench python -m {module}" in err and "bench/README.md" in err


def test_help_never_shows_a_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_API_KEY", "sekrit-sglang")
    monkeypatch.setenv("RB_FACADE_API_KEY", "sekrit-facade")
    monkeypatch.setenv("RB_FACADE_ADMIN_API_KEY", "sekrit-admin")
    for build in (serve.build_parser, facade.build_parser):
        text = build().format_help()
        assert "sekrit" not in text
        assert "API_KEY" in text  # the help says where the key comes from instead


@pytest.mark.parametrize("build", [sglang_launch.parse_args, dynamo_launch.parse_args])
def test_worker_kind_defaults_to_one_that_runs_on_a_cpu(build: Callable[[list[str]], argparse.Namespace]) -> None:
    assert build(["--model-path", "/m"]).worker_kind == "reference"


# -- launchers: the printed URL opens the fleet, logs are where they say, run folders go --------------


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from rollout_backends.adapters.reference import cached_tiny_model

    return Path(cached_tiny_model(0))


class _Launcher:
    """One ``rollout-backends launch ...`` process, its printed lines by label."""

    def __init__(self, argv: list[str], tmpdir: Path) -> None:
        env = {**os.environ, "TMPDIR": str(tmpdir)}  # its temporary folders land where the test looks
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_backends._cli", "launch", *argv],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env,
        )  # fmt: skip
        self.lines: dict[str, str] = {}

    def wait_ready(self, timeout: float = 120.0) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("ready"):
                return
            label, _, value = line.partition(":")
            self.lines.setdefault(label.strip(), value.strip())
        err = self.proc.stderr.read() if self.proc.stderr is not None and self.proc.poll() is not None else ""
        raise AssertionError(f"not ready; printed {self.lines}; stderr: {err[-2000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Callable[[list[str]], _Launcher]]:
    started: list[_Launcher] = []

    def start(argv: list[str]) -> _Launcher:
        started.append(_Launcher(argv, tmp_path))
        return started[-1]

    yield start
    for one in started:
        one.stop()


def _query(url: str) -> dict[str, str]:
    from urllib.parse import parse_qsl, urlsplit

    return dict(parse_qsl(urlsplit(url).query))


@pytest.mark.slow
async def test_sglang_launcher_url_opens_the_fleet_and_its_run_folder_goes(
    tiny_model: Path, tmp_path: Path, launcher: Callable[[list[str]], _Launcher]
) -> None:
    run = launcher(["sglang", "--model-path", str(tiny_model), "--workers", "2", "--router", "none"])
    run.wait_ready()
    url, logs = run.lines["connect"], Path(run.lines["logs"])
    assert logs.is_dir() and logs.parent == tmp_path and (logs / "worker-0.log").is_file()
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    assert _query(url) == {"workers": _query(url)["workers"], "routing": "other", "vocab_size": str(vocab)}
    backend = await rb.open_backend(url)
    async with backend:  # type: ignore[attr-defined]
        assert len(backend.workers) == 2 and ",".join(backend.workers) == _query(url)["workers"]
        assert backend.capabilities.vocab_size == vocab
        with pytest.raises(rb.InvalidRequest):  # checked here, from the vocabulary the URL gave
            await backend.generate(rb.GenerateRequest(input_ids=[vocab + 5]))
        gen = await backend.generate(
            rb.GenerateRequest(input_ids=[1, 2, 3], sampling=rb.SamplingParams(temperature=0, max_new_tokens=3))
        )
        assert len(gen.output_ids) == 3
    assert run.stop() == 0
    assert not logs.exists(), "the temporary log folder outlived the launcher"


@pytest.mark.slow
def test_sglang_launcher_keeps_the_run_folder_when_asked(
    tiny_model: Path, launcher: Callable[[list[str]], _Launcher]
) -> None:
    run = launcher(["sglang", "--model-path", str(tiny_model), "--router", "none", "--keep-run-dir"])
    run.wait_ready()
    logs = Path(run.lines["logs"])
    assert run.stop() == 0
    assert (logs / "worker-0.log").is_file()


def _has_dynamo() -> bool:
    try:
        import dynamo.llm  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _has_dynamo(), reason="ai-dynamo is not installed")
async def test_dynamo_launcher_url_log_dir_and_run_folder(
    tiny_model: Path, tmp_path: Path, launcher: Callable[[list[str]], _Launcher]
) -> None:
    log_dir = tmp_path / "my-logs"
    run = launcher(["dynamo", "--model-path", str(tiny_model), "--workers", "2", "--worker-kind", "mocker",
                    "--router-mode", "kv", "--log-dir", str(log_dir)])  # fmt: skip
    run.wait_ready()
    assert Path(run.lines["logs"]) == log_dir and (log_dir / "frontend.log").is_file()
    namespace = run.lines["frontend"].split("namespace ", 1)[1].rstrip(")")
    assert list(tmp_path.glob(f"dynamo-{namespace}-*")), "no run folder where TMPDIR points"
    url = run.lines["connect"]
    query = _query(url)
    assert query["flavor"] == "mocker" and query["router_mode"] == "kv"
    assert query["model_path"] == str(tiny_model) and query["namespace"] == namespace
    assert len(query["rpc_ports"].split(",")) == 2
    backend = await rb.open_backend(url)
    async with backend:  # type: ignore[attr-defined]
        assert len(backend.workers) == 2
        # The rpc ports in the URL map each worker to its instance, so pinning reaches it.
        for worker in backend.workers:
            gen = await backend.generate(
                rb.GenerateRequest(input_ids=[1, 2, 3], worker=worker, sampling=rb.SamplingParams(max_new_tokens=2))
            )
            assert gen.worker == worker
    assert run.stop() == 0
    assert not list(tmp_path.glob(f"dynamo-{namespace}-*")), "the run folder outlived the launcher"
    assert (log_dir / "frontend.log").is_file(), "--log-dir logs must stay"


def test_bad_connect_url_keys_are_typed_errors() -> None:
    import asyncio

    with pytest.raises(rb.InvalidRequest) as exc_info:
        asyncio.run(rb.open_backend("sglang://127.0.0.1:1?vocab_size=lots"))
    assert exc_info.value.field == "url.vocab_size"
    with pytest.raises(rb.InvalidRequest) as exc_info:
        asyncio.run(rb.open_backend("dynamo://127.0.0.1:1?workers=a:1,b:2&rpc_ports=5"))
    assert exc_info.value.field == "url.rpc_ports"
    # A typo'd key is refused naming it, on every scheme, never ignored (nothing is contacted).
    for url in ("sglang://127.0.0.1:1?worker=2", "sglang://127.0.0.1:1?vocab=5", "dynamo://127.0.0.1:1?router=kv",
                "reference://?worker=2"):  # fmt: skip
        with pytest.raises(rb.InvalidRequest) as exc_info:
            asyncio.run(rb.open_backend(url))
        assert exc_info.value.field == "url." + url.split("?")[1].split("=")[0], url
