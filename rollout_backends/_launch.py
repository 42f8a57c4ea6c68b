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

import argparse
import asyncio
import errno
import os
import random
import re
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import attrs

from rollout_backends._errors import BackendUnavailable, InvalidRequest, Unsupported
from rollout_backends._supervisor import ProcessSpec, ReadyProgress, Supervisor, free_port

if TYPE_CHECKING:
    from rollout_backends._http_driver import HttpFleetBackend

__all__ = [
    "ConnectableEngine",
    "EngineCommand",
    "EngineInfo",
    "EntryCommand",
    "HelpFormatter",
    "Launch",
    "Local",
    "LocalEngines",
    "NodeContext",
    "PlacedEngines",
    "Placement",
    "RunningFleet",
    "carry",
    "env_map",
    "launch_fleet",
    "one_line_error",
    "pick_port",
    "require_model_dir",
    "require_module",
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


#: ``org/name``: how a Hugging Face Hub model is named (what SGLang and transformers would fetch).
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def require_model_dir(path: str | os.PathLike[str], field: str = "model_path") -> None:
    """Refuse, before anything starts, a model that is not a directory on this host:
    ``InvalidRequest(field, ...)``. Nothing is fetched at run time, so a Hugging Face name is refused
    at once, offline (given to an engine, transformers spends ~27 s retrying the network before
    it fails; measured 2026-12-05 on the reference worker)."""
    text = os.fspath(path)
    if os.path.isdir(text):
        return
    if os.path.exists(text):
        raise InvalidRequest(field, f"{text!r} is a file, not a model directory")
    hint = ""
    if _HUB_NAME.match(text):
        hint = (
            f"; it looks like a Hugging Face model name, and nothing is downloaded at run time: fetch it "
            f"first (huggingface-cli download {text} --local-dir DIR) and pass DIR"
        )
    raise InvalidRequest(field, f"{text!r} is not a directory on this host{hint}")


def require_module(module: str, field: str, instead: str, python: str = sys.executable) -> None:
    """Refuse, before anything starts, an engine whose package ``python`` cannot import:
    ``InvalidRequest(field, ...)`` saying so, then ``instead`` (what runs without it). Asked of this
    interpreter only (another one is not started to find out); the package is found, not imported."""
    if os.path.realpath(python) != os.path.realpath(sys.executable):
        return
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        found = False
    if not found:
        raise InvalidRequest(field, f"{python} cannot import {module} (pip install {module}); {instead}")


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
class ConnectableEngine(EngineCommand, Protocol):
    """An engine command that can build the backend of a fleet with no entry (SGLang-native
    servers: generation to engine 0, control to each)."""

    async def connect(
        self, entry_url: str | None, engines: Sequence[EngineInfo], **kwargs: Any
    ) -> HttpFleetBackend: ...


@runtime_checkable
class EntryCommand(Protocol):
    """An adapter's fleet entry point (router, frontend), started on the launcher's node."""

    @property
    def grace(self) -> float: ...

    @property
    def starts_with_engines(self) -> bool:
        """True: :func:`launch_fleet` starts it as soon as the engines are spawned (it finds them
        itself, or is given them by :meth:`attach`); False: once every engine is ready (it is given
        them on its command line, which a router may check at start-up)."""
        ...

    def build(self, ctx: NodeContext, engines: Sequence[EngineInfo]) -> Launch: ...

    async def attach(self, entry_url: str, engines: Sequence[EngineInfo], *, timeout: float) -> None:
        """Once it is ready: make it route to every engine (a router's ``POST /workers``) and return
        when it does; ``BackendUnavailable`` after ``timeout`` seconds. A no-op where the ready
        check already says so (a Dynamo frontend listing every instance)."""
        ...

    async def connect(self, entry_url: str, engines: Sequence[EngineInfo], **kwargs: Any) -> HttpFleetBackend:
        """The ``RolloutBackend`` over the entry and the engines' control URLs."""
        ...


# -- one way to launch a fleet ------------------------------------------------------------------


@runtime_checkable
class PlacedEngines(Protocol):
    """A fleet's engines once a :class:`Placement` has started them."""

    @property
    def engines(self) -> Sequence[EngineInfo]: ...

    @property
    def pending(self) -> Sequence[str]:
        """Names of engine processes in the launcher's supervisor that are not ready yet (a
        placement that waits elsewhere, as Ray's actors do, has none)."""
        ...

    def entry_node(self, log_dir: str, fixed: Mapping[str, int] | None = None) -> NodeContext:
        """The node an entry of this fleet runs on (the launcher's), sharing the ports picked so far."""
        ...

    async def aclose(self, *, grace: float | None = None) -> None:
        """Stop what the placement started outside the launcher's supervisor (idempotent)."""
        ...


@runtime_checkable
class Placement(Protocol):
    """Where a fleet's engines run: :class:`Local` (this host, the launcher's supervisor) or
    ``rollout_backends.ray.Ray`` (one actor per engine on a Ray cluster)."""

    async def place(
        self,
        commands: Sequence[EngineCommand],
        supervisor: Supervisor,
        *,
        ready_timeout: float,
        progress: Callable[[ReadyProgress], None] | None = None,
    ) -> PlacedEngines:
        """Start one engine per command (engine ``i`` runs ``commands[i]``); on failure stop them and raise."""
        ...


def _port_maps(value: Sequence[Mapping[str, int]] | None) -> tuple[Mapping[str, int], ...]:
    return tuple(_ports(m) for m in (value or ()))


def _gpu_lists(value: Sequence[Sequence[str]] | None) -> tuple[tuple[str, ...], ...]:
    return tuple(str_tuple(g) for g in (value or ()))


@attrs.frozen(kw_only=True)
class Local:
    """Every engine on this host, under the launcher's supervisor (named ``worker-<i>``).

    ``gpu_ids``: each engine's GPUs (its ``CUDA_VISIBLE_DEVICES``; empty: none given). ``engine_ports``:
    each engine's fixed ports by role (empty: all picked); ``entry_ports``: the entry's.
    """

    host: str = "127.0.0.1"
    gpu_ids: tuple[tuple[str, ...], ...] = attrs.field(factory=tuple, converter=_gpu_lists)
    engine_ports: tuple[Mapping[str, int], ...] = attrs.field(factory=tuple, converter=_port_maps)
    entry_ports: Mapping[str, int] = attrs.field(factory=dict, converter=_ports)

    async def place(
        self,
        commands: Sequence[EngineCommand],
        supervisor: Supervisor,
        *,
        ready_timeout: float,
        progress: Callable[[ReadyProgress], None] | None = None,
    ) -> LocalEngines:
        n = len(commands)
        for name, given in (("gpu_ids", self.gpu_ids), ("engine_ports", self.engine_ports)):
            if given and len(given) != n:
                raise InvalidRequest(name, f"{len(given)} entries for {n} engines")
        placed = LocalEngines(host=self.host, entry_ports=self.entry_ports)
        # No pick may take a port fixed for a process that starts later.
        placed.picked.update(p for ports in (*self.engine_ports, self.entry_ports) for p in ports.values())
        for i, command in enumerate(commands):
            ctx = NodeContext.on(i, self.host, str(supervisor.log_dir),
                                 gpu_ids=self.gpu_ids[i] if self.gpu_ids else (), picked=placed.picked,
                                 fixed=self.engine_ports[i] if self.engine_ports else None)  # fmt: skip
            launch = command.build(ctx).named(f"worker-{i}")
            proc = await supervisor.start(launch.spec)
            placed.engines.append(launch.info(ctx, proc.pid))
            placed.pending.append(launch.spec.name)
        return placed


@attrs.define(kw_only=True, eq=False)
class LocalEngines:
    """Engines :class:`Local` started (they stop with the launcher's supervisor)."""

    host: str
    entry_ports: Mapping[str, int]
    engines: list[EngineInfo] = attrs.field(factory=list)
    pending: list[str] = attrs.field(factory=list)
    #: Every port handed out on this host by this fleet (picks never repeat one).
    picked: set[int] = attrs.field(factory=set)

    def entry_node(self, log_dir: str, fixed: Mapping[str, int] | None = None) -> NodeContext:
        ports = self.entry_ports if fixed is None else fixed
        return NodeContext.on(-1, self.host, log_dir, picked=self.picked, fixed=ports)

    async def aclose(self, *, grace: float | None = None) -> None:
        return None


@attrs.define(kw_only=True, eq=False)
class RunningFleet:
    """A fleet :func:`launch_fleet` started: its engines, its entry, and ``connect()``.

    ``aclose`` closes the backends ``connect`` handed out, then the supervisor (the entry and any
    engine under it) when ``launch_fleet`` made it (one passed in is its owner's to close), then
    whatever the placement started elsewhere (Ray's actors).
    """

    commands: tuple[EngineCommand, ...]
    entry: EntryCommand | None
    entry_launch: Launch | None
    supervisor: Supervisor
    placed: PlacedEngines
    owns_supervisor: bool
    #: Entries :meth:`add_entry` started, by process name.
    extra_entries: dict[str, Launch] = attrs.field(factory=dict)
    _backends: list[HttpFleetBackend] = attrs.field(factory=list)
    _closed: bool = False

    @property
    def engines(self) -> tuple[EngineInfo, ...]:
        return tuple(self.placed.engines)

    @property
    def entry_url(self) -> str | None:
        """The entry's URL (``None`` without one)."""
        return None if self.entry_launch is None else _entry_url(self.entry_launch)

    @property
    def generate_url(self) -> str | None:
        """Where unpinned generation goes: the entry, or engine 0 when there is none."""
        return self.entry_url or self.engines[0].generate_url

    async def add_entry(
        self,
        entry: EntryCommand,
        name: str,
        *,
        timeout: float,
        fixed: Mapping[str, int] | None = None,
        progress: Callable[[ReadyProgress], None] | None = None,
    ) -> Launch:
        """Start one more entry over the same engines (stopped with the fleet); return its launch
        once it routes to every engine. For comparing router policies on warm engines."""
        if self._closed:
            raise BackendUnavailable("the fleet is closed")
        launch = await _start_entry(entry, self.placed, self.supervisor, name, fixed, timeout, progress)
        self.extra_entries[name] = launch
        return launch

    async def connect(self, **kwargs: Any) -> HttpFleetBackend:
        """The ``RolloutBackend`` over this fleet, from the entry's ``connect`` (or, with no entry,
        the engine command's); closed with the fleet."""
        if self.entry is not None and self.entry_launch is not None:
            backend = await self.entry.connect(_entry_url(self.entry_launch), self.engines, **kwargs)
        elif isinstance(self.commands[0], ConnectableEngine):
            backend = await self.commands[0].connect(None, self.engines, **kwargs)
        else:
            raise Unsupported("connect", f"{type(self.commands[0]).__name__} cannot build a backend without an entry")
        self._backends.append(backend)
        return backend

    async def aclose(self, *, grace: float | None = None) -> None:
        """Stop everything (idempotent)."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for b in self._backends:
            try:
                await b.aclose()
            except Exception as exc:  # keep going: the processes must still be stopped
                errors.append(exc)
        try:
            if self.owns_supervisor:
                await self.supervisor.aclose(grace=grace)
        except Exception as exc:
            errors.append(exc)
        try:
            await self.placed.aclose(grace=grace)
        except Exception as exc:
            errors.append(exc)
        if errors:
            raise errors[0]

    async def __aenter__(self) -> RunningFleet:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _entry_url(launch: Launch) -> str:
    return launch.generate_url or launch.control_url


async def _start_entry(
    entry: EntryCommand,
    placed: PlacedEngines,
    supervisor: Supervisor,
    name: str | None,
    fixed: Mapping[str, int] | None,
    timeout: float,
    progress: Callable[[ReadyProgress], None] | None,
    *,
    wait: bool = True,
) -> Launch:
    """Build and start ``entry`` on the launcher's node; with ``wait``, wait until it is ready and attached."""
    launch = entry.build(placed.entry_node(str(supervisor.log_dir), fixed), placed.engines)
    if name is not None:
        launch = launch.named(name)
    await supervisor.start(launch.spec)
    if wait:
        await supervisor.wait_ready([launch.spec.name], timeout=timeout, progress=progress)
        await _attach(entry, launch, placed, supervisor, timeout)
    return launch


async def _attach(
    entry: EntryCommand, launch: Launch, placed: PlacedEngines, supervisor: Supervisor, timeout: float
) -> None:
    try:
        await entry.attach(_entry_url(launch), placed.engines, timeout=timeout)
    except BackendUnavailable as exc:
        tail = supervisor.log_tail(launch.spec.name)
        raise BackendUnavailable(f"{exc}; last lines of its log:\n{tail}", worker=exc.worker) from exc


async def launch_fleet(
    engine: EngineCommand | Sequence[EngineCommand],
    n: int,
    entry: EntryCommand | None = None,
    placement: Placement | None = None,
    *,
    supervisor: Supervisor | None = None,
    log_dir: str | None = None,
    ready_timeout: float = 600.0,
    entry_timeout: float | None = None,
    entry_name: str | None = None,
    progress: Callable[[ReadyProgress], None] | None = None,
) -> RunningFleet:
    """Start ``n`` engines (``engine``, or ``engine[i]`` for engine ``i``) where ``placement`` says
    (default :class:`Local`), then the fleet's ``entry`` on this node; return once the entry routes
    to every engine.

    The one start-up loop of every fleet: spawn the engines; start an entry that
    ``starts_with_engines`` at once (a Dynamo frontend, a router given its workers later); wait until
    every engine (and that entry) is ready, within ``ready_timeout``; otherwise start the entry now
    and wait for it (``entry_timeout``, default ``ready_timeout``); then ``entry.attach``. On any
    failure everything started is stopped (a ``supervisor`` passed in is the caller's to close)
    and the error is raised: ``BackendUnavailable`` with the log tails of what did not come up.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidRequest("n", f"must be an int >= 1, got {n!r}")
    commands = tuple(engine) if isinstance(engine, Sequence) else (engine,) * n
    if len(commands) != n:
        raise InvalidRequest("engine", f"{len(commands)} engine commands for {n} engines")
    where: Placement = placement if placement is not None else Local()
    owns = supervisor is None
    sup = supervisor if supervisor is not None else Supervisor(log_dir)
    late_timeout = ready_timeout if entry_timeout is None else entry_timeout
    placed: PlacedEngines | None = None
    try:
        placed = await where.place(commands, sup, ready_timeout=ready_timeout, progress=progress)
        launch: Launch | None = None
        waiting = list(placed.pending)
        if entry is not None and entry.starts_with_engines:
            launch = await _start_entry(entry, placed, sup, entry_name, None, ready_timeout, progress, wait=False)
            waiting.append(launch.spec.name)
        await sup.wait_ready(waiting, timeout=ready_timeout, progress=progress)
        if entry is not None and launch is None:
            launch = await _start_entry(entry, placed, sup, entry_name, None, late_timeout, progress, wait=False)
            await sup.wait_ready([launch.spec.name], timeout=late_timeout, progress=progress)
        if entry is not None and launch is not None:
            await _attach(entry, launch, placed, sup, late_timeout)
    except BaseException:
        try:
            if owns:
                await sup.aclose()
        finally:
            if placed is not None:
                await placed.aclose()
        raise
    return RunningFleet(commands=commands, entry=entry, entry_launch=launch, supervisor=sup, placed=placed,
                        owns_supervisor=owns)  # fmt: skip


# -- a launcher's command line ------------------------------------------------------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The ``--help`` of every ``rollout-backends`` command: the description as written, and each
    flag's default after its help, unless the help already says what the default is (as it must
    where the default is ``None``, or comes from the environment: a key is never shown)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is argparse.SUPPRESS or action.required:
            return text
        if isinstance(default, (list, tuple)) and not default:
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def split_passthrough(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """A launcher's own arguments and those after ``--`` (passed through to every worker);
    ``None``: ``sys.argv[1:]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        return args, []
    i = args.index("--")
    return args[:i], args[i + 1 :]


#: How the supervisor's start-up errors name a log and quote its tail (``_supervisor.py``).
_LOG_TAIL = re.compile(r"[;,]? *last lines of (?P<path>\S+?):?$")


def one_line_error(exc: BaseException) -> str:
    """The one line a command prints for an error instead of a traceback: its type and first line
    (``InvalidRequest``: the field, as the caller wrote it, and what is wrong with it).

    A start-up failure's message quotes the log tail of the process that failed: the line names
    the log instead, with its last line (what the process died of; the whole log stays where it
    is). A port already bound says so."""
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return f"error: address already in use: {exc} (another process holds the port; pick another)"
    first, *rest = str(exc).splitlines() or [""]
    if isinstance(exc, InvalidRequest):  # the caller's own input: the field it named says enough
        return f"error: {first}"
    match = _LOG_TAIL.search(first)
    if match is not None:
        first = f"{first[: match.start()]}; log: {match['path']}"
        last = next((line.strip() for line in reversed(rest) if line.strip() and not line.startswith("---")), None)
        if last:
            first += f" (its last line: {last})"
    return f"error: {type(exc).__name__}: {first}"


def run_launcher_cli(
    make_config: Callable[[], _T],
    serve: Callable[[_T, Callable[[], Awaitable[None]]], Awaitable[Any]],
    *,
    preflight: Callable[[_T], None] | None = None,
) -> int:
    """``main`` of a fleet launcher's command line. ``serve(config, until_signalled)`` starts the
    fleet, prints where it is, then awaits ``until_signalled()``: it says the fleet is ready, waits
    for SIGINT/SIGTERM (one sent during start-up counts) and returns, so the fleet's context stops
    everything. ``preflight(config)`` runs first: its ``InvalidRequest`` names a config field that
    is also a flag (``model_path`` is ``--model-path``), and says so as the flag. Errors are one line
    (``one_line_error``). Exit status: 0, 1 on an error, 2 on a bad configuration, 130 on an interrupt."""
    try:
        config = make_config()
    except Exception as exc:  # InvalidRequest from the config's checks
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if preflight is not None:
        try:
            preflight(config)
        except InvalidRequest as exc:
            print(f"error: --{exc.field.replace('_', '-')}: {exc.reason}", file=sys.stderr)
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
        print(one_line_error(exc), file=sys.stderr)
        return 2 if isinstance(exc, InvalidRequest) else 1
    return 0
