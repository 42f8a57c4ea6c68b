"""``BackendBase``: the protocol methods every backend gets for free from its primitives."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import TypeVar

from rollout_backends._errors import InvalidRequest, Unsupported
from rollout_backends._fleet import fan_out
from rollout_backends._transaction import WeightUpdateTransaction, wait_ready, weight_update
from rollout_backends._types import Capabilities, HealthReport, PauseMode, WeightTransport
from rollout_backends._versions import VersionBook

__all__ = ["BackendBase", "fan_out"]

_T = TypeVar("_T")
_B = TypeVar("_B", bound="BackendBase")


class BackendBase:
    """Shared behaviour: the transaction, fleet version, readiness, selection, async context.

    Subclasses implement the primitive protocol methods, set ``capabilities`` and ``workers``, and
    make ``_versions`` in ``__init__``; they call ``_versions.relabelled`` after each relabelling
    operation succeeds and judge staleness with ``VersionBook.is_stale``.
    """

    capabilities: Capabilities
    #: Installed labels and the expected version: the version rule, kept in one place.
    _versions: VersionBook

    @property
    def workers(self) -> tuple[str, ...]:  # pragma: no cover - overridden
        raise NotImplementedError

    def _select(self, workers: Sequence[str] | None) -> tuple[str, ...]:
        """Validate a worker selection; ``None`` = all."""
        if workers is None:
            return self.workers
        if isinstance(workers, (str, bytes)) or not isinstance(workers, (list, tuple)):
            raise InvalidRequest("workers", f"must be a list of worker ids or None, got {type(workers).__name__}")
        known = set(self.workers)
        for i, w in enumerate(workers):
            if not isinstance(w, str) or w not in known:
                raise InvalidRequest(f"workers[{i}]", f"unknown worker {w!r} (known: {sorted(known)})")
        return tuple(workers)

    def _require_pause_mode(self, mode: PauseMode | str) -> PauseMode:
        try:
            m = PauseMode(mode)
        except (ValueError, TypeError):
            raise InvalidRequest("mode", f"unknown pause mode {mode!r}") from None
        if m not in self.capabilities.pause_modes:
            raise Unsupported(f"pause_mode.{m.value}")
        return m

    def _require_transport(self, transport: WeightTransport) -> None:
        if transport not in self.capabilities.weight_transports:
            raise Unsupported(f"weight_transport.{transport.value}")

    def weight_update(
        self, version: str, *, mode: PauseMode = PauseMode.RETRACT, selector: str = "all"
    ) -> AbstractAsyncContextManager[WeightUpdateTransaction]:
        """A weight-update transaction; see :func:`rollout_backends.weight_update`."""
        self._require_pause_mode(mode)
        return weight_update(self, version, mode=mode, selector=selector)  # type: ignore[arg-type]

    def expect_version(self, version: str | None) -> None:
        """Declare the version every worker should serve (see ``RolloutBackend.expect_version``)."""
        self._versions.declare(version)

    async def weight_versions(self) -> Mapping[str, str | None]:  # pragma: no cover - overridden
        raise NotImplementedError

    async def weight_version(self) -> str | None:
        return self._versions.fleet_version(await self.weight_versions())

    async def health(self, *, probe: bool = False) -> HealthReport:  # pragma: no cover - overridden
        raise NotImplementedError

    async def wait_ready(self, timeout: float = 60.0) -> HealthReport:
        return await wait_ready(self, timeout)  # type: ignore[arg-type]

    async def aclose(self) -> None:
        return None

    async def __aenter__(self: _B) -> _B:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} workers={list(self.workers)}>"
