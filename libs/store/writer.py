"""The log's only writer: one connection, group commit on a thread, or commits on the caller's loop.

Callers on the event loop ``await append(events)``; it returns once the events are on disk: written in
one ``BEGIN IMMEDIATE ... COMMIT`` with ``synchronous=FULL``. Each caller's events are atomic (a
SAVEPOINT each when several share a commit): one failing request does not fail its neighbours in a
group. The writer assigns ``seq``, ``recorded_at`` (clamped so it never goes backwards), per-stream
``version`` and the chain hash.

Two ways to commit, chosen when the writer is made:
- on a thread (the default): it takes everything queued (up to MAX_BATCH events) and commits it as one
  group, so concurrent appenders share an fsync;
- inline (``inline=True``): ``append`` commits on the caller's thread before it returns, with no
  hand-off to a thread and back (two wake-ups and a GIL hand-over each way, ~1 ms of the allocator's
  1.5 ms append on a busy 2-CPU node). For a caller whose appends are serialised anyway (the
  allocator's ledger lock), group commit never groups anything; the price is that the caller's event
  loop waits out the fsync (SQLite releases the GIL meanwhile, so other threads run).

A request with a ``command_id`` that is already in the log is not written again: its original events
are returned, so a caller that retries after a lost reply appends exactly once.
"""

from __future__ import annotations

import asyncio
import queue
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from libs.errors import AppendOnlyViolation, NoSpace, StoreError
from libs.events.codec import StoredEvent
from libs.events.schema import Event
from libs.placement.recorded import ResponseSettings
from libs.store.archive import heads_path, stream_head
from libs.store.compact import remember, settings_row
from libs.store.layout import Layout, layout_of
from libs.store.rows import COLUMNS, GENESIS_HASH, chain_hash, event_row, row_to_stored

__all__ = ["LogWriter"]

MAX_BATCH = 512


@dataclass(slots=True)
class _Request:
    events: Sequence[Event]
    command_id: str | None
    # where the writer thread answers (an inline commit answers by returning)
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future[list[StoredEvent]] | None = None


_STOP = object()
_Result = list[StoredEvent] | BaseException  # one request's stored events, or why it was not written


def _resolve(fut: asyncio.Future[list[StoredEvent]], result: _Result) -> None:
    if fut.done():  # the caller gave up waiting; the outcome is in the log either way
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


class LogWriter:
    def __init__(
        self,
        path: Path,
        *,
        on_commit: Callable[[int, list[StoredEvent]], None] | None = None,
        clock: Callable[[], int] = time.time_ns,
        response_settings: ResponseSettings | None = None,
        inline: bool = False,
    ) -> None:
        self.path = path
        self.inline = inline
        self._settings = response_settings
        self._on_commit = on_commit
        self._clock = clock
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="eventlog-writer", daemon=True)
        self._conn: sqlite3.Connection | None = None
        self._layout = Layout("2")
        self._loop: asyncio.AbstractEventLoop | None = None
        self.last_seq = 0
        self._last_at = 0
        self._last_hash = GENESIS_HASH
        self._versions: dict[str, int] = {}
        self._heads: sqlite3.Connection | None = None  # stream heads of archived rows, once there are any
        self._heads_file = str(heads_path(path))
        self._stopped = False

    # --- lifecycle ---
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._conn = connect(self.path)
        self._layout = layout_of(self._conn)
        self._record_settings()
        self._load_tail()
        if not self.inline:
            self._thread.start()

    def _load_tail(self) -> None:
        assert self._conn
        row = self._conn.execute(
            "SELECT seq, recorded_at, hash FROM events ORDER BY seq DESC LIMIT 1"
        ).fetchone()
        self.last_seq, self._last_at, self._last_hash = row if row else (0, 0, GENESIS_HASH)
        # Stream versions are looked up when a stream is first written (an index probe), not all at start:
        # a million-event log has hundreds of thousands of pod streams and start-up must stay fast.
        self._versions = {}

    def _record_settings(self) -> None:
        """Put the response settings in ``meta`` (once per distinct settings, content addressed), so that
        every reader can reproduce the responses of the grants written under them."""
        if self._settings is None:
            return
        assert self._conn
        remember(self._settings)
        self._conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", settings_row(self._settings))

    def _stream_version(self, stream: str) -> int:
        known = self._versions.get(stream)
        if known is None:
            assert self._conn
            live = self._layout.stream_version(self._conn, stream)
            # no live row: the stream may have lived only in archived rows
            row = (live,) if live is not None else self._archived_head(stream)
            known = self._versions[stream] = int(row[0] or 0)
        return known

    def _archived_head(self, stream: str) -> tuple[int | None]:
        if self._heads is None:
            self._heads = stream_head(self._heads_file)
            if self._heads is None:
                return (None,)  # nothing archived yet
        try:
            row = self._heads.execute("SELECT version FROM heads WHERE stream_id = ?", (stream,)).fetchone()
        except sqlite3.OperationalError:  # being created by the first archive right now
            return (None,)
        return row or (None,)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        if self._conn:
            self._conn.close()
            self._conn = None
        if self._heads:
            self._heads.close()
            self._heads = None
        self._stopped = True

    # --- the API used on the event loop ---
    async def append(self, events: Sequence[Event], *, command_id: str | None = None) -> list[StoredEvent]:
        if self._stopped or self._conn is None or not (self.inline or self._thread.is_alive()):
            raise StoreError("the event log writer is not running")
        if not events:
            return []
        loop = asyncio.get_running_loop()
        if self.inline:
            (result,), fresh = self._commit([_Request(events, command_id)])
            self._announce(loop.call_soon, fresh)
            if isinstance(result, BaseException):
                raise result
            return result
        fut: asyncio.Future[list[StoredEvent]] = loop.create_future()
        self._queue.put(_Request(events, command_id, loop, fut))
        return await fut

    # --- the writer thread ---
    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            if item is _STOP:
                break
            assert isinstance(item, _Request)
            group = [item]
            size = len(item.events)
            while size < MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                    break
                assert isinstance(nxt, _Request)
                group.append(nxt)
                size += len(nxt.events)
            results, fresh = self._commit(group)
            for req, result in zip(group, results, strict=True):
                assert req.loop is not None and req.future is not None  # queued by append
                req.loop.call_soon_threadsafe(_resolve, req.future, result)
            if self._loop is not None:
                self._announce(self._loop.call_soon_threadsafe, fresh)

    def _announce(self, schedule: Callable[..., object], fresh: list[StoredEvent] | None) -> None:
        """Tell the commit listener, later on the loop (never within the appender's turn)."""
        if self._on_commit is not None and fresh is not None:
            schedule(self._on_commit, self.last_seq, fresh)

    def _commit(self, group: list[_Request]) -> tuple[list[_Result], list[StoredEvent] | None]:
        """Write ``group`` in one transaction: each request's stored events or its error, in order, and
        the events this commit added (None when the transaction failed as a whole)."""
        conn = self._conn
        assert conn is not None
        seq, at, prev = self.last_seq, self._last_at, self._last_hash
        versions: dict[str, int] = {}
        by_command: dict[str, list[StoredEvent]] = {}
        results: list[_Result] = []
        # A request alone (always so inline) needs no savepoint: two statements fewer per append.
        alone = len(group) == 1
        committed = False
        try:
            conn.execute("BEGIN IMMEDIATE")
            for req in group:
                if req.command_id:
                    earlier = by_command.get(req.command_id) or self._find_command(req.command_id)
                    if earlier:
                        results.append(earlier)
                        continue
                mark = (seq, at, prev, dict(versions))
                try:
                    rows, stored, seq, at, prev = self._encode(req, seq, at, prev, versions)
                except sqlite3.DatabaseError:
                    raise
                except Exception as exc:  # an event that cannot be encoded fails its own append, not the writer
                    seq, at, prev, versions = mark
                    results.append(StoreError(f"event cannot be recorded ({type(exc).__name__}: {exc}); "
                                              "nothing of this append was written"))
                    continue
                if alone:  # the whole transaction: its failure rolls all of it back (below)
                    self._layout.insert(conn, rows)
                else:
                    conn.execute("SAVEPOINT request")
                    try:
                        self._layout.insert(conn, rows)
                        conn.execute("RELEASE request")
                    except sqlite3.DatabaseError as exc:
                        conn.execute("ROLLBACK TO request")
                        conn.execute("RELEASE request")
                        seq, at, prev, versions = mark
                        results.append(_translate(exc, self.path))
                        continue
                results.append(stored)
                if req.command_id:
                    by_command[req.command_id] = stored
            conn.execute("COMMIT")
            committed = True
        except sqlite3.DatabaseError as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            self._load_tail()
            return [_translate(exc, self.path)] * len(group), None
        finally:
            # The types inserted are in the file only when it committed with no savepoint rolled back.
            self._layout.settled(committed and alone)
        fresh: list[StoredEvent] = []  # what this commit added, in seq order (not a retry's old events)
        for result in results:
            if isinstance(result, list):
                for ev in result:
                    if ev.seq > (fresh[-1].seq if fresh else self.last_seq):
                        fresh.append(ev)
        self.last_seq, self._last_at, self._last_hash = seq, at, prev
        self._versions.update(versions)
        return results, fresh

    def _encode(self, req: _Request, seq: int, at: int, prev: bytes, versions: dict[str, int]
                ) -> tuple[list[tuple[object, ...]], list[StoredEvent], int, int, bytes]:
        """``req``'s rows (each with its chain hash) and stored events, numbered on from ``seq``, and the
        seq, time and hash after them; the stream versions they take are written into ``versions``."""
        rows: list[tuple[object, ...]] = []
        stored: list[StoredEvent] = []
        for ev in req.events:
            seq += 1
            at = max(self._clock(), at)
            stream = ev.stream()
            version = (versions.get(stream) or self._stream_version(stream)) + 1
            versions[stream] = version
            event_id = uuid.uuid4().bytes
            row = event_row(seq, at, stream, version, ev, event_id, req.command_id, self._settings)
            prev = chain_hash(prev, row)
            rows.append((*row, prev))
            stored.append(StoredEvent(seq=seq, recorded_at=at, stream_id=stream, version=version,
                                      event_id=event_id.hex(), command_id=req.command_id, event=ev,
                                      row_hash=prev.hex()))
        return rows, stored, seq, at, prev

    def _find_command(self, command_id: str) -> list[StoredEvent]:
        assert self._conn
        rows = self._conn.execute(
            f"SELECT {COLUMNS} FROM events WHERE command_id = ? ORDER BY seq", (command_id,)
        ).fetchall()
        return [row_to_stored(r, self._conn) for r in rows]


def _translate(exc: sqlite3.DatabaseError, path: Path) -> StoreError:
    text = str(exc)
    if "append-only" in text:
        return AppendOnlyViolation(text)
    # A full disk is SQLITE_FULL (ENOSPC while writing the WAL or growing the file). The transaction is
    # rolled back whole, so nothing torn is left: say so, and what to do.
    if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in text:
        return NoSpace(f"no space left on the device holding the event log {path}: nothing was recorded; "
                       f"free space there and retry ({text})")
    return StoreError(f"event log write failed: {text}")
