"""Engine and entry commands: what a launcher on any node runs, supplied by the adapter.

A launcher (the Ray ``EngineActor``, a Kubernetes pod's entry point, a test) knows *where* a
process runs: the node's address, the GPUs it was given, a log directory. An adapter knows
*what* to run: the command line, its environment, its ports and how to tell it is ready. The two
meet here::

    ctx = NodeContext(index=0, bind_host="10.0.0.5", advertise_host="10.0.0.5", gpu_ids=("0",), log_dir=...)
    launch = ReferenceServerCommand(model_path="/m/tiny").build(ctx)
    await supervisor.start(launch.spec)             # the shared Supervisor, on that node
    info = launch.info(ctx, pid=...)                # what the fleet hands to ``connect``

``EngineCommand.build`` runs on the engine's node (ports are picked there). Commands are plain
attrs values, so they pickle (Ray ships them to the actor). Nothing here imports Ray.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from rollout_backends._errors import BackendUnavailable
from rollout_backends._supervisor import ProcessSpec, free_port

if TYPE_CHECKING:
    from rollout_backends._fleet import HttpFleetBackend

__all__ = [
    "EngineCommand",
    "EngineInfo",
    "EntryCommand",
    "Launch",
    "NodeContext",
    "pick_port",
]

#: Lowest port ``pick_port(below=...)`` picks (above the usual ephemeral range's start on most hosts).
_LOW_FLOOR = 20000


def pick_port(host: str = "127.0.0.1", *, below: int | None = None, avoid: set[int] | None = None) -> int:
    """A TCP port free on ``host`` now. ``below``: a random free port in [20000, below) (Dynamo 1.4.2
    parses ``DYN_SYSTEM_PORT`` as an i16, so its ports must be < 32768). ``avoid`` collects picks."""
    taken = avoid if avoid is not None else set()
    if below is None:
        for _ in range(50):
            port = free_port(host)
            if port not in taken:
                taken.add(port)
                return port
        raise BackendUnavailable(f"no free port on {host}")
    for _ in range(500):
        port = random.randrange(_LOW_FLOOR, below)
        if port in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise BackendUnavailable(f"no free port in [{_LOW_FLOOR}, {below}) on {host}")


def _str_tuple(value: Sequence[Any] | None) -> tuple[str, ...]:
    return tuple(str(v) for v in (value or ()))


@attrs.define(kw_only=True)
class NodeContext:
    """Where an engine runs: given by the launcher to ``EngineCommand.build`` on the engine's node."""

    index: int  #: the engine's index in its fleet
    bind_host: str  #: the address servers bind (``0.0.0.0`` for all interfaces)
    advertise_host: str  #: the address others reach them at (never ``0.0.0.0``)
    log_dir: str
    gpu_ids: tuple[str, ...] = attrs.field(factory=tuple, converter=_str_tuple)
    node_id: str | None = None
    #: Ports picked so far on this node by this context (``port`` never returns one twice).
    picked: set[int] = attrs.field(factory=set)

    def port(self, *, below: int | None = None) -> int:
        """A free port on ``bind_host`` (see :func:`pick_port`)."""
        probe = "0.0.0.0" if self.bind_host in ("0.0.0.0", "") else self.bind_host
        return pick_port(probe, below=below, avoid=self.picked)

    def url(self, port: int) -> str:
        return f"http://{self.advertise_host}:{port}"


@attrs.frozen(kw_only=True)
class Launch:
    """A built command: the process spec and how the fleet reaches what it serves."""

    spec: ProcessSpec
    #: Where pinned generation goes (SGLang-native server); ``None`` = only through the entry.
    generate_url: str | None
    #: Base URL of the control routes (SGLang: the server; Dynamo: the worker's system port).
    control_url: str
    #: Anything else the entry or ``connect`` needs (Dynamo: ``rpc_port``).
    extra: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class EngineInfo:
    """A running engine, as its launcher reports it (picklable; Ray returns it from the actor)."""

    index: int
    name: str  #: process name in the launcher's supervisor
    host: str  #: address clients use
    node_id: str | None
    node_ip: str | None
    pid: int
    generate_url: str | None
    control_url: str
    gpu_ids: tuple[str, ...] = ()
    extra: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def port(self) -> int | None:
        """The generation port (``None`` for engines reached only through an entry)."""
        return _port_of(self.generate_url)

    @property
    def control_port(self) -> int:
        port = _port_of(self.control_url)
        assert port is not None
        return port


def _port_of(url: str | None) -> int | None:
    if url is None:
        return None
    from urllib.parse import urlsplit

    return urlsplit(url).port


@runtime_checkable
class EngineCommand(Protocol):
    """An adapter's engine process. ``build`` runs on the engine's node."""

    #: Default grace (s) between SIGTERM and SIGKILL when stopping it.
    grace: float

    def build(self, ctx: NodeContext) -> Launch: ...


@runtime_checkable
class EntryCommand(Protocol):
    """An adapter's fleet entry point (router, frontend), started by the fleet after its engines."""

    grace: float

    def build(self, ctx: NodeContext, engines: Sequence[EngineInfo]) -> Launch: ...

    async def connect(self, entry_url: str, engines: Sequence[EngineInfo], **kwargs: Any) -> HttpFleetBackend:
        """The ``RolloutBackend`` over the entry and the engines' control URLs."""
        ...
