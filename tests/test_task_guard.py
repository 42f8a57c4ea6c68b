"""The never-retrieved guard sees what asyncio reports, and only that."""

from __future__ import annotations

import asyncio
import gc
import logging

from tests.task_guard import UnretrievedTaskLog


def _run_and_drop(awaited: bool) -> None:
    async def boom() -> None:
        raise RuntimeError("lost")

    async def main() -> None:
        task = asyncio.ensure_future(boom())
        await asyncio.sleep(0.01)
        if awaited:
            assert isinstance(task.exception(), RuntimeError)

    asyncio.run(main())
    gc.collect()


def test_an_unawaited_failed_task_is_caught() -> None:
    asyncio_log = logging.getLogger("asyncio")
    session_guards = [h for h in asyncio_log.handlers if isinstance(h, UnretrievedTaskLog)]
    for h in session_guards:  # this test's lost task is on purpose: the run's own guard looks away
        asyncio_log.removeHandler(h)
    log = UnretrievedTaskLog()
    log.install()
    try:
        _run_and_drop(awaited=False)
        seen = log.take()
        assert len(seen) == 1 and "RuntimeError: lost" in seen[0]
        _run_and_drop(awaited=True)
        assert log.take() == []
    finally:
        asyncio_log.removeHandler(log)
        for h in session_guards:
            asyncio_log.addHandler(h)
