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

import asyncio
import random
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

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
    "carry",
    "env_map",
    "pick_port",
    "run_launcher_cli",
    "split_passthrough",
    "str_tuple",
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


def str_tuple(value: Sequence[Any] | None) -> tuple[str, ...]:
    """attrs converter of argument lists: ``None`` -> ``()``; a bare string is refused (not split)."""
    if isinstance(value, (str, bytes)):
        raise TypeError("expected a sequence of arguments, not a string")
    return tuple(str(v) for v in (value or ()))


def env_map(value: Mapping[str, str] | None) -> Mapping[str, str]:
    """attrs converter of environment overrides: a private copy (``None`` -> ``{}``)."""
    return dict(value or {})


_T = TypeVar("_T")


def carry(cls: type[_T], source: object, **overrides: Any) -> _T:
    """An attrs ``cls`` (a command) from the same-named attributes of ``source`` (a launcher's
    config), then ``overrides``: how a local launcher turns its config into launch commands."""
    names = [a.name for a in attrs.fields(cls) if a.init]  # type: ignore[arg-type]
    kwargs = {n: getattr(source, n) for n in names if hasattr(source, n)}
    kwargs.update(overrides)
    return cls(**kwargs)


_WILDCARDS = ("0.0.0.0", "::", "")


def _ports(value: Mapping[str, int] | None) -> Mapping[str, int]:
    return {str(k): int(v) for k, v in (value or {}).items()}


@attrs.define(kw_only=True)
class NodeContext:
    """Where an engine runs: given by the launcher to ``EngineCommand.build`` on the engine's node."""

    index: int  #: the engine's index in its fleet
    bind_host: str  #: the address servers bind (``0.0.0.0`` for all interfaces)
    advertise_host: str  #: the address others reach them at (never ``0.0.0.0``)
    log_dir: str
    gpu_ids: tuple[str, ...] = attrs.field(factory=tuple, converter=str_tuple)
    node_id: str | None = None
    #: Ports picked so far on this node (``port`` never returns one twice); launchers starting
    #: several processes on one host share one set between their contexts.
    picked: set[int] = attrs.field(factory=set)
    #: Ports the launcher fixed, by role (``"http"``, ``"prometheus"``, ``"system"``...): ``port(role)``
    #: returns these instead of picking one.
    fixed: Mapping[str, int] = attrs.field(factory=dict, converter=_ports)

    @classmethod
    def on(
        cls,
        index: int,
        bind_host: str,
        log_dir: str,
        *,
        node_ip: str | None = None,
        gpu_ids: Sequence[str] = (),
        node_id: str | None = None,
        picked: set[int] | None = None,
        fixed: Mapping[str, int] | None = None,
    ) -> NodeContext:
        """A context binding ``bind_host``, advertised at it, or at ``node_ip`` (default 127.0.0.1)
        when it binds every interface."""
        advertise = (node_ip or "127.0.0.1") if bind_host in _WILDCARDS else bind_host
        return cls(index=index, bind_host=bind_host, advertise_host=advertise, log_dir=str(log_dir),
                   gpu_ids=tuple(gpu_ids), node_id=node_id, picked=picked if picked is not None else set(),
                   fixed=fixed)  # fmt: skip

    def port(self, role: str | None = None, *, below: int | None = None, any_interface: bool = False) -> int:
        """The port fixed for ``role``, else a free port on ``bind_host`` (every interface with
        ``any_interface``, for servers binding ``*``; see :func:`pick_port`)."""
        if role is not None and role in self.fixed:
            port = self.fixed[role]
            self.picked.add(port)
            return port
        for p in self.fixed.values():  # never hand out a port fixed for another role
            self.picked.add(p)
        wildcard = any_interface or self.bind_host in _WILDCARDS
        return pick_port("0.0.0.0" if wildcard else self.bind_host, below=below, avoid=self.picked)

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

    def named(self, name: str) -> Launch:
        """The same launch under another process name (a launcher's own naming scheme)."""
        return attrs.evolve(self, spec=attrs.evolve(self.spec, name=name))

    def info(self, ctx: NodeContext, pid: int, *, node_ip: str | None = None) -> EngineInfo:
        """The ``EngineInfo`` of this launch, started as ``pid`` in ``ctx``."""
        return EngineInfo(
            index=ctx.index,
            name=self.spec.name,
            host=ctx.advertise_host,
            node_id=ctx.node_id,
            node_ip=node_ip,
            pid=pid,
            generate_url=self.generate_url,
            control_url=self.control_url,
            gpu_ids=ctx.gpu_ids,
            extra=dict(self.extra),
        )


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

    @property
    def grace(self) -> float:
        """Default grace (s) between SIGTERM and SIGKILL when stopping it (commands are frozen)."""
        ...

    def build(self, ctx: NodeContext) -> Launch: ...


@runtime_checkable
class EntryCommand(Protocol):
    """An adapter's fleet entry point (router, frontend), started by the fleet after its engines."""

    @property
    def grace(self) -> float: ...

    def build(self, ctx: NodeContext, engines: Sequence[EngineInfo]) -> Launch: ...

    async def connect(self, entry_url: str, engines: Sequence[EngineInfo], **kwargs: Any) -> HttpFleetBackend:
        """The ``RolloutBackend`` over the entry and the engines' control URLs."""
        ...


# -- a launcher's command line ------------------------------------------------------------------


def split_passthrough(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """A launcher's own arguments and those after ``--`` (passed through to every worker);
    ``None``: ``sys.argv[1:]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        return args, []
    i = args.index("--")
    return args[:i], args[i + 1 :]


def run_launcher_cli(
    make_config: Callable[[], _T], serve: Callable[[_T, Callable[[], Awaitable[None]]], Awaitable[Any]]
) -> int:
    """``main`` of a fleet launcher's command line. ``serve(config, until_signalled)`` starts the
    fleet, prints where it is, then awaits ``until_signalled()``: it says the fleet is ready, waits
    for SIGINT/SIGTERM (one sent during start-up counts) and returns, so the fleet's context stops
    everything. Exit status: 0, 1 on an error, 2 on a bad configuration, 130 on an interrupt."""
    try:
        config = make_config()
    except Exception as exc:  # InvalidRequest from the config's checks
        print(f"error: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        async def until_signalled() -> None:
            print("ready; Ctrl-C stops everything", flush=True)
            await stop.wait()
            print("stopping...", file=sys.stderr, flush=True)

        await serve(config, until_signalled)

    try:
        asyncio.run(run())
    except KeyboardInterrupt:  # pragma: no cover - the signal handler normally catches it
        return 130
    except Exception as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
