"""Spike: the real Dynamo 1.4.2 frontend routes /v1/completions to our Python worker.

Starts ``python -m dynamo.frontend`` (file discovery, TCP request plane, ZMQ events) and two
``rollout_backends.adapters.dynamo._worker`` processes around ``fake_engine.FakeEngine``; checks
token ids and per-token logprobs round-trip exactly, engine routes, weight-version stamping,
pinning, and abort on client disconnect. Every process is started in its own process group and
killed at teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("dynamo.llm")
# The worker runs under this interpreter, so it must import this checkout's adapter
# (run as `.venv/bin/python -m pytest`; a venv's `pytest` script may carry another interpreter).
pytest.importorskip("rollout_backends.adapters.dynamo._worker")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fake_engine import expected  # noqa: E402

pytestmark = pytest.mark.slow


def _free_port() -> int:
    """A free port below 32768: Dynamo 1.4.2 parses DYN_SYSTEM_PORT as an i16."""
    import random

    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def _http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 30):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _make_model_dir(root: Path) -> Path:
    """A tokenizer + config dir for the frontend (no weights needed by the fake engine)."""
    maker = Path("/work/shared/gpu/make-tiny-model.py")
    out = root / "tiny"
    if maker.exists():
        subprocess.run([sys.executable, str(maker), str(out)], check=True, capture_output=True, timeout=300)
        return out
    pytest.skip("no tiny-model maker available")


class Fleet:
    def __init__(self, root: Path, model: Path, n_workers: int = 2, router_mode: str = "round-robin") -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.http_port = _free_port()
        self.system_ports = [_free_port() for _ in range(n_workers)]
        self.ns = "spike" + os.urandom(3).hex()
        kv = root / "kv"
        kv.mkdir()
        self.env = {
            **os.environ,
            "DYN_FILE_KV": str(kv),
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            # Keep the request plane and response streams on loopback (the response-stream host is
            # an interface name on 1.4.2, not an address).
            "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "lo",
            "DYN_SYSTEM_HOST": "127.0.0.1",
        }
        self.env.pop("DYN_SYSTEM_PORT", None)
        try:
            self._start(model, n_workers, router_mode)
        except BaseException:
            self.close()
            raise

    def _start(self, model: Path, n_workers: int, router_mode: str) -> None:
        t0 = time.monotonic()
        self._spawn(
            "frontend",
            [
                sys.executable,
                "-m",
                "dynamo.frontend",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(self.http_port),
                "--namespace",
                self.ns,
                "--router-mode",
                router_mode,
                "--discovery-backend",
                "file",
                "--request-plane",
                "tcp",
                "--event-plane",
                "zmq",
            ],
            self.env,
        )
        for i, sp in enumerate(self.system_ports):
            env = {
                **self.env,
                "DYN_SYSTEM_PORT": str(sp),
                "PYTHONPATH": f"{HERE}{os.pathsep}{self.env.get('PYTHONPATH', '')}",
            }
            self._spawn(
                f"worker{i}",
                [
                    sys.executable,
                    "-m",
                    "rollout_backends.adapters.dynamo._worker",
                    "--engine",
                    "fake_engine:make",
                    "--engine-arg",
                    json.dumps({"delay": 0.05, "name": f"w{i}"}),
                    "--model-path",
                    str(model),
                    "--served-model-name",
                    "tiny",
                    "--namespace",
                    self.ns,
                ],
                env,
            )
        self._wait_ready(n_workers, timeout=90)
        self.startup_s = time.monotonic() - t0

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        p = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        self.procs.append(p)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def instances(self) -> list[int]:
        st, body = _http("GET", self.url + "/health")
        if st != 200:
            return []
        return [i["instance_id"] for i in json.loads(body).get("instances", []) if i["endpoint"] == "generate"]

    def _wait_ready(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"process exited early: {p.args}\n{self.logs()}")
            try:
                if len(self.instances()) >= n and "tiny" in _http("GET", self.url + "/v1/models")[1]:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"fleet not ready in {timeout}s\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"== {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(self.root.glob("*.log"))
        )

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            # The whole group, including anything the process left behind.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    root = Path(tempfile.mkdtemp(prefix="dyn-spike-"))
    model = _make_model_dir(root)
    f = Fleet(root, model)
    try:
        yield f
    finally:
        f.close()
        shutil.rmtree(root, ignore_errors=True)


def _complete(
    fleet: Fleet, prompt: list[int], n: int, *, extra: dict[str, Any] | None = None, headers=None, stream=False
):
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "stream": stream,
        "nvext": {"extra_fields": ["completion_token_ids", "worker_id", "engine_data", "stop_reason"]},
    }
    body.update(extra or {})
    st, text = _http("POST", fleet.url + "/v1/completions", body, headers=headers)
    assert st == 200, text
    if not stream:
        return json.loads(text)
    chunks = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and "[DONE]" not in line]
    return chunks


def test_startup_time(fleet: Fleet) -> None:
    print(f"frontend + 2 workers ready in {fleet.startup_s:.2f}s")
    assert fleet.startup_s < 60


def test_tokens_and_logprobs_round_trip(fleet: Fleet) -> None:
    seen_workers = set()
    for k, prompt in enumerate([[5, 6, 7, 8, 9, 10], [1], list(range(100, 164))]):
        n = 8 + k
        d = _complete(fleet, prompt, n)
        ids, lps = expected(prompt, n)
        ch = d["choices"][0]
        assert d["nvext"]["completion_token_ids"] == ids
        assert ch["logprobs"]["token_logprobs"] == pytest.approx(lps, abs=1e-9)
        assert len(ch["logprobs"]["token_logprobs"]) == n
        assert ch["finish_reason"] == "length"
        assert d["usage"]["completion_tokens"] == n and d["usage"]["prompt_tokens"] == len(prompt)
        assert d["nvext"]["engine_data"]["finish_reason"] == "length"
        seen_workers.add(d["nvext"]["worker_id"]["decode_worker_id"])
    assert len(seen_workers) == 2  # round-robin reached both Python workers


def test_streaming_one_token_per_chunk(fleet: Fleet) -> None:
    prompt = [3, 1, 4, 1, 5]
    chunks = _complete(fleet, prompt, 6, stream=True)
    ids = [t for c in chunks for t in (c.get("nvext") or {}).get("completion_token_ids", [])]
    lps = [x for c in chunks for ch in c["choices"] for x in ((ch.get("logprobs") or {}).get("token_logprobs") or [])]
    exp_ids, exp_lps = expected(prompt, 6)
    assert ids == exp_ids
    assert lps == pytest.approx(exp_lps, abs=1e-9)
    assert [ch.get("finish_reason") for c in chunks for ch in c["choices"]][-1] == "length"


def test_stop_token(fleet: Fleet) -> None:
    prompt = [5, 6, 7, 8, 9, 10]
    ids, _ = expected(prompt, 8)
    body = {"ignore_eos": False, "stop": [ids[2]]}
    d = _complete(fleet, prompt, 8, extra=body)
    assert d["nvext"]["completion_token_ids"] == ids[:3]  # the matched stop token is included
    assert d["choices"][0]["finish_reason"] == "stop"
    assert d["nvext"]["stop_reason"] == ids[2]
    assert d["nvext"]["engine_data"]["finish_reason"] == "stop"


def test_engine_routes_and_weight_version(fleet: Fleet) -> None:
    sp = fleet.system_ports[0]
    eng = f"http://127.0.0.1:{sp}/engine"
    st, body = _http("POST", eng + "/control/update_weight_version", {"new_version": "v9", "abort_all_requests": False})
    assert st == 200 and json.loads(body) == {
        "success": True,
        "message": "Weight version updated to v9",
        "new_version": "v9",
    }
    info = json.loads(_http("POST", eng + "/rollout/info", {})[1])
    assert info["weight_version"] == "v9" and info["instance_id"] in fleet.instances()
    # Pinning is ignored by the round-robin router on 1.4.2; look at both workers' answers instead.
    versions = {}
    for _ in range(4):
        d = _complete(fleet, [1, 2, 3], 2)
        versions[d["nvext"]["worker_id"]["decode_worker_id"]] = d["nvext"]["engine_data"]["weight_version"]
    assert versions[info["instance_id"]] == "v9"
    assert sorted(v for v in versions.values() if v != "v9") == [None]
    st, body = _http("POST", eng + "/call_tokenizer_manager", {"method": "flush_cache"})
    assert st == 200 and json.loads(body)["success"] is True
    st, body = _http("POST", eng + "/call_tokenizer_manager", {"method": "no_such_method"})
    assert st == 500


def test_abort_on_client_disconnect(fleet: Fleet) -> None:
    rid = os.urandom(16).hex()  # the frontend takes x-dynamo-request-id only in UUID form
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}
    req = urllib.request.Request(
        fleet.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-dynamo-request-id": rid},
    )
    with pytest.raises((TimeoutError, urllib.error.URLError, socket.timeout)):
        urllib.request.urlopen(req, timeout=0.5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(
            f"request {rid} stopped by the frontend" in f.read_text(errors="replace")
            for f in fleet.root.glob("worker*.log")
        ):
            return
        time.sleep(0.1)
    pytest.fail("the worker never saw the disconnect\n" + fleet.logs())


def test_abort_by_engine_route_returns_partial_tokens(fleet: Fleet) -> None:
    import threading

    rid = os.urandom(16).hex()
    result: dict[str, Any] = {}

    def run() -> None:
        result["d"] = _complete(fleet, [7, 7, 7], 100, headers={"x-dynamo-request-id": rid})

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    for sp in fleet.system_ports:  # the adapter would know the worker; the spike asks both
        _http("POST", f"http://127.0.0.1:{sp}/engine/rollout/abort", {"rid": rid})
    t.join(30)
    d = result["d"]
    n = len(d["nvext"]["completion_token_ids"])
    assert 0 < n < 100
    assert d["choices"][0]["finish_reason"] == "stop"  # 1.4.2 reports "cancelled" as "stop" ...
    assert d["nvext"]["engine_data"]["finish_reason"] == "abort"  # ... engine_data keeps the truth
    assert len(d["choices"][0]["logprobs"]["token_logprobs"]) == n
