"""EventLog: the append-only allocation log as the allocator uses it.

    event_log = await EventLog.open(path)
    stored = await event_log.append([event, ...], command_id=request_id)   # durable when it returns
    last = await event_log.replay(state.apply)                               # rebuild state
    event_log.on_commit(callback)                                            # wake the outbox relay
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path

from libs.errors import StartRefused, StoreError
from libs.events.codec import StoredEvent
from libs.events.schema import Event
from libs.placement.recorded import ResponseSettings
from libs.store.format import LOG_FORMAT_VERSION, READABLE_FORMATS
from libs.store.queries import LogQueries
from libs.store.replay import replay, unreadable
from libs.store.schema import CATALOG_DDL, FORMAT_2_DDL, archive_triggers
from libs.store.writer import LogWriter, connect

__all__ = ["EventLog", "create_schema", "writer_lock"]


def create_schema(path: Path) -> None:
    """Create the tables and triggers if absent (a new log is format 2); a format 1 log stays as it is,
    read and appended to in its own format (``libs.store.layout``); another format is refused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        conn = connect(path)  # WAL is persistent: set before anything is written
        try:
            found = _format_of(conn)
            if found in READABLE_FORMATS and _archiving_guarded(conn):
                return  # created before, in a format read here: nothing to do
            conn.execute("BEGIN IMMEDIATE")
            try:
                _create(conn, path)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise unreadable(path, exc) from exc


def _create(conn: sqlite3.Connection, path: Path) -> None:
    """Inside one transaction: the catalog, then a new log's rows, or an older log's missing guards."""
    has_events = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'events'").fetchone() is not None
    for ddl in CATALOG_DDL:
        conn.execute(ddl)
    found = _format_of(conn)  # again, under the write lock: another creator may have been first
    if found is None and has_events:
        found = "1"  # a format 1 log written before ``meta`` recorded the format
    if found is None:
        for ddl in FORMAT_2_DDL:
            conn.execute(ddl)
        conn.execute("INSERT INTO meta (key, value) VALUES ('format', ?)", (LOG_FORMAT_VERSION,))
        found = LOG_FORMAT_VERSION
    elif found not in READABLE_FORMATS:
        raise StoreError(f"{path} is log format {found}; this gpuledger reads formats {', '.join(READABLE_FORMATS)}")
    _guard_archiving(conn, archive_triggers("events" if found == "1" else "rows"))


def _format_of(conn: sqlite3.Connection) -> str | None:
    """The log format recorded in ``meta``; None when the file has no such table or row yet."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() is None:
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
    return row[0] if row else None


def _archiving_guarded(conn: sqlite3.Connection) -> bool:
    """Whether the log already has the archive catalog and the guarded DELETE trigger (else migrate)."""
    row = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = 'events_no_delete'").fetchone()
    has_catalog = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'archive_segments'").fetchone() is not None
    return has_catalog and row is not None and "archive_segments" in row[0]


def _guard_archiving(conn: sqlite3.Connection, triggers: Sequence[str]) -> None:
    """The archive catalog's triggers, and DELETE allowed only for archived rows (schema.py).

    A log written before archiving existed has an unconditional DELETE trigger: it is replaced, in
    the same transaction, by the guarded one (still refusing every DELETE until a segment is recorded).
    """
    old = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = 'events_no_delete'").fetchone()
    if old is not None and "archive_segments" not in old[0]:
        conn.execute("DROP TRIGGER events_no_delete")
    for ddl in triggers:
        conn.execute(ddl)


def writer_lock(path: Path) -> int:
    """Hold ``<log>.lock`` for as long as the returned fd is open: one writer per log, ever.

    The allocator holds it while it runs; ``import-checkpoint`` takes it too, so it never writes under
    a running allocator. The kernel drops it when the holder dies, so a crash leaves nothing to clean.
    """
    lock_path = Path(f"{path}.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise StartRefused(f"the state dir {path.parent} is read-only ({exc.strerror}): the log {path} "
                               "must be writable; mount it read-write") from None
        raise StartRefused(f"cannot open the log's lock file {lock_path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StartRefused(f"another process is writing {path} (it holds {lock_path}): is the allocator "
                           "running? Stop it first.") from None
    return fd


class EventLog:
    def __init__(self, path: Path, response_settings: ResponseSettings | None = None, *, inline: bool = False) -> None:
        self.path = path
        self._lock_fd: int | None = None
        self._listeners: list[Callable[[int], None]] = []
        self._event_listeners: list[Callable[[list[StoredEvent]], None]] = []
        self._writer = LogWriter(path, on_commit=self._committed, response_settings=response_settings, inline=inline)
        self.queries = LogQueries(path)

    @classmethod
    async def open(cls, path: str | Path, *, response_settings: ResponseSettings | None = None,
                   inline: bool = False) -> EventLog:
        """``response_settings``: what the responses of the grants appended are built with (their
        stored form omits a response these settings reproduce; without them every response is kept).
        ``inline``: commit on the caller's event loop instead of a writer thread (libs/store/writer.py)."""
        path = Path(path)
        event_log = cls(path, response_settings, inline=inline)
        event_log._lock_fd = writer_lock(path)  # first: a second writer, a read-only dir, are refused in one line
        try:
            await asyncio.to_thread(create_schema, path)
            await asyncio.to_thread(event_log._writer.start, asyncio.get_running_loop())
        except BaseException:
            event_log._unlock()
            raise
        return event_log

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def last_seq(self) -> int:
        return self._writer.last_seq

    async def append(self, events: Sequence[Event], *, command_id: str | None = None) -> list[StoredEvent]:
        return await self._writer.append(events, command_id=command_id)

    async def read_after(self, after_seq: int, limit: int = 512) -> list[StoredEvent]:
        return await self.queries.read_after(after_seq, limit)

    async def replay(self, fold: Callable[[StoredEvent], object], *, upto_seq: int | None = None) -> int:
        return await asyncio.to_thread(replay, self.path, fold, upto_seq=upto_seq)

    def on_commit(self, callback: Callable[[int], None]) -> None:
        """``callback(last_seq)`` runs on the event loop after each commit."""
        self._listeners.append(callback)

    def on_events(self, callback: Callable[[list[StoredEvent]], None]) -> None:
        """``callback(events)`` gets each commit's new events, in seq order, on the event loop."""
        self._event_listeners.append(callback)

    def _committed(self, last_seq: int, fresh: list[StoredEvent]) -> None:
        for ecb in self._event_listeners:
            ecb(fresh)
        for cb in self._listeners:
            cb(last_seq)

    async def close(self) -> None:
        # Each step runs even if an earlier one fails or the closing task is cancelled: the reader's
        # thread would otherwise keep the process alive.
        try:
            await asyncio.to_thread(self._writer.stop)
        finally:
            try:
                await self.queries.close()
            finally:
                self._unlock()
