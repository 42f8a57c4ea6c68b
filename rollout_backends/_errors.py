"""The exception tree of ``rollout_backends``.

Every error this library raises derives from :class:`RolloutBackendError`. The tree::

    RolloutBackendError
    ├── TransientError            retryable: the same call may succeed if sent again
    │   ├── BackendTimeout        no answer within the timeout
    │   ├── ConnectionFailed      could not connect / connection dropped before an answer
    │   ├── Overloaded            the server said "busy" (HTTP 429/503 while serving)
    │   └── NoCompatibleVersion   no worker serves a version the request accepts (min/exact version); nothing sent
    ├── BackendUnavailable        a worker or the whole fleet is down (after retries, or none registered)
    │   └── BackendClosed         the backend was closed (``aclose``): no call reaches an engine again
    ├── InvalidRequest            the caller's input is wrong; ``.field`` names the offending field
    ├── Aborted                   a generation ended by abort, where the caller asked to treat that as an error
    ├── ControlFailed             a control call (pause, flush, update, ...) failed on one or more workers
    │   └── WeightUpdateFailed    a ``weight_update`` transaction failed; the version was not advanced
    ├── StaleWeights              a worker serves another weight version than expected
    ├── ContractViolation         a server answered something that breaks the protocol (never padded or guessed)
    └── Unsupported               the backend does not declare the capability this call needs

Rules the adapters follow:

* ``TransientError`` means the same call may succeed if sent again. The HTTP transport never
  resends a ``generate`` that may have produced tokens (a timeout, a connection lost after
  sending); only errors with ``nothing_generated=True`` (no engine started the request), where
  the caller opted in (``RetryPolicy(generate_resends=N)``). A generation cut off by a lost worker
  is resent by the fleet *whole*, as a fresh generation with the same request id
  (``WorkerLossPolicy``, on by default; never spliced onto the lost attempt's tokens, never after
  a timeout). See ``docs/errors.md`` and ``docs/reliability.md``.
* ``ControlFailed.failures`` names each worker and step that failed; an error never names fewer
  workers than failed.
* Secrets (API keys) never appear in messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

__all__ = [
    "BackendClosed",
    "Aborted",
    "BackendTimeout",
    "BackendUnavailable",
    "ConnectionFailed",
    "ContractViolation",
    "ControlFailed",
    "InvalidRequest",
    "NoCompatibleVersion",
    "Overloaded",
    "RolloutBackendError",
    "StaleWeights",
    "TransientError",
    "Unsupported",
    "WeightUpdateFailed",
    "WorkerFailure",
]


class RolloutBackendError(Exception):
    """Root of every error raised by ``rollout_backends``."""

    #: Whether sending the same call again may succeed.
    retryable: bool = False


class TransientError(RolloutBackendError):
    """A failure that may go away if the same request is sent again."""

    retryable = True

    def __init__(self, message: str, *, worker: str | None = None, nothing_generated: bool = False) -> None:
        super().__init__(message)
        self.worker = worker
        #: True only when the failure guarantees that no engine started this request (the
        #: connection was refused before anything was sent; a router or frontend answered that it
        #: could not reach any worker). Such a ``generate`` can be resent without double-counting.
        self.nothing_generated = nothing_generated


class BackendTimeout(TransientError):
    """No complete answer arrived within the configured timeout."""


class ConnectionFailed(TransientError):
    """The connection could not be made, or broke before an answer arrived."""


class Overloaded(TransientError):
    """The server answered that it is busy (HTTP 429, or 503 from a serving worker).

    Inside a driver it also marks a command an engine refused only because it was busy, having
    done nothing (an immediate flush with requests still running): the driver sends the command
    again while it may wait, then raises ``ControlFailed`` with the engine's words."""


class NoCompatibleVersion(TransientError):
    """No worker the request could go to serves a version it accepts (``GenerateRequest.min_version``
    / ``exact_version``), so nothing was sent (``nothing_generated`` is always true).

    Retryable: once a worker is updated to (or still serves) an accepted version, the same request
    can succeed; Miles' external rollout service answers the same way (``docs/advanced/
    disaggregated-rollout.md`` in radixark/miles at 31f1ca961a94). ``served`` maps each worker to
    the label it serves as far as the fleet knows; ``history`` is the fleet's order of labels.
    """

    def __init__(
        self,
        *,
        min_version: str | None,
        exact_version: str | None,
        served: Mapping[str, str | None],
        history: Sequence[str] = (),
        reason: str = "no worker serves an accepted version",
    ) -> None:
        self.min_version = min_version
        self.exact_version = exact_version
        self.served = dict(served)
        self.history = tuple(history)
        want = " and ".join(
            f"{name}={v!r}" for name, v in (("min_version", min_version), ("exact_version", exact_version)) if v
        )
        detail = ", ".join(f"{w}={v!r}" for w, v in self.served.items())
        super().__init__(f"{reason} ({want}); workers serve: {detail}", nothing_generated=True)


class BackendUnavailable(RolloutBackendError):
    """A worker, or the whole fleet, cannot serve: it is down, unreachable after retries, or absent."""

    def __init__(self, message: str, *, worker: str | None = None) -> None:
        super().__init__(message)
        self.worker = worker


class BackendClosed(BackendUnavailable):
    """A call on a backend after its ``aclose()``: its client (and any fleet it launched) is gone.

    Before this error a closed HTTP fleet still generated through a fresh connection pool
    (issue 16); a closed backend now refuses every call that would reach an engine."""


class InvalidRequest(RolloutBackendError):
    """The caller's input is invalid. ``field`` names the offending field (dotted path)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class Aborted(RolloutBackendError):
    """A generation was aborted, where the caller asked for that to be an error."""

    def __init__(self, request_id: str, message: str = "request was aborted") -> None:
        super().__init__(f"{request_id}: {message}")
        self.request_id = request_id


@attrs.frozen(slots=True)
class WorkerFailure:
    """One failed step on one worker."""

    worker: str
    step: str
    message: str

    def __str__(self) -> str:
        return f"{self.worker} [{self.step}]: {self.message}"


class ControlFailed(RolloutBackendError):
    """A control call failed on one or more workers; ``failures`` names each one."""

    def __init__(self, operation: str, failures: Sequence[WorkerFailure]) -> None:
        self.operation = operation
        self.failures: tuple[WorkerFailure, ...] = tuple(failures)
        detail = "; ".join(str(f) for f in self.failures) or "no detail"
        super().__init__(f"{operation} failed: {detail}")

    @property
    def workers(self) -> tuple[str, ...]:
        """The workers that failed, in order, without repeats."""
        return tuple(dict.fromkeys(f.worker for f in self.failures))


class WeightUpdateFailed(ControlFailed):
    """A weight-update transaction failed. Every paused worker was resumed; the version was not advanced.

    ``failures`` names each worker and the step (``pause``, ``flush_cache``, ``begin``, ``update``,
    ``set_version``, ``end``, ``resume``) that failed. ``version`` is the version that was *not*
    installed; ``previous`` what the workers serve instead.
    """

    def __init__(
        self,
        failures: Sequence[WorkerFailure],
        *,
        version: str,
        previous: str | None,
    ) -> None:
        super().__init__(f"weight update to version {version!r}", failures)
        self.version = version
        self.previous = previous

    @property
    def steps(self) -> tuple[str, ...]:
        """The steps that failed, in order, without repeats."""
        return tuple(dict.fromkeys(f.step for f in self.failures))


class StaleWeights(RolloutBackendError):
    """Workers serve different weight versions (``weight_version()``).

    ``expected`` is the fleet's expected version (``None`` where none is declared and the labels
    disagree), not a guess from what most workers serve; ``served`` maps each worker to its version.
    """

    def __init__(self, expected: str | None, served: dict[str, str | None]) -> None:
        self.expected = expected
        self.served = dict(served)
        detail = ", ".join(f"{w}={v!r}" for w, v in self.served.items())
        want = f"expected weight version {expected!r}" if expected is not None else "no expected weight version"
        super().__init__(f"workers disagree ({want}); they serve: {detail}")


class ContractViolation(RolloutBackendError):
    """A server's answer breaks the protocol (missing fields, misaligned logprobs, bad types)."""

    def __init__(self, message: str, *, worker: str | None = None) -> None:
        super().__init__(message if worker is None else f"{worker}: {message}")
        self.worker = worker


class Unsupported(RolloutBackendError):
    """The backend does not declare the capability this call needs."""

    def __init__(self, capability: str, message: str = "") -> None:
        super().__init__(f"unsupported: {capability}" + (f" ({message})" if message else ""))
        self.capability = capability
