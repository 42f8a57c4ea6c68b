"""The admin surface: launchers bind 127.0.0.1 unless told otherwise; API key and admin key end to end
(launch flag, client header, refusal without the key); keys never shown.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rollout_backends import ControlFailed, GenerateRequest, InvalidRequest, SamplingParams
from rollout_backends._http import HttpClient
from rollout_backends._supervisor import ProcessSpec, ReadyCheck, Supervisor, free_port, redact_argv
from rollout_backends.adapters.dynamo._launcher import (
    DynamoFleet,
    _common_env,
    _WorkerPorts,
    frontend_argv,
    worker_argv,
)
from rollout_backends.adapters.sglang import SGLangFleetConfig
from rollout_backends.adapters.sglang._launcher import router_argv
from rollout_backends.adapters.sglang._launcher import worker_argv as sglang_worker_argv
from rollout_backends.kit import HttpFleetBackend

from .conftest import is_loopback, listening_addresses

API_KEY = "sk-data-3Jd9Qm"
ADMIN_KEY = "sk-admin-8Vn2Lr"


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("kind", ["reference", "sglang"])
def test_sglang_launcher_binds_loopback_by_default(kind: str) -> None:
    cfg = SGLangFleetConfig(model_path="/m", workers=2, worker_kind=kind, api_key=API_KEY, admin_api_key=ADMIN_KEY)
    w = sglang_worker_argv(cfg, 0, 30000)
    r = router_argv(cfg, 30010, 30011, ["http://127.0.0.1:30000"])
    assert _flag(w, "--host") == "127.0.0.1"
    assert _flag(r, "--host") == "127.0.0.1" and _flag(r, "--prometheus-host") == "127.0.0.1"
    assert _flag(w, "--api-key") == API_KEY and _flag(w, "--admin-api-key") == ADMIN_KEY
    shown = " ".join(redact_argv(w) + redact_argv(r)) + repr(cfg)
    assert API_KEY not in shown and ADMIN_KEY not in shown and "***" in shown
    explicit = SGLangFleetConfig(model_path="/m", worker_kind=kind, host="0.0.0.0")
    assert _flag(sglang_worker_argv(explicit, 0, 30000), "--host") == "0.0.0.0"
    assert _flag(router_argv(explicit, 1, 2, []), "--host") == "0.0.0.0"


@pytest.mark.parametrize("kind", ["reference", "mocker", "sglang"])
def test_dynamo_launcher_binds_loopback_by_default(kind: str) -> None:
    cfg = DynamoFleet(model_path="/m", worker_kind=kind)
    fe = frontend_argv(cfg, "ns", 20000)
    assert _flag(fe, "--http-host") == "127.0.0.1"
    env = _common_env(cfg, "ns", Path("/tmp/kv"))
    assert env["DYN_TCP_RPC_HOST"] == env["DYN_SYSTEM_HOST"] == "127.0.0.1"
    argv = worker_argv(cfg, 0, "ns", _WorkerPorts(system=1, rpc=2, kv_events=3, sglang=4, nccl=5))
    if kind == "sglang":
        assert _flag(argv, "--host") == "127.0.0.1"
    explicit = DynamoFleet(model_path="/m", worker_kind=kind, host="0.0.0.0")
    assert _flag(frontend_argv(explicit, "ns", 20000), "--http-host") == "0.0.0.0"
    assert _common_env(explicit, "ns", Path("/tmp/kv"))["DYN_SYSTEM_HOST"] == "0.0.0.0"


def test_facade_cli_binds_loopback_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    from rollout_backends.integrations.miles import facade
    from rollout_backends.integrations.miles._facade import start_facade

    monkeypatch.delenv("RB_FACADE_API_KEY", raising=False)
    ns = facade.build_parser().parse_args(["--backend", "reference://"])
    assert ns.host == "127.0.0.1" and ns.api_key is None and ns.admin_api_key is None
    assert inspect.signature(start_facade).parameters["host"].default == "127.0.0.1"
    monkeypatch.setenv("RB_FACADE_API_KEY", API_KEY)
    monkeypatch.setenv("RB_FACADE_ADMIN_API_KEY", ADMIN_KEY)
    ns = facade.build_parser().parse_args(["--backend", "reference://", "--host", "0.0.0.0"])
    assert ns.host == "0.0.0.0" and ns.api_key == API_KEY and ns.admin_api_key == ADMIN_KEY


async def _status(s: aiohttp.ClientSession, method: str, url: str, key: str | None, body: Any = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with s.request(method, url, json=body, headers=headers) as r:
        await r.read()
        return r.status


async def test_facade_refuses_control_without_the_admin_key(caplog: pytest.LogCaptureFixture) -> None:
    from rollout_backends.adapters.reference import ReferenceBackend
    from rollout_backends.integrations.miles._facade import MilesFacade, start_facade

    caplog.set_level(logging.DEBUG)
    backend = ReferenceBackend.create(workers=2)
    facade = MilesFacade(backend, api_key=API_KEY, admin_api_key=ADMIN_KEY, token_only=True)
    assert API_KEY not in repr(facade) and ADMIN_KEY not in repr(facade)
    running = await start_facade(facade, worker_ports={backend.workers[0]: 0})
    try:
        assert is_loopback(running.url.split("://")[1])
        base, wurl = running.url, running.worker_urls[backend.workers[0]]
        token = facade.token_of(backend.workers[1])
        gen = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        async with aiohttp.ClientSession() as s:
            for url in (base, f"{base}/w/{token}", wurl):
                for path in ("/pause_generation", "/update_weight_version", "/flush_cache", "/abort_request"):
                    for key in (None, API_KEY, "wrong"):
                        assert await _status(s, "POST", url + path, key, {"new_version": "x"}) == 401, (url, path)
                assert await _status(s, "POST", url + "/generate", None, gen) == 401
                assert await _status(s, "POST", url + "/generate", ADMIN_KEY, gen) == 401  # admin key is not data
                assert await _status(s, "POST", url + "/generate", API_KEY, gen) == 200
                assert await _status(s, "GET", url + "/health", None) == 200
            assert await _status(s, "GET", base + "/workers", None) == 401
            assert await _status(s, "POST", base + "/pause_generation", ADMIN_KEY, {"mode": "retract"}) == 200
            assert (await backend.health()).ready is False
            assert await _status(s, "POST", f"{base}/w/{token}/continue_generation", ADMIN_KEY, {}) == 200
            assert await _status(s, "POST", wurl + "/continue_generation", ADMIN_KEY, {}) == 200
            assert (await backend.health()).ready
            assert await _status(s, "POST", base + "/update_weight_version", ADMIN_KEY, {"new_version": "v9"}) == 200
        assert set((await backend.weight_versions()).values()) == {"v9"}
    finally:
        await running.stop()
        await backend.aclose()
    assert API_KEY not in caplog.text and ADMIN_KEY not in caplog.text


@pytest.mark.slow
async def test_keyed_worker_end_to_end(tiny_model: Path, tmp_path: Path) -> None:
    """A reference worker launched with --api-key and --admin-api-key, driven by our client."""
    from rollout_backends.adapters.sglang import connect

    port = free_port()
    argv = [sys.executable, "-m", "rollout_backends.adapters.reference.serve", "--model-path", str(tiny_model),
            "--port", str(port), "--weight-version", "v0",
            "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    errors: list[str] = []
    async with Supervisor(tmp_path / "logs", grace=5) as sup:
        proc = await sup.start(
            ProcessSpec(
                name="keyed",
                argv=argv,
                ports=[port],
                env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"},
                ready=ReadyCheck.http(f"{url}/health"),
            )
        )
        await sup.wait_ready(timeout=120)
        assert all(is_loopback(a) for a in listening_addresses(sup.group_pids("keyed")))
        sampling = SamplingParams(max_new_tokens=3, temperature=0.0)
        # No key: discovery itself is refused (typed), nothing leaks.
        with pytest.raises(Exception) as e0:
            await connect(url)
        errors.append(str(e0.value))
        # Data key only: generation works, control is refused with a typed error naming the worker.
        data = await connect(url, api_key=API_KEY)
        try:
            g = await data.generate(GenerateRequest(input_ids=[4, 5, 6], sampling=sampling))
            assert len(g.output_ids) == 3 and g.weight_version == "v0"
            with pytest.raises(ControlFailed) as e1:
                await data.set_weight_version("v1")
            assert e1.value.workers == data.workers and "401" in str(e1.value)
            errors.append(str(e1.value))
        finally:
            await data.aclose()
        # Both keys: control works.
        full = await connect(url, api_key=API_KEY, admin_api_key=ADMIN_KEY)
        try:
            async with full.weight_update("v1") as tx:
                await tx.update_from_disk(str(tiny_model))
            assert set((await full.weight_versions()).values()) == {"v1"}
            errors += [repr(full), repr(full.client), repr(full.wire)]
        finally:
            await full.aclose()
        # A wrong data key on generate: typed, and the key is not in the message.
        probe = await connect(url, api_key=API_KEY)
        bad = HttpFleetBackend(probe.wire, [probe.worker(w) for w in probe.workers],
                               client=HttpClient(api_key="sk-WRONG-0000"))  # fmt: skip
        await probe.aclose()
        try:
            with pytest.raises(InvalidRequest) as e2:
                await bad.generate(GenerateRequest(input_ids=[4, 5, 6], sampling=sampling))
            assert e2.value.field == "api_key"
            errors.append(f"{type(e2.value).__name__}: {e2.value}")
        finally:
            await bad.aclose()
        log_text = proc.log_path.read_text(errors="replace")
    for key in (API_KEY, ADMIN_KEY, "sk-WRONG-0000"):
        assert not any(key in e for e in errors), (key, errors)
        assert key not in log_text
    assert "***" in log_text  # the supervisor's start line shows the command, keys redacted
    print("\n" + "\n".join(errors[:4]))
