"""``EngineActor``: one Ray actor per engine; it launches and supervises the engine's process on its node.

The actor is an *async* actor: every method runs on its one event-loop thread, which lives as long
as the actor's process. The server process is started from that thread by the shared
``Supervisor``, so:

* its process group is stopped (SIGTERM, grace, SIGKILL) by ``stop`` and on a graceful exit;
* when the actor's process dies (``ray.kill``, a crash, the node's raylet going away) the server
  gets ``PDEATHSIG`` SIGKILL and the supervisor's watchdog SIGKILLs its whole process group.

The class itself does not import Ray at module level; :class:`~rollout_backends.ray.RayFleet`
wraps it with ``ray.remote``. It can also be used directly (``ray.remote(EngineActor)``) by a
framework that places its own actors (Miles' ``RolloutManager``).
"""

from __future__ import annotations

import importlib
import signal
import tempfile
from typing import Any

from rollout_backends import BackendUnavailable
from rollout_backends.launch import EngineCommand, EngineInfo, NodeContext, Supervisor

__all__ = ["EngineActor"]

_START_ATTEMPTS = 3


def _ray_node() -> tuple[str, str | None, tuple[str, ...]]:
    """(node ip, node id, gpu ids) of this process, from Ray when it runs inside a Ray worker."""
    try:
        ray: Any = importlib.import_module("ray")
    except ImportError:  # pragma: no cover - used without Ray (tests, Kubernetes entry points)
        return "127.0.0.1", None, ()
    if not ray.is_initialized():
        return "127.0.0.1", None, ()
    ip = str(ray.util.get_node_ip_address())
    node_id = str(ray.get_runtime_context().get_node_id())
    gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
    return ip, node_id, gpu_ids


class EngineActor:
    """Launches ``command`` on this node through a ``Supervisor`` and reports where it serves.

    ``bind_host``: the address the engine binds; ``None`` = this node's IP as Ray sees it
    (reachable from the other nodes). ``"0.0.0.0"`` binds all interfaces and advertises the node
    IP. Tests on one host pass ``"127.0.0.1"``.
    """

    def __init__(
        self,
        command: EngineCommand,
        index: int,
        *,
        bind_host: str | None = None,
        log_dir: str | None = None,
        ready_timeout: float = 600.0,
    ) -> None:
        self._command = command
        self._index = index
        self._bind_host = bind_host
        self._log_dir = log_dir
        self._ready_timeout = ready_timeout
        self._sup: Supervisor | None = None
        self._info: EngineInfo | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        """Build the command on this node, start it and wait until it is ready. Idempotent."""
        if self._info is not None and self._sup is not None and self._sup.alive(self._info.name):
            return self._info
        node_ip, node_id, gpu_ids = _ray_node()
        bind = self._bind_host or node_ip
        log_dir = self._log_dir or tempfile.mkdtemp(prefix=f"rollout-engine-{self._index}-")
        if self._sup is None:
            self._sup = Supervisor(log_dir, grace=self._command.grace)
        last: BackendUnavailable | None = None
        for _ in range(_START_ATTEMPTS):
            ctx = NodeContext.on(self._index, bind, log_dir, node_ip=node_ip, gpu_ids=gpu_ids, node_id=node_id)
            launch = self._command.build(ctx)
            name = launch.spec.name
            try:
                proc = await self._sup.start(launch.spec)
            except BackendUnavailable as exc:  # a port taken between pick and bind: pick again
                if "already in use" not in str(exc):
                    raise
                last = exc
                continue
            try:
                await self._sup.wait_ready([name], timeout=self._ready_timeout)
            except BaseException:
                await self._sup.stop(name)
                raise
            self._info = launch.info(ctx, proc.pid, node_ip=node_ip)
            return self._info
        assert last is not None
        raise last

    async def stop(self, grace: float | None = None) -> int | None:
        """Stop the engine's process group (SIGTERM, ``grace``, SIGKILL) and the watchdog."""
        if self._sup is None:
            return None
        code = None
        if self._info is not None and self._info.name in self._sup:
            code = await self._sup.stop(self._info.name, grace=grace)
        await self._sup.aclose(grace=grace)
        self._sup = None
        return code

    async def restart(self) -> EngineInfo:
        """Stop the process and start the command again (new ports; a fresh ``EngineInfo``)."""
        await self.stop()
        self._info = None
        return await self.start()

    # -- queries --------------------------------------------------------------------------------

    async def info(self) -> EngineInfo:
        if self._info is None:
            raise BackendUnavailable(f"engine {self._index} has not been started", worker=str(self._index))
        return self._info

    async def alive(self) -> bool:
        """Whether the engine's process runs."""
        return self._info is not None and self._sup is not None and self._sup.alive(self._info.name)

    async def pids(self) -> list[int]:
        """Every live pid of the engine's process group (the server and its children)."""
        if self._info is None or self._sup is None:
            return []
        return self._sup.group_pids(self._info.name)

    async def actor_pid(self) -> int:
        """The pid of the actor's own process (fault tests kill it)."""
        import os

        return os.getpid()

    async def log_tail(self, lines: int = 40) -> str:
        if self._info is None or self._sup is None:
            return ""
        return self._sup.log_tail(self._info.name, lines)

    async def signal(self, sig: int = int(signal.SIGKILL)) -> None:
        """Send ``sig`` to the engine's process group (fault injection)."""
        if self._info is not None and self._sup is not None:
            self._sup.kill(self._info.name, sig)
