"""The ``rollout-backends`` command: help on every level (with defaults, never a key), the launchers'
``connect:`` URLs opening what they launched, true log paths, and run folders removed on exit."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import rollout_backends as rb
from rollout_backends._cli import _DELEGATES, _build_parser, main
from rollout_backends.adapters.dynamo import DynamoFleetConfig
from rollout_backends.adapters.dynamo import launch as dynamo_launch
from rollout_backends.adapters.reference import make_model, serve
from rollout_backends.adapters.sglang import SGLangFleetConfig
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


@pytest.mark.parametrize(
    ("launcher", "config"),
    [(sglang_launch, SGLangFleetConfig), (dynamo_launch, DynamoFleetConfig)],
    ids=["sglang", "dynamo"],
)
def test_the_command_line_defaults_are_the_python_ones(launcher: Any, config: Any) -> None:
    # One set of defaults: every flag left out gives the config's own default, field for field.
    from_cli = launcher.config_from_args(launcher.parse_args(["--model-path", "/m"]))
    assert from_cli == config(model_path="/m")
    # ... and the engine named by the launcher is the one it runs (the CPU kinds are asked for).
    assert from_cli.worker_kind == "sglang"


def test_the_router_defaults_are_the_routers_own() -> None:
    assert SGLangFleetConfig(model_path="/m").router_policy == "cache_aware"  # smg 1.13.0 --help
    assert DynamoFleetConfig(model_path="/m").router_mode == "round-robin"  # ai-dynamo 1.4.2 frontend


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (SGLangFleetConfig(model_path="/m", workers=2, worker_kind="reference"), ["2 x reference", "not SGLang"]),
        (
            SGLangFleetConfig(model_path="/m", router="none"),
            ["1 x sglang", "python -m sglang.launch_server", "no router"],
        ),
        (DynamoFleetConfig(model_path="/m", worker_kind="mocker", router_mode="kv"), ["mocker", "router mode kv"]),
        (DynamoFleetConfig(model_path="/m"), ["1 x sglang", "dynamo.sglang", "router mode round-robin"]),
    ],
)
def test_the_start_line_names_the_worker_kind_and_the_router(config: Any, says: list[str]) -> None:
    line = config.describe()
    assert all(s in line for s in says), line


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"rollout-backends {rb.__version__}"


#: What help must not show: reStructuredText markup, Markdown code spans, private module names.
_MARKUP = re.compile(r"``|`|:(class|func|meth|mod|attr):|\b_[a-z][a-z0-9_]*\b\.py|\._[a-z]")


@pytest.mark.parametrize("command", ["", "launch", *PARSERS, "demo"])
def test_help_is_plain_text_without_private_names(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    if command == "launch":
        assert main(["launch"]) == 0
        out = capsys.readouterr().out
    else:
        out = _help_of(command.split(), capsys)
    found = [m.group(0) for m in _MARKUP.finditer(out)]
    assert not found, f"{command or 'rollout-backends'} --help shows {found}"


# -- errors: one line, no traceback -------------------------------------------------------------------


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert "Traceback" not in err[0]
    return err[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["launch", "sglang", "--worker-kind", "reference"],
        ["launch", "dynamo", "--worker-kind", "mocker"],
        ["serve-reference", "--port", "0"],
    ],
    ids=["launch-sglang", "launch-dynamo", "serve-reference"],
)
@pytest.mark.parametrize("model", ["missing-dir", "a-file", "Qwen/Qwen2.5-0.5B"])
def test_a_model_that_is_not_a_directory_is_one_line_before_anything_starts(
    argv: list[str], model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # relative names resolve here, where nothing is
    if model == "a-file":
        (tmp_path / model).write_text("{}")
    assert main([*argv, "--model-path", model]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("error: --model-path: ") and repr(model) in line, line
    if "/" in model:  # a Hugging Face name: refused offline, saying nothing is downloaded
        assert "Hugging Face" in line and "nothing is downloaded" in line
    # Refused before anything started: the launchers never got to say what they start.
    assert "fleet:" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["serve-reference", "--model-path", "unused", "--no-compute", "2"],
        ["facade", "--backend", "reference://?workers=1", "--wait-ready", "0"],
        ["launch", "sglang", "--worker-kind", "reference", "--router", "none", "--worker-ports"],
    ],
    ids=["serve-reference", "facade", "launch-sglang"],
)
def test_a_busy_port_is_one_line(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        extra = [port] if argv[-1] == "--worker-ports" else ["--port", port]
        model = [] if argv[0] != "launch" else ["--model-path", str(tmp_path)]
        assert main([*argv, *extra, *model]) == 1
    line = _one_error_line(capsys)
    assert "already in use" in line and port in line, line


def test_an_engine_that_is_not_installed_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    assert main(["launch", "sglang", "--model-path", str(tmp_path)]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("error: --worker-kind: ") and "cannot import sglang" in line, line
    assert "'sglang' workers run SGLang" in line and "'reference' runs the CPU reference engine" in line, line


@pytest.mark.slow
def test_a_failed_start_is_one_line_naming_a_log_that_stays(tmp_path: Path) -> None:
    # A worker that exits at start-up (an argument it refuses): the error is one line naming its log,
    # with the log's last line, and the log is still there after the launcher exited.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    argv = ["launch", "sglang", "--model-path", str(tmp_path), "--worker-kind", "reference", "--router", "none"]
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_backends._cli", *argv, "--", "--no-such-flag"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith("fleet:   1 x reference worker"), proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith(("error", "Traceback", "  "))]
    assert len(errors) == 1 and "exited with code" in errors[0], proc.stderr
    log = Path(re.search(r"log: (\S+)", errors[0])[1])  # type: ignore[index]
    assert log.is_file() and "--no-such-flag" in log.read_text()
    assert "--no-such-flag" in errors[0]  # the log's last line: what the worker died of
    assert f"kept:    {log.parent}" in proc.stderr


async def test_a_failed_dynamo_start_keeps_the_log_its_error_names(tmp_path: Path) -> None:
    from rollout_backends.adapters.dynamo import launch_dynamo_fleet

    # An interpreter that exits at once: every process fails at start-up, with nothing imported.
    cfg = DynamoFleetConfig(model_path=str(tmp_path), worker_kind="reference", python="/bin/false")
    with pytest.raises(rb.BackendUnavailable) as exc_info:
        async with launch_dynamo_fleet(cfg):
            pass
    log = Path(re.search(r"last lines of (\S+?):?\n", str(exc_info.value))[1])  # type: ignore[index]
    assert log.is_file(), f"the log the error names is gone: {log}"
    assert not (log.parent.parent / "kv").exists()  # what is not a log still goes


# -- demo ---------------------------------------------------------------------------------------------


_DEMO = ["demo", "--samples", "1", "--max-new-tokens", "2", "--backend", "reference://?workers=1&seed=0"]


def test_demo_on_a_backend_url_says_why_it_skips_the_weight_update(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_DEMO) == 0
    out, err = capsys.readouterr()
    assert "weight update: SKIPPED: --backend needs --weights DIR" in err
    assert "without the weight update" in out and "weight update transaction" not in out


def test_demo_on_a_backend_url_updates_from_weights_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rollout_backends.adapters.reference import make_tiny_model

    weights = make_tiny_model(tmp_path / "step-1", seed=1)
    assert main([*_DEMO, "--weights", str(weights)]) == 0
    out, err = capsys.readouterr()
    assert "SKIPPED" not in err and f"weight update transaction -> 'step-1' from {weights}" in out
    assert "fleet version now: step-1" in out


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
    run = launcher(
        ["sglang", "--model-path", str(tiny_model), "--worker-kind", "reference", "--workers", "2", "--router", "none"]
    )
    run.wait_ready()
    assert "2 x reference workers" in run.lines["fleet"]  # said first, before the wait
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
    run = launcher(
        ["sglang", "--model-path", str(tiny_model), "--worker-kind", "reference", "--router", "none", "--keep-run-dir"]
    )
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
