"""CPU weight broadcast over a private gloo group: the trainer side, and the group both sides open.

SGLang's distributed refit is "trainer is rank 0 of a fresh torch.distributed group, engines join
at ``rank_offset + i``, tensors arrive by ``broadcast(src=0)`` in bucket order". The reference
engine does the same over gloo, but builds the group from a ``TCPStore`` + ``PrefixStore`` +
``ProcessGroupGloo`` instead of ``init_process_group``: that touches no global default group, so a
trainer and several engines can live in one process (tests) or in many (real use).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import attrs

from rollout_backends import WeightBucket

__all__ = ["GlooGroup", "WeightSender", "free_port", "open_gloo_group", "torch_dtype"]

_DTYPES = ("float32", "float16", "bfloat16", "float64")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and read it back).

    There is an unavoidable race with other processes; good enough for tests and single hosts.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def torch_dtype(name: str) -> Any:
    """``"bfloat16"`` / ``"torch.bfloat16"`` → ``torch.bfloat16``; ``ValueError`` for anything else."""
    import torch

    short = name[len("torch.") :] if name.startswith("torch.") else name
    if short not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (supported: {list(_DTYPES)})")
    return getattr(torch, short)


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


@attrs.define(slots=True, eq=False)
class GlooGroup:
    """One rank's membership in a private gloo group (keeps the store alive with the group)."""

    name: str
    rank: int
    world_size: int
    store: Any
    pg: Any

    def broadcast(self, tensor: Any, *, src: int = 0) -> None:
        """Blocking broadcast of one contiguous CPU tensor from ``src`` (in place on receivers)."""
        self.pg.broadcast(tensor, src).wait()

    def close(self) -> None:
        """Shut the group down; safe to call twice."""
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            with contextlib.suppress(Exception):  # a peer already gone: nothing left to release
                pg.shutdown()
        self.store = None


def open_gloo_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    *,
    timeout_s: float = 300.0,
) -> GlooGroup:
    """Join (rank 0: host) the group; blocks until every rank has joined or ``timeout_s`` passes.

    Rank 0 runs the ``TCPStore`` server on ``master_port``, like ``init_process_group`` with a
    ``tcp://`` init method. On a loopback address the gloo device is bound to 127.0.0.1, so it
    works in sandboxes whose hostname does not resolve.
    """
    import torch.distributed

    dist: Any = torch.distributed  # TCPStore & co. are not in torch's typed exports
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
    )
    prefixed = dist.PrefixStore(f"rollout_backends/{group_name}", store)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    if _is_loopback(master_address):
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    return GlooGroup(name=group_name, rank=rank, world_size=world_size, store=store, pg=pg)


class WeightSender:
    """The trainer (rank 0) side of a gloo weight-update group.

    Usage, with the engines joining concurrently (their ``init_weight_group`` blocks until rank 0
    is there, and ``connect`` blocks until every engine is)::

        sender = WeightSender("127.0.0.1", port, world_size=1 + n_engines)
        await asyncio.gather(asyncio.to_thread(sender.connect), backend.init_weight_group(group))
        bucket = WeightBucket.from_named_tensors(named)
        await asyncio.gather(asyncio.to_thread(sender.broadcast, named),
                             backend.update_weights_from_distributed(bucket))
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str = "weight_update_group",
        *,
        timeout_s: float = 300.0,
    ) -> None:
        if world_size < 2:
            raise ValueError(f"world_size must be >= 2 (trainer + engine), got {world_size}")
        self.master_address = master_address
        self.master_port = int(master_port)
        self.world_size = world_size
        self.group_name = group_name
        self.timeout_s = timeout_s
        self._group: GlooGroup | None = None
        self._lock = threading.Lock()

    @property
    def connected(self) -> bool:
        return self._group is not None

    def connect(self) -> None:
        """Open the group as rank 0 (blocking). Idempotent."""
        with self._lock:
            if self._group is None:
                self._group = open_gloo_group(
                    self.master_address,
                    self.master_port,
                    0,
                    self.world_size,
                    self.group_name,
                    timeout_s=self.timeout_s,
                )

    def broadcast(self, named_tensors: Sequence[tuple[str, Any]]) -> WeightBucket:
        """Broadcast the tensors in order (blocking) and return the bucket the receivers need.

        Tensors are sent as they are (dtype and shape), moved to CPU and made contiguous first.
        """
        with self._lock:
            if self._group is None:
                raise RuntimeError("WeightSender.connect() first")
            bucket = WeightBucket.from_named_tensors(named_tensors)
            for _, t in named_tensors:
                self._group.broadcast(t.detach().to("cpu").contiguous(), src=0)
            return bucket

    def close(self) -> None:
        """Leave the group. Idempotent."""
        with self._lock:
            group, self._group = self._group, None
        if group is not None:
            group.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
