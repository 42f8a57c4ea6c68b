"""A small process supervisor: one mechanism for every launcher.

SGLang workers, routers, Dynamo frontends and workers, and reference servers are all started the
same way::

    async with Supervisor(log_dir="/tmp/fleet") as sup:
        port = free_port()
        await sup.start(ProcessSpec(
            name="worker-0",
            argv=[sys.executable, "-m", "rollout_backends.adapters.reference.serve", "--port", str(port), ...],
            ready=ReadyCheck.http(f"http://127.0.0.1:{port}/health"),
            ports=[port],
        ))
        await sup.wait_ready(timeout=60, progress=stderr_progress)
        ...
    # every process group is gone here

Guarantees:

* Each process runs in its **own process group** (``start_new_session=True``); ``stop``/``aclose``
  signal the whole group, so children of children go too (SIGTERM, a grace period, then SIGKILL).
* A crashed parent leaves no orphans: each child gets ``PR_SET_PDEATHSIG(SIGKILL)`` and, by default,
  a watchdog process (one per supervisor) SIGKILLs every live group when the supervisor's process
  dies (it holds the read end of a pipe; EOF means the parent is gone). The watchdog covers the
  grandchildren that ``PDEATHSIG`` does not.
* A port listed in ``ProcessSpec.ports`` that is already bound fails *before* spawning.
* ``wait_ready`` fails fast when a process exits during start-up, and on timeout names every process
  that is not ready with the tail of its log.
* Secrets in ``argv`` (values after ``--api-key``-like flags) are redacted in logs and messages.

Linux only (``/proc``, ``prctl``); on other systems PDEATHSIG is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs

from rollout_backends._errors import BackendUnavailable

__all__ = [
    "ManagedProcess",
    "ProcessSpec",
    "ProcessState",
    "ReadyCheck",
    "ReadyProgress",
    "Supervisor",
    "free_port",
    "group_members",
    "port_in_use",
    "redact_argv",
    "stderr_progress",
]

_LOG_TAIL_LINES = 20
_PR_SET_PDEATHSIG = 1

#: Flags whose following argument is a secret (also ``--flag=value``).
_SECRET_FLAGS = ("key", "token", "secret", "password", "passwd", "credential")


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the values of secret-looking flags (``--api-key K``, ``--token=T``) replaced."""
    out: list[str] = []
    redact_next = False
    for arg in argv:
        if redact_next:
            out.append("***")
            redact_next = False
            continue
        if arg.startswith("-"):
            flag, eq, _value = arg.partition("=")
            secret = any(s in flag.lower() for s in _SECRET_FLAGS)
            if secret and eq:
                out.append(f"{flag}=***")
                continue
            redact_next = secret
        out.append(arg)
    return out


# -- ports --------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; another process may race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails because something holds it (SO_REUSEADDR, like servers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


# -- process table ------------------------------------------------------------------------------


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``, read from ``/proc``."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # pragma: no cover - non-Linux
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ..." -- comm may contain spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) < 3:
            continue
        state, _ppid, pgrp = fields[0], fields[1], fields[2]
        if state in ("Z", "X"):
            continue
        if int(pgrp) == pgid:
            members.append(int(entry))
    return sorted(members)


# -- specs --------------------------------------------------------------------------------------

ReadyFn = Callable[[], Awaitable[bool]]


@attrs.frozen(slots=True)
class ReadyCheck:
    """How to tell that a process is ready.

    * ``ReadyCheck.http(url)``: a GET answers ``status`` (200; ``None``: any HTTP answer at all,
      e.g. a Dynamo mocker's system port, which answers 503 forever). Headers (e.g. an API key)
      are sent but never shown.
    * ``ReadyCheck.custom(fn)``: ``await fn()`` returns True. Returning False or raising means "not yet".
    """

    kind: str  #: "http" or "custom"
    url: str | None = None
    status: int | None = 200
    headers: Mapping[str, str] = attrs.field(factory=dict, repr=False)
    fn: ReadyFn | None = attrs.field(default=None, repr=False)
    #: Seconds one check may take.
    check_timeout: float = 2.0

    def __attrs_post_init__(self) -> None:
        if self.kind == "http":
            if not self.url:
                raise ValueError("ReadyCheck.http needs a url")
        elif self.kind == "custom":
            if self.fn is None:
                raise ValueError("ReadyCheck.custom needs a coroutine function")
        else:
            raise ValueError(f"unknown ReadyCheck kind {self.kind!r}")

    @classmethod
    def http(
        cls,
        url: str,
        *,
        status: int | None = 200,
        headers: Mapping[str, str] | None = None,
        check_timeout: float = 2.0,
    ) -> ReadyCheck:
        return cls("http", url=url, status=status, headers=dict(headers or {}), check_timeout=check_timeout)

    @classmethod
    def custom(cls, fn: ReadyFn, *, check_timeout: float = 2.0) -> ReadyCheck:
        return cls("custom", fn=fn, check_timeout=check_timeout)

    def describe(self) -> str:
        if self.kind != "http":
            return "custom check"
        return f"GET {self.url} -> {'any answer' if self.status is None else self.status}"


def _to_ready(value: ReadyCheck | str | ReadyFn | None) -> ReadyCheck | None:
    if value is None or isinstance(value, ReadyCheck):
        return value
    if isinstance(value, str):
        return ReadyCheck.http(value)
    if callable(value):
        return ReadyCheck.custom(value)
    raise TypeError(f"ready must be a ReadyCheck, a URL or a coroutine function, got {type(value).__name__}")


def _to_ports(value: Iterable[int | tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    out = []
    for p in value:
        if isinstance(p, tuple):
            host, port = p
            out.append((str(host), int(port)))
        else:
            out.append(("127.0.0.1", int(p)))
    return tuple(out)


def _to_argv(value: Iterable[object]) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)):
        raise TypeError("argv must be a sequence of arguments, not a string")
    return tuple(str(a) for a in value)


def _to_env(value: Mapping[str, str | None] | None) -> Mapping[str, str | None]:
    return dict(value or {})


@attrs.frozen(slots=True, kw_only=True)
class ProcessSpec:
    """What to run and how to know it is up.

    ``env`` overrides the inherited environment (a ``None`` value removes a variable).
    ``log_path`` defaults to ``<supervisor log_dir>/<name>.log``; stdout and stderr both go there.
    ``ports`` are the ports the process will bind: ints (on 127.0.0.1) or ``(host, port)``.
    """

    name: str
    argv: tuple[str, ...] = attrs.field(converter=_to_argv)
    env: Mapping[str, str | None] = attrs.field(factory=dict, converter=_to_env, repr=False)
    cwd: str | None = None
    log_path: str | None = None
    ready: ReadyCheck | None = attrs.field(default=None, converter=_to_ready)
    ports: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=_to_ports)
    #: Seconds between SIGTERM and SIGKILL on stop; ``None`` uses the supervisor's default.
    grace: float | None = None

    def __attrs_post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"process name must be non-empty without '/', got {self.name!r}")
        if not self.argv:
            raise ValueError(f"{self.name}: argv must not be empty")


class ProcessState:
    STARTING = "starting"
    READY = "ready"
    EXITED = "exited"
    STOPPED = "stopped"


@attrs.define(slots=True, eq=False)
class ManagedProcess:
    """A started process. ``pid`` is also its process-group id."""

    spec: ProcessSpec
    popen: subprocess.Popen[bytes] = attrs.field(repr=False)
    log_path: Path
    started_at: float  #: time.monotonic()
    state: str = ProcessState.STARTING
    last_check_error: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def pgid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        return _tail(self.log_path, lines)


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode(errors="replace")
    except OSError as e:
        return f"<cannot read log {path}: {e}>"
    return "\n".join(data.splitlines()[-lines:])


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# -- progress -----------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class ReadyProgress:
    """A snapshot passed to ``wait_ready(progress=...)``; ``str()`` gives a one-line summary."""

    elapsed: float
    ready: Mapping[str, bool]
    waited: Mapping[str, float]  #: seconds each has been waited for

    def __str__(self) -> str:
        parts = []
        for name, ok in self.ready.items():
            parts.append(f"{name} \u2713" if ok else f"{name} ({self.waited[name]:.0f}s)")
        return "waiting: " + ", ".join(parts)


def stderr_progress(p: ReadyProgress) -> None:
    """A ``progress`` callback that writes one line per update to stderr."""
    print(str(p), file=sys.stderr, flush=True)


# -- the parent-death guards --------------------------------------------------------------------


def _pdeathsig_preexec() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):  # pragma: no cover
        return None
    parent = os.getpid()

    def preexec() -> None:  # runs in the child between fork and exec
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


_WATCHDOG_SRC = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
groups = set()
buf = b""
fd = sys.stdin.fileno()
while True:
    try:
        chunk = os.read(fd, 4096)
    except InterruptedError:
        continue
    if not chunk:
        break
    buf += chunk
    *lines, buf = buf.split(b"\n")
    for line in lines:
        line = line.strip()
        if line.startswith(b"+"):
            groups.add(int(line[1:]))
        elif line.startswith(b"-"):
            groups.discard(int(line[1:]))
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


class _Watchdog:
    """A helper process that SIGKILLs registered process groups when our process dies."""

    def __init__(self) -> None:
        r, w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-S", "-c", _WATCHDOG_SRC],
                stdin=r,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C on the terminal must not take it down first
                close_fds=True,
            )
        finally:
            os.close(r)
        self._w: int | None = w

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _send(self, line: str) -> None:
        if self._w is None:
            return
        with contextlib.suppress(OSError):
            os.write(self._w, line.encode() + b"\n")

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}")

    def close(self) -> None:
        if self._w is not None:
            os.close(self._w)
            self._w = None
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            self._proc.kill()
            self._proc.wait()


# -- the supervisor -----------------------------------------------------------------------------


class Supervisor:
    """Starts, watches and stops processes; an async context manager that stops everything on exit.

    ``log_dir`` holds the default log files (a fresh temporary directory if omitted).
    ``grace`` is the default seconds between SIGTERM and SIGKILL. ``watchdog`` starts the helper
    that kills every live group if this process dies without ``aclose``.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        grace: float = 10.0,
        poll_interval: float = 0.2,
        watchdog: bool = True,
    ) -> None:
        if log_dir is None:
            import tempfile

            log_dir = tempfile.mkdtemp(prefix="rollout-backends-logs-")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.grace = grace
        self.poll_interval = poll_interval
        self._procs: dict[str, ManagedProcess] = {}
        self._use_watchdog = watchdog
        self._watchdog: _Watchdog | None = None
        self._closed = False

    # -- context --------------------------------------------------------------------------------

    async def __aenter__(self) -> Supervisor:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- queries --------------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._procs

    def process(self, name: str) -> ManagedProcess:
        try:
            return self._procs[name]
        except KeyError:
            raise KeyError(f"no process named {name!r} (known: {sorted(self._procs)})") from None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._procs)

    def alive(self, name: str) -> bool:
        """Whether the process is running (a SIGSTOPped process counts as alive)."""
        return self.process(name).alive()

    def pids(self) -> dict[str, int]:
        """The pid (= process-group id) of every process still running, by name."""
        return {n: p.pid for n, p in self._procs.items() if p.alive()}

    def group_pids(self, name: str) -> list[int]:
        """Every live pid in the process's group (the process and its descendants that stayed)."""
        return group_members(self.process(name).pgid)

    def log_tail(self, name: str, lines: int = _LOG_TAIL_LINES) -> str:
        return self.process(name).log_tail(lines)

    # -- start ----------------------------------------------------------------------------------

    async def start(self, spec: ProcessSpec) -> ManagedProcess:
        """Spawn ``spec`` in its own process group. Does not wait for readiness (``wait_ready``).

        Raises ``ValueError`` for a name already running and ``BackendUnavailable`` for a port
        already bound (before anything is spawned).
        """
        if self._closed:
            raise RuntimeError("supervisor is closed")
        old = self._procs.get(spec.name)
        if old is not None and old.alive():
            raise ValueError(f"a process named {spec.name!r} is already running (pid {old.pid})")
        for host, port in spec.ports:
            if port_in_use(host, port):
                raise BackendUnavailable(
                    f"{spec.name}: port {host}:{port} is already in use; not starting "
                    f"{' '.join(redact_argv(spec.argv))}",
                    worker=spec.name,
                )
        if self._use_watchdog and self._watchdog is None:
            self._watchdog = _Watchdog()

        log_path = Path(spec.log_path) if spec.log_path else self.log_dir / f"{spec.name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        for k, v in spec.env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = str(v)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(log_path, "ab", buffering=0) as log:
            header = f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} start {spec.name}: {' '.join(redact_argv(spec.argv))}\n"
            log.write(header.encode())
            try:
                popen = subprocess.Popen(
                    list(spec.argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=spec.cwd,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_pdeathsig_preexec(),
                    close_fds=True,
                )
            except OSError as e:
                raise BackendUnavailable(f"{spec.name}: cannot start {spec.argv[0]!r}: {e}", worker=spec.name) from e
        if self._watchdog is not None:
            self._watchdog.watch(popen.pid)
        proc = ManagedProcess(spec=spec, popen=popen, log_path=log_path, started_at=time.monotonic())
        self._procs[spec.name] = proc
        return proc

    # -- readiness ------------------------------------------------------------------------------

    async def _check(self, proc: ManagedProcess, session: Any) -> bool:
        check = proc.spec.ready
        if check is None:
            return True
        try:
            if check.kind == "http":
                import aiohttp

                timeout = aiohttp.ClientTimeout(total=check.check_timeout)
                assert check.url is not None
                async with session.get(check.url, headers=dict(check.headers), timeout=timeout) as resp:
                    await resp.read()
                    if check.status is None or resp.status == check.status:
                        return True
                    proc.last_check_error = f"HTTP {resp.status}"
                    return False
            assert check.fn is not None
            ok = await asyncio.wait_for(check.fn(), check.check_timeout)
            if not ok:
                proc.last_check_error = "check returned False"
            return bool(ok)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            proc.last_check_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return False

    def _exit_error(self, proc: ManagedProcess, during: str) -> BackendUnavailable:
        code = proc.returncode
        assert code is not None
        proc.state = ProcessState.EXITED
        return BackendUnavailable(
            f"{proc.name} {_describe_exit(code)} {during} (pid {proc.pid}); last lines of {proc.log_path}:\n"
            f"{_indent(proc.log_tail())}",
            worker=proc.name,
        )

    async def wait_ready(
        self,
        names: Iterable[str] | None = None,
        timeout: float = 60.0,
        *,
        progress: Callable[[ReadyProgress], None] | None = None,
        progress_interval: float = 1.0,
    ) -> None:
        """Poll every named process's ready check concurrently until all pass.

        Raises ``BackendUnavailable`` at once when one exits (its exit code and log tail), or on
        timeout naming every process not ready, each with its last check error and log tail.
        """
        selected = list(self._procs) if names is None else list(names)
        procs = [self.process(n) for n in selected]
        if not procs:
            return
        import aiohttp

        t0 = time.monotonic()
        deadline = t0 + timeout
        ready = {p.name: p.state == ProcessState.READY for p in procs}
        next_progress = t0
        async with aiohttp.ClientSession() as session:
            while True:
                for p in procs:
                    if not p.alive():
                        raise self._exit_error(p, "during start-up")
                pending = [p for p in procs if not ready[p.name]]
                if pending:
                    results = await asyncio.gather(*(self._check(p, session) for p in pending))
                    for p, ok in zip(pending, results, strict=True):
                        if ok:
                            # A check can pass just before the process dies; re-check liveness.
                            if not p.alive():
                                raise self._exit_error(p, "during start-up")
                            ready[p.name] = True
                            p.state = ProcessState.READY
                            p.last_check_error = None
                now = time.monotonic()
                if progress is not None and (now >= next_progress or all(ready.values())):
                    waited = {p.name: now - max(p.started_at, t0) for p in procs}
                    progress(ReadyProgress(elapsed=now - t0, ready=dict(ready), waited=waited))
                    next_progress = now + progress_interval
                if all(ready.values()):
                    return
                if now >= deadline:
                    break
                await asyncio.sleep(min(self.poll_interval, max(0.0, deadline - now)))
        not_ready = [p for p in procs if not ready[p.name]]
        parts = []
        for p in not_ready:
            check = p.spec.ready.describe() if p.spec.ready else "no check"
            status = "running" if p.alive() else _describe_exit(p.returncode or 0)
            parts.append(
                f"--- {p.name} (pid {p.pid}, {status}; {check}; last error: {p.last_check_error}); "
                f"last lines of {p.log_path}:\n{_indent(p.log_tail())}"
            )
        raise BackendUnavailable(
            f"not ready after {timeout:.1f}s: {', '.join(p.name for p in not_ready)}\n" + "\n".join(parts),
            worker=not_ready[0].name if len(not_ready) == 1 else None,
        )

    # -- signals and stop -----------------------------------------------------------------------

    def kill(self, name: str, sig: int = signal.SIGKILL, *, group: bool = True) -> None:
        """Send ``sig`` to the process (``group=True``: its whole process group). For fault tests."""
        proc = self.process(name)
        try:
            if group:
                os.killpg(proc.pgid, sig)
            else:
                os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass

    async def _wait_group_gone(self, proc: ManagedProcess, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            proc.popen.poll()  # reap the leader so it does not linger as a zombie
            if not group_members(proc.pgid):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    async def stop(self, name: str, *, grace: float | None = None) -> int | None:
        """SIGTERM the process group, wait up to ``grace`` s for it to empty, then SIGKILL it.

        Returns the leader's exit code (``None`` if it cannot be reaped). Idempotent.
        """
        proc = self.process(name)
        g = grace if grace is not None else (proc.spec.grace if proc.spec.grace is not None else self.grace)
        if group_members(proc.pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pgid, signal.SIGTERM)
                os.killpg(proc.pgid, signal.SIGCONT)  # a stopped process must run to see SIGTERM
            if not await self._wait_group_gone(proc, g):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pgid, signal.SIGKILL)
                await self._wait_group_gone(proc, 5.0)
        try:
            code = proc.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILLed leader always exits
            code = None
        if self._watchdog is not None:
            self._watchdog.forget(proc.pgid)
        proc.state = ProcessState.STOPPED
        return code

    async def restart(self, name: str, *, grace: float | None = None) -> ManagedProcess:
        """Stop the process and start its spec again (wait for ports to free). Call ``wait_ready`` after."""
        proc = self.process(name)
        await self.stop(name, grace=grace)
        deadline = time.monotonic() + 10.0
        while any(port_in_use(h, p) for h, p in proc.spec.ports) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return await self.start(proc.spec)

    async def aclose(self, *, grace: float | None = None) -> None:
        """Stop every process (concurrently) and the watchdog. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            results = await asyncio.gather(
                *(self.stop(n, grace=grace) for n in list(self._procs)), return_exceptions=True
            )
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        finally:
            if self._watchdog is not None:
                self._watchdog.close()
                self._watchdog = None


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines()) if text else prefix + "<empty log>"
