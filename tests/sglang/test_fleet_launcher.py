"""The launcher itself: command lines (real SGLang's must match the one that works on the H200),
configuration checks, port conflicts, start-up failures, shutdown, and the command-line entry."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_backends import BackendUnavailable, GenerateRequest, InvalidRequest, RoutingKind, SamplingParams
from rollout_backends._supervisor import group_members
from rollout_backends.adapters.sglang import SGLangFleetConfig, launch_sglang_fleet, start_sglang_fleet
from rollout_backends.adapters.sglang._launcher import router_argv, worker_argv, worker_env
from rollout_backends.adapters.sglang.launch import config_from_args, parse_args

# -- command lines (no processes) ---------------------------------------------------------------


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_sglang_worker_command_line_matches_the_gpu_recipe() -> None:
    cfg = SGLangFleetConfig(model_path="/tmp/m/tiny", workers=2, served_model_name="tiny", weight_version="v0")
    argv = worker_argv(cfg, 1, 30001)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    # the H200 recipe of 2026-11-30 (docs/gpu-tier.md, "The GPU machine"; docs/sglang.md)
    for flag, value in {"--model-path": "/tmp/m/tiny", "--served-model-name": "tiny", "--attention-backend": "triton",
                        "--sampling-backend": "pytorch", "--page-size": "16", "--host": "127.0.0.1",
                        "--port": "30001", "--weight-version": "v0"}.items():  # fmt: skip
        assert _flag(argv, flag) == value
    assert "--disable-cuda-graph" in argv
    assert _flag(argv, "--mem-fraction-static") == "0.4"  # two workers share the one visible GPU
    for absent in ("--disable-radix-cache", "--enable-memory-saver", "--enable-deterministic-inference", "--api-key"):
        assert absent not in argv
    env = worker_env(cfg, 1)
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0" and env["HF_HUB_OFFLINE"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_sglang_worker_options_per_worker_devices_and_passthrough() -> None:
    cfg = SGLangFleetConfig(
        model_path="/m", workers=2, cuda_visible_devices=["0", "1"], disable_radix_cache=True,
        enable_memory_saver=True, deterministic_inference=True, random_seed=0, api_key="K1", admin_api_key="K2",
        extra_server_args=["--context-length", "2048"], health_endpoint_generation=True, env={"X": "1"},
    )  # fmt: skip
    argv = worker_argv(cfg, 0, 1234)
    assert "--mem-fraction-static" not in argv  # alone on its GPU: SGLang's default
    for flag in ("--disable-radix-cache", "--enable-memory-saver", "--enable-deterministic-inference"):
        assert flag in argv
    assert _flag(argv, "--api-key") == "K1" and _flag(argv, "--admin-api-key") == "K2"
    assert argv[-2:] == ["--context-length", "2048"]
    assert [worker_env(cfg, i)["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == ["0", "1"]
    assert worker_env(cfg, 0)["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "1" and worker_env(cfg, 0)["X"] == "1"
    assert "K1" not in repr(cfg) and "K2" not in repr(cfg)
    shared = SGLangFleetConfig(model_path="/m", workers=3, cuda_visible_devices=["0", "0", "1"])
    assert [shared.worker_mem_fraction(i) for i in range(3)] == [0.4, 0.4, None]


def test_reference_worker_command_line() -> None:
    cfg = SGLangFleetConfig(model_path="/m", worker_kind="reference", weight_version="w", disable_radix_cache=True)
    argv = worker_argv(cfg, 0, 4000)
    assert argv[1:3] == ["-m", "rollout_backends.adapters.reference.serve"]
    assert _flag(argv, "--port") == "4000" and _flag(argv, "--weight-version") == "w"
    assert "--disable-radix-cache" not in argv and "--attention-backend" not in argv  # SGLang-only flags


def test_router_command_lines() -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    smg = SGLangFleetConfig(model_path="/m", workers=2, router_policy="round_robin", router_retries=False,
                            health_check_interval_s=3)  # fmt: skip
    argv = router_argv(smg, 9000, 9001, urls)
    assert argv[1:3] == ["-m", "smg.launch_router"] and _flag(argv, "--policy") == "round_robin"
    assert _flag(argv, "--prometheus-host") == "127.0.0.1" and _flag(argv, "--prometheus-port") == "9001"
    assert _flag(argv, "--health-check-interval-secs") == "3" and "--disable-retries" in argv
    assert "--worker-urls" not in argv and smg.registration == "api"  # POST /workers after start
    p2 = SGLangFleetConfig(model_path="/m", workers=2, router_policy="power_of_two")
    assert p2.registration == "cli" and _flag(router_argv(p2, 9000, 9001, urls), "--worker-urls") == urls[0]
    sgr = SGLangFleetConfig(model_path="/m", workers=2, router="sglang-router")
    argv = router_argv(sgr, 9000, 9001, urls)
    assert argv[1:3] == ["-m", "sglang_router.launch_router"] and argv[argv.index("--worker-urls") + 1 :][:2] == urls
    assert SGLangFleetConfig(model_path="/m", router="none").routing_kind is RoutingKind.SINGLE
    assert SGLangFleetConfig(model_path="/m", router_policy="prefix_hash").routing_kind is RoutingKind.OTHER


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"workers": 0}, "workers"),
        ({"worker_kind": "vllm"}, "worker_kind"),
        ({"router": "nginx"}, "router"),
        ({"router": "sglang-router", "router_policy": "prefix_hash"}, "router_policy"),
        ({"workers": 2, "worker_ports": [1]}, "worker_ports"),
        ({"worker_ports": [5], "worker_base_port": 5}, "worker_ports"),
        ({"worker_ports": [5], "router_port": 5}, "worker_ports"),
        ({"workers": 2, "cuda_visible_devices": ["0"]}, "cuda_visible_devices"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
        ({"health_check_interval_s": 0}, "health_check_interval_s"),
        ({"router_registration": "magic"}, "router_registration"),
        ({"router": "sglang-router", "router_registration": "api"}, "router_registration"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        SGLangFleetConfig(model_path="/m", **kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_cli_arguments_build_the_config() -> None:
    args = parse_args(["--model-path", "/m", "--workers", "2", "--router", "smg", "--policy", "round_robin",
                       "--cuda-visible-devices", "0", "1", "--disable-retries", "--router-arg=--worker-warmup-secs",
                       "--router-arg=0", "--", "--context-length", "1024"])  # fmt: skip
    cfg = config_from_args(args)
    assert (cfg.workers, cfg.router, cfg.router_policy, cfg.router_retries) == (2, "smg", "round_robin", False)
    assert cfg.cuda_visible_devices == ("0", "1") and cfg.extra_server_args == ("--context-length", "1024")
    assert cfg.extra_router_args == ("--worker-warmup-secs", "0") and cfg.disable_cuda_graph


# -- real processes -----------------------------------------------------------------------------


def _pids_with(needle: str) -> list[int]:
    """Live pids whose command line contains ``needle`` (the process table)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().decode(errors="replace").rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state not in ("Z", "X"):
            out.append(int(entry))
    return out


@pytest.mark.slow
async def test_port_conflict_fails_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        cfg = SGLangFleetConfig(model_path=str(tmp_path), worker_kind="reference", workers=2, router="smg",
                                router_port=busy, log_dir=str(tmp_path / "logs"))  # fmt: skip
        fleet = launch_sglang_fleet(cfg)
        with pytest.raises(BackendUnavailable, match=f"{busy}.*already in use"):
            async with fleet:
                pass
        assert fleet.supervisor.names == () and not list((tmp_path / "logs").iterdir())


@pytest.mark.slow
async def test_startup_failure_names_the_worker_with_its_log_and_cleans_up(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()  # a directory (else refused before anything starts), with no model in it
    cfg = SGLangFleetConfig(model_path=str(tmp_path / "model"), worker_kind="reference", workers=2, router="smg",
                            extra_server_args=["--no-such-flag"], log_dir=str(tmp_path / "logs"),
                            startup_timeout_s=60)  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable) as err:
        await start_sglang_fleet(cfg)
    msg = str(err.value)
    assert "exited with code 2 during start-up" in msg and "worker-" in msg
    assert "unrecognized arguments: --no-such-flag" in msg  # the log tail names the cause
    assert time.monotonic() - t0 < 20  # failed fast, not at the timeout
    assert _pids_with(str(tmp_path)) == []


@pytest.mark.slow
async def test_closing_the_backend_stops_every_process(model_a: Path, tmp_path: Path) -> None:
    cfg = SGLangFleetConfig(model_path=str(model_a), worker_kind="reference", workers=1, router="smg",
                            router_policy="round_robin", health_check_interval_s=1,
                            log_dir=str(tmp_path / "logs"))  # fmt: skip
    fleet = await start_sglang_fleet(cfg)
    groups = {n: fleet.supervisor.process(n).pgid for n in fleet.supervisor.names}
    pids = [p for members in fleet.pids().values() for p in members]
    try:
        two = SamplingParams(max_new_tokens=2)
        gen = await fleet.backend.generate(GenerateRequest(input_ids=(1, 2, 3), sampling=two))
        assert len(gen.output_ids) == 2
        assert set(groups) == {"worker-0", "router"} and all(group_members(g) for g in groups.values())
        assert all(Path(f"/proc/{p}").exists() for p in pids) and _pids_with(str(model_a))
        watchdog = fleet.supervisor._watchdog
        assert watchdog is not None
    finally:
        t0 = time.monotonic()
        await fleet.backend.aclose()  # closing the backend stops the fleet
        took = time.monotonic() - t0
    assert all(group_members(g) == [] for g in groups.values())
    assert all(not Path(f"/proc/{p}").exists() for p in pids)
    assert _pids_with(str(model_a)) == [] and _pids_with(str(tmp_path)) == []
    assert not Path(f"/proc/{watchdog.pid}").exists()  # the orphan watchdog is gone too
    assert took < cfg.router_grace_s + 3, f"shutdown took {took:.1f}s"  # smg exits on SIGTERM, no SIGKILL wait
    await fleet.aclose()  # idempotent


@pytest.mark.slow
def test_command_line_entry_prints_urls_and_stops_on_ctrl_c(model_a: Path, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "rollout_backends.adapters.sglang.launch", "--model-path", str(model_a),
            "--worker-kind", "reference", "--router", "none", "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.startswith("ready"):
                break
        assert lines and lines[-1].startswith("ready"), lines
        worker = next(x for x in lines if x.startswith("worker:")).split()[1]
        assert lines[0].startswith("fleet:   1 x reference worker") and "no router" in lines[0]
        assert worker.startswith("http://127.0.0.1:") and lines[1] == "router:  (none)"
        port = worker.rsplit(":", 1)[1]
        assert _pids_with(f"--port {port}")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert _pids_with(f"--port {port}") == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
