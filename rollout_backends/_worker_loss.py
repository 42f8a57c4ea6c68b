"""What a fleet does with a generation cut off because its worker was lost.

A worker killed mid-request (SIGKILL, OOM, a node gone) leaves the requests it was running
without an answer: the caller sees ``ConnectionFailed`` or ``BackendUnavailable``. An RL step
wants every sample, so by default the fleet **resends the request as a fresh generation**: the
same request id, sampling and prompt, on whichever worker the entry picks next. Nothing is counted
twice: the lost attempt's tokens never reached the caller, and the answer that does is one whole
generation by one worker (its ``weight_version`` and ``worker`` say which). It is never spliced
onto the lost attempt's partial tokens: continuing on another worker (Dynamo's
``--migration-limit``) could join tokens of two weight versions, which is why the Dynamo launcher
keeps migration at 0.

Resent: ``ConnectionFailed``, ``BackendUnavailable`` and ``Overloaded`` (ai-dynamo 1.6.1 answers
a request that was running on a worker when it died with HTTP 503; a server that is merely busy
gets the same request again only after the policy's backoff). Not resent: pinned requests (the
pinned worker is the one lost), timeouts (the timeout is the whole call's budget: a hung worker
must not multiply it), a closed backend, input errors, and a request the caller aborted meanwhile.

Measured (issue 17): SIGKILL of 1 of 3 Dynamo 1.4.2 mocker workers under load left 3 requests
failed with ``BackendUnavailable`` before this policy; ``tests/reliability`` now requires none.
"""

from __future__ import annotations

import enum

import attrs

from rollout_backends._errors import InvalidRequest

__all__ = ["WorkerLoss", "WorkerLossPolicy"]


class WorkerLoss(enum.Enum):
    """The action on a generation whose worker was lost mid-request."""

    #: The typed error reaches the caller (``ConnectionFailed`` / ``BackendUnavailable``).
    FAIL = "fail"
    #: Resend as a fresh generation (same request id; the lost attempt's partial tokens discarded).
    RESEND = "resend"


@attrs.frozen(slots=True, kw_only=True)
class WorkerLossPolicy:
    """``Fleet.worker_loss``: resend cut-off generations up to ``resends`` times (the default).

    A resend waits ``backoff_s`` doubling up to ``max_backoff_s`` first: a router may keep routing
    to a dead worker for a while (Dynamo 1.4.2 until its discovery lease expires, ~10 s; each
    resend then has a 1-in-N chance of landing there again on N workers), so the default allows
    12 resends (about 5 s of waiting in all).
    """

    action: WorkerLoss = WorkerLoss.RESEND
    resends: int = 12
    backoff_s: float = 0.05
    max_backoff_s: float = 0.5

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.action, WorkerLoss):
            raise InvalidRequest("action", f"must be a WorkerLoss, got {self.action!r}"[:200])
        if isinstance(self.resends, bool) or not isinstance(self.resends, int) or self.resends < 0:
            raise InvalidRequest("resends", f"must be an int >= 0, got {self.resends!r}"[:200])
        for name in ("backoff_s", "max_backoff_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 60.0:
                raise InvalidRequest(name, f"must be seconds in [0, 60], got {v!r}"[:200])

    @property
    def resends_lost(self) -> bool:
        return self.action is WorkerLoss.RESEND and self.resends > 0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before resend number ``attempt`` (1-based)."""
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))


#: Fleets resend cut-off generations unless told otherwise.
DEFAULT_WORKER_LOSS = WorkerLossPolicy()
