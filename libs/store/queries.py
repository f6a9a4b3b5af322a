"""Small reads from the event loop: the outbox relay's "events after seq N", a command's events.

Each query runs in a worker thread on its own short-lived read-only connection, opened and closed
inside that thread. A caller cancelled mid-query (a service stopping) therefore never leaves a
connection, or a connection thread, behind: the thread finishes the query, closes, and is done.
(An aiosqlite connection left open by a cancelled task keeps its non-daemon thread alive and the
process from exiting.) Bulk replay does not come here (see replay.py).
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

from libs.events.codec import StoredEvent
from libs.store.rows import COLUMNS, row_to_stored

__all__ = ["LogQueries"]


class LogQueries:
    def __init__(self, path: Path) -> None:
        self.path = path

    def _rows(self, sql: str, args: tuple[Any, ...]) -> list[StoredEvent]:
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None)
        try:
            conn.execute("PRAGMA busy_timeout=5000")
            return [row_to_stored(r) for r in conn.execute(sql, args).fetchall()]
        finally:
            conn.close()

    async def read_after(self, after_seq: int, limit: int = 512) -> list[StoredEvent]:
        sql = f"SELECT {COLUMNS} FROM events WHERE seq > ? ORDER BY seq LIMIT ?"
        return await asyncio.to_thread(self._rows, sql, (after_seq, limit))

    async def by_command(self, command_id: str) -> list[StoredEvent]:
        """The events a command appended (the ``events_command`` index), in seq order."""
        sql = f"SELECT {COLUMNS} FROM events WHERE command_id = ? ORDER BY seq"
        return await asyncio.to_thread(self._rows, sql, (command_id,))

    async def close(self) -> None:
        """Nothing stays open between queries; kept so callers need not know."""
