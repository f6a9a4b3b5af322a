"""Helpers of the integration tests."""

from __future__ import annotations

from pathlib import Path

from libs.store import EventLog
from tests.builders import released_event


async def filled_log(path: Path, n: int = 5000) -> EventLog:
    """An event log of ``n`` small releases, appended 500 at a time (a subprocess test opens it too)."""
    event_log = await EventLog.open(path)
    for start in range(0, n, 500):
        await event_log.append([released_event(i, pods=50) for i in range(start, start + 500)])
    return event_log
