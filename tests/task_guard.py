"""Fail a test run on asyncio's "Task exception was never retrieved" (issue 16).

asyncio reports a task that ended in an exception nobody awaited only when the task is freed,
through the event loop's exception handler, which logs it on the ``asyncio`` logger. The guard
listens there: a test during which one is logged fails in its teardown, and the session ends
with a ``gc.collect()`` so tasks freed only by the cycle collector are caught too.
"""

from __future__ import annotations

import logging

NEVER_RETRIEVED = "exception was never retrieved"


class UnretrievedTaskLog(logging.Handler):
    """Collects asyncio's never-retrieved reports; ``take()`` hands them over once."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self._seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if NEVER_RETRIEVED in message:
            exc = record.exc_info[1] if record.exc_info else None
            self._seen.append(f"{message}: {type(exc).__name__ if exc else '?'}: {exc}")

    def take(self) -> list[str]:
        seen, self._seen = self._seen, []
        return seen

    def install(self) -> None:
        logging.getLogger("asyncio").addHandler(self)
