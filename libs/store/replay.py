"""Fast replay: stream the log in seq order through the raw sqlite3 driver into a fold function.

Measured on this kind of machine at about a million events a second (eventlog-and-bus.md 2.3);
SQLAlchemy streaming is 3x slower and the ORM 27x, so rebuilding state never goes through them.
Reads run in chunks inside one read transaction, which sees a consistent snapshot of the log.

Archived events (archive.py) are read transparently: ``open_reader`` gives a connection on which the
name ``events`` is a temporary view over the recorded archive segments (decompressed into one
temporary file, attached read-only and already unlinked) followed by the live log, so every query of
``events`` (scans in seq order, lookups by seq, by time) sees the whole history; likewise ``meta`` spans
the live log's and the segments' (where the response settings of compact grants are recorded). A reader that only
needs seqs from ``from_seq`` on (a snapshot's tail) decompresses only the segments that reach it, and
none when the live log holds them all. A reader that scans the whole history once (the audit replay, history)
asks for the segments unmerged (``merged=False``): they are then read one at a time (``SegmentFiles``), by this
module's scans and lookups, and ``events`` is the live log's part alone.

The scans (``iter_rows``) do not go through those views: they read the attached segments' table, then
the live file's own table (``libs.store.layout``: format 2's rows spelled as the view spells them,
without its per-row join), each in seq order, in the same read transaction.
"""

from __future__ import annotations

import bisect
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from libs.errors import StoreError
from libs.events.codec import StoredEvent
from libs.store.archive import SegmentFiles, catalog, materialize
from libs.store.layout import Layout, layout_of, plain_columns
from libs.store.rows import COLUMNS, row_to_stored

__all__ = ["by_seq", "iter_events", "iter_row_chunks", "iter_rows", "last_seq_wanted", "open_reader", "replay",
           "restore_hint", "seq_at_time", "stored_at", "unreadable"]

# Rows fetched per call. Measured on 1.1 KB events: 1,000 scans ~25% faster than 10,000 (the rows of
# a chunk stay in the CPU caches); smaller gains nothing.
CHUNK = 1_000


_VIEW_COLUMNS = f"{COLUMNS}, hash"


class LogReader(sqlite3.Connection):
    """A connection ``open_reader`` opened: what its ``events`` spans, so that scans read the tables."""

    layout: Layout
    archived = 0      # the last seq of the archive segments read (0: none)
    live_after = 0    # live rows up to this seq are skipped (a segment holds them)
    segments: SegmentFiles | None = None  # the segments when read unmerged (else attached as ``archived``)

    def close(self) -> None:
        if self.segments is not None:
            self.segments.close()
        super().close()


def open_reader(path: Path, *, from_seq: int = 1, archives: bool = True, merged: bool = True) -> sqlite3.Connection:
    """A read-only connection; refuses to create a log that is not there.

    With ``archives`` (the default), ``events`` spans the archive segments and the live log (the
    segments needed for seqs >= ``from_seq``); without, it is the live file's own table (verify).
    ``merged=False``: the segments are read apart (``SegmentFiles``) by ``iter_row_chunks``, ``by_seq``,
    ``seq_at_time`` and ``stored_at``, and ``events`` and ``meta`` are the live log's alone.
    """
    if not path.exists():
        raise StoreError(f"no event log at {path}: has the allocator run with this --state-dir?")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, factory=LogReader)
    try:
        conn.execute("PRAGMA busy_timeout=5000")
        conn.execute("SELECT 1 FROM events LIMIT 1").fetchall()
        conn.layout = layout_of(conn)
        if archives:
            _span_archives(conn, path, from_seq, merged)
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise unreadable(path, exc) from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _span_archives(conn: LogReader, path: Path, from_seq: int, merged: bool) -> None:
    segments = catalog(conn)
    if not segments:
        return
    archived = segments[-1].last_seq  # live rows up to here are duplicates a crash left: not read twice
    conn.live_after = archived
    live = f"SELECT {_VIEW_COLUMNS} FROM main.events WHERE seq > {archived}"
    wanted = [s for s in segments if s.last_seq >= from_seq]
    if not wanted or not merged:
        conn.execute(f"CREATE TEMP VIEW events AS {live}")
        if wanted:
            conn.segments = SegmentFiles(path, wanted)
            conn.archived = archived
        return
    plain = materialize(path, wanted)
    try:
        conn.execute("ATTACH ? AS archived", (f"file:{plain}?mode=ro&immutable=1",))
    finally:
        plain.unlink(missing_ok=True)  # the open file stays readable; nothing is left behind
    conn.archived = archived
    conn.execute(f"CREATE TEMP VIEW events AS SELECT {_VIEW_COLUMNS} FROM archived.events UNION ALL {live}")
    # Recorded settings are content addressed (the same key always holds the same value): UNION drops the
    # copies; a segment's own rows let its compact grants be read even where the live log lacks them.
    conn.execute("CREATE TEMP VIEW meta AS SELECT key, value FROM main.meta UNION SELECT key, value FROM archived.meta")


def unreadable(path: Path | str, exc: sqlite3.DatabaseError) -> StoreError:
    """The error for a log file SQLite cannot read: it names the file, what SQLite found, and the one
    command that recovers it."""
    return StoreError(f"{path} is not a readable gpuledger event log (SQLite: {exc}). {restore_hint(path)}")


def restore_hint(path: Path | str) -> str:
    """How to recover the log at ``path``: ``gpuledger log restore`` (gpuledger/log_cmd.py)."""
    return (f"Stop the allocator, then run `gpuledger log restore --state-dir {Path(path).parent}`: it rebuilds "
            "the log from the node's JetStream stream (or `--from BACKUP`, a backup copy) and keeps the damaged "
            "file beside it.")


def seq_at_time(conn: sqlite3.Connection, time_ns: int) -> int:
    """The last seq recorded at or before ``time_ns`` (0 when none).

    A binary search by seq: ``recorded_at`` never goes backwards (a trigger refuses it, verify checks
    it), and lookups by seq are what archived rows are indexed by (no time index to build for them).
    """
    segments = getattr(conn, "segments", None)
    if segments is not None:  # ``events`` is the live part: earlier times are the segments'
        live = conn.execute("SELECT recorded_at FROM events ORDER BY seq LIMIT 1").fetchone()
        if live is None or live[0] > time_ns:
            return segments.seq_at_time(time_ns)
    first = conn.execute("SELECT seq FROM events ORDER BY seq LIMIT 1").fetchone()
    if first is None:
        return 0
    lo, hi = first[0], conn.execute("SELECT seq FROM events ORDER BY seq DESC LIMIT 1").fetchone()[0]

    def at(seq: int) -> int:
        return conn.execute("SELECT recorded_at FROM events WHERE seq = ?", (seq,)).fetchone()[0]

    if at(lo) > time_ns:
        return 0
    while lo < hi:  # invariant: at(lo) <= time_ns
        mid = (lo + hi + 1) // 2
        if at(mid) <= time_ns:
            lo = mid
        else:
            hi = mid - 1
    return int(lo)


def iter_rows(
    conn: sqlite3.Connection, columns: str, *, after_seq: int = 0, upto_seq: int | None = None
) -> Iterator[Sequence[Any]]:
    """Raw rows of ``columns`` (names of the columns of ``events``, or ``type_code``: see
    ``Layout.select``) in seq order, in one read transaction (a consistent view of the log). A row is
    a tuple, or a list of the same items where a format 2 pod stream was spelled as text."""
    for rows in iter_row_chunks(conn, columns, after_seq=after_seq, upto_seq=upto_seq):
        yield from rows


def iter_row_chunks(
    conn: sqlite3.Connection, columns: str, *, after_seq: int = 0, upto_seq: int | None = None
) -> Iterator[list[Sequence[Any]]]:
    """``iter_rows``' rows, a chunk (a list of up to CHUNK) at a time: a scan that folds a million rows
    saves a generator step per row."""
    upto = (1 << 63) - 1 if upto_seq is None else upto_seq
    conn.execute("BEGIN")
    try:
        parts: list[tuple[str | SegmentFiles, int, int, int | None]] = []
        if not isinstance(conn, LogReader):  # another connection: its own ``events``
            parts.append((f"SELECT {plain_columns(columns)} FROM events", after_seq, upto, None))
        else:
            if conn.archived > after_seq:
                archived = conn.segments or f"SELECT {plain_columns(columns)} FROM archived.events"
                parts.append((archived, after_seq, min(upto, conn.archived), None))
            listed, fix = conn.layout.select(conn, columns)
            parts.append((f"SELECT {listed} FROM main.{conn.layout.table}", max(after_seq, conn.live_after), upto,
                          fix))
        for select, low, high, fix in parts:
            if low >= high:
                continue
            if isinstance(select, SegmentFiles):
                yield from select.scan(plain_columns(columns), low, high, CHUNK)
                continue
            cur = conn.execute(select + " WHERE seq > ? AND seq <= ? ORDER BY seq", (low, high))
            while rows := cur.fetchmany(CHUNK):
                yield rows if fix is None else _spelled_streams(rows, fix)
    except sqlite3.DatabaseError as exc:
        raise unreadable(conn.execute("PRAGMA database_list").fetchone()[2], exc) from exc
    finally:
        if conn.in_transaction:
            conn.execute("COMMIT")


def _spelled_streams(rows: list[Any], fix: int) -> list[Sequence[Any]]:
    """The rows with format 2's pod keys (column ``fix``) spelled as text (stream_text), inline: once per
    row of a scan. A changed row is a list: cheaper to build than a tuple, the same items."""
    out: list[Sequence[Any]] = []
    for row in rows:
        if type(key := row[fix]) is bytes:
            row = list(row)
            row[fix] = f"pod:{key[1:5].hex()}-{key[5:11].hex('-', 2)}-{key[11:].hex()}"
        out.append(row)
    return out


def iter_events(
    conn: sqlite3.Connection, *, after_seq: int = 0, upto_seq: int | None = None
) -> Iterator[StoredEvent]:
    for rows in iter_row_chunks(conn, COLUMNS, after_seq=after_seq, upto_seq=upto_seq):
        for row in rows:
            yield row_to_stored(row, conn)


def by_seq(conn: sqlite3.Connection, columns: str, seqs: Sequence[int]) -> dict[int, tuple[Any, ...]]:
    """``columns`` (of the ``events`` view) of the rows at ``seqs``, by seq: one query per 500."""
    out: dict[int, tuple[Any, ...]] = {}
    segments = getattr(conn, "segments", None)
    if segments is not None:  # the archived seqs from their segments, one segment open at a time
        archived = sorted(s for s in seqs if s <= segments.last_seq)
        for seg in segments.segments:
            part = archived[bisect.bisect_left(archived, seg.first_seq):bisect.bisect_right(archived, seg.last_seq)]
            if part:
                _select_by_seq(segments.open(seg), columns, part, out)
        seqs = [s for s in seqs if s > segments.last_seq]
    _select_by_seq(conn, columns, seqs, out)
    return out


def _select_by_seq(conn: sqlite3.Connection, columns: str, seqs: Sequence[int], out: dict[int, tuple[Any, ...]]
                   ) -> None:
    for start in range(0, len(seqs), 500):
        part = seqs[start:start + 500]
        sql = f"SELECT seq, {columns} FROM events WHERE seq IN ({','.join('?' * len(part))})"
        out.update((row[0], row[1:]) for row in conn.execute(sql, part))


def stored_at(conn: sqlite3.Connection, seq: int) -> StoredEvent | None:
    """The event at ``seq`` decoded in full (None: no such row), from its segment where the reader
    reads them apart; a compact grant's settings are read from where the row is."""
    source: sqlite3.Connection | None = conn
    segments = getattr(conn, "segments", None)
    if segments is not None and seq <= segments.last_seq:
        source = segments.holding(seq)
    row = None if source is None else source.execute(f"SELECT {COLUMNS} FROM events WHERE seq = ?", (seq,)).fetchone()
    return None if row is None else row_to_stored(row, source)


def last_seq_wanted(conn: sqlite3.Connection, upto_seq: int | None, upto_time: int | None) -> int | None:
    """The last seq a replay bounded by ``upto_seq`` and/or ``upto_time`` includes (both: the earlier)."""
    if upto_time is None:
        return upto_seq
    bound = seq_at_time(conn, upto_time)
    return bound if upto_seq is None else min(upto_seq, bound)


def replay(
    path: Path,
    fold: Callable[[StoredEvent], object],
    *,
    after_seq: int = 0,
    upto_seq: int | None = None,
    upto_time: int | None = None,
) -> int:
    """Feed every event in (after_seq, upto] to ``fold``; return the last seq fed (or after_seq)."""
    conn = open_reader(path, from_seq=after_seq + 1)
    try:
        upto_seq = last_seq_wanted(conn, upto_seq, upto_time)
        last = after_seq
        for stored in iter_events(conn, after_seq=after_seq, upto_seq=upto_seq):
            fold(stored)
            last = stored.seq
        return last
    finally:
        conn.close()
