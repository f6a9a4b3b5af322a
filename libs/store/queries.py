"""Small reads from the event loop: the outbox relay's "events after seq N", a command's events.

One long-lived read-only aiosqlite connection, owned here and closed by ``close()`` (EventLog.close).
Its worker thread is not a daemon, so its lifetime is tied to that one call, never to a reader's task:
a reader cancelled mid-query only drops its result (the thread finishes the query, which runs and
fetches in one call, and the connection stays usable); ``close()`` queues the thread's end before it
awaits anything, so even a cancelled close ends it. Bulk replay does not come here (see replay.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import aiosqlite

from libs.errors import StoreError
from libs.events.codec import StoredEvent
from libs.store.layout import RAW_ROWS, Layout, spell_rows
from libs.store.rows import COLUMNS, row_to_stored

__all__ = ["LogQueries"]


class LogQueries:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: aiosqlite.Connection | None = None
        self._opening = asyncio.Lock()
        self._closed = False
        self._layout: Layout | None = None
        self._types: dict[int, str] = {}

    async def _connection(self) -> aiosqlite.Connection:
        async with self._opening:
            if self._closed:
                raise StoreError(f"the event log {self.path} is closed")
            if self._conn is None:
                # A cancelled open stops its own thread (aiosqlite does so on any error in connect).
                conn = await aiosqlite.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None)
                if self._closed:  # closed while opening
                    conn.stop()
                    raise StoreError(f"the event log {self.path} is closed")
                self._conn = conn
                await conn.execute("PRAGMA busy_timeout=5000")
            return self._conn

    async def _rows(self, sql: str, args: tuple[Any, ...]) -> list[StoredEvent]:
        conn = await self._connection()
        rows = await conn.execute_fetchall(sql, args)
        return [row_to_stored(r, self.path) for r in rows]

    async def read_after(self, after_seq: int, limit: int = 512) -> list[StoredEvent]:
        """The relay's read (it sends the hash too). Format 2: the table itself, as the scans read it
        (libs/store/layout.py), with the type names known here, read again when a row names a new one."""
        conn = await self._connection()
        if self._layout is None:
            found = await conn.execute_fetchall("SELECT value FROM meta WHERE key = 'format'")
            self._layout = Layout(found[0][0] if found else "1")
        if self._layout.format == "1":
            return await self._rows(f"SELECT {COLUMNS}, hash FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
                                    (after_seq, limit))
        rows = list(await conn.execute_fetchall(f"{RAW_ROWS} WHERE seq > ? ORDER BY seq LIMIT ?", (after_seq, limit)))
        if any(row[4] not in self._types for row in rows):  # types only grow: a row's type is there once the row is
            self._types = dict(await conn.execute_fetchall("SELECT id, name FROM types"))  # type: ignore[arg-type]
        spell_rows(rows, self._types)
        return [row_to_stored(r, self.path) for r in rows]

    async def by_command(self, command_id: str) -> list[StoredEvent]:
        """The events a command appended (the ``events_command`` index), in seq order."""
        sql = f"SELECT {COLUMNS} FROM events WHERE command_id = ? ORDER BY seq"
        return await self._rows(sql, (command_id,))

    async def close(self) -> None:
        """End the connection and its thread, after any query it is still running.

        ``stop()`` queues the close and the thread's end synchronously, so nothing here can be
        cancelled half-way; the wait for it is only so the thread is gone when this returns.
        """
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is None:
            return
        done = conn.stop()
        if done is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(done), CLOSE_WAIT_S)


CLOSE_WAIT_S = 10.0
