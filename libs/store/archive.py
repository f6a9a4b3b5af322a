"""Archive segments: the oldest events moved out of the live log into compressed, read-only files.

Bounded growth without giving up the history. ``<state-dir>/ledger.archive/`` holds one file per
segment, ``<first seq>-<last seq>.seg.zst`` (12 digits each): a zstd-compressed SQLite database with
the rows first..last exactly as the live log held them (every column and the chain hash), a
``segment`` table naming its first/last seq, the hash before its first row and the hash after its
last, and a ``meta`` table with the live log's recorded response settings (``response-settings:*``,
docs/compact-log.md): the compact grants a segment holds name them, so a segment is readable on its
own (readers see the live log's and the segments' settings as one ``meta``). The hash chain simply
continues: segment 1 chains from the genesis hash, each next segment from the previous one's last hash,
and the live log's first row from the last segment's last hash. The live log's ``archive_segments``
table is the catalog (range, hashes, the file's sha256); readers (replay.py ``open_reader``) and
``audit verify`` (verify.py) go through it.

How rows leave the live log. The log refuses UPDATE and DELETE for everyone; the one exception is a
guarded trigger (schema.py): DELETE of the *oldest* row, and only when a *recorded* segment holds it.
Only the allocator, the log's single writer, archives (``allocator.archive`` on NATS; the CLI asks it),
in four steps, each durable before the next:

1. write the segment: the rows copied in one read transaction into a temporary SQLite file, zstd,
   fsync, rename to its final name, fsync the directory;
2. record the segments' stream heads (``heads.sqlite`` in the archive directory: each stream's last
   version, so a stream whose rows all left the live log still continues at the right version);
3. record the segment in the catalog (one transaction; a trigger checks it continues the last
   segment and ends on the live log's hash at its last seq);
4. delete the prefix, oldest first, in chunks.

Crash safety: at every point the live log plus the recorded segments hold every event once in a
consistent chain. Before 3, the live log still holds all rows (a finished segment file is simply not
in the catalog yet); between 3 and 4, rows are in both places, and readers take a seq from the
segment when the catalog covers it (the live duplicates are ignored until deleted). ``finish`` runs at
the allocator's start: it removes temporary files, records a complete segment file that continues the
catalog and matches the live log (a crash between 1 and 3), and deletes the rows a recorded segment
already holds (a crash during 4).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from libs.errors import StoreError
from libs.logger import get_logger
from libs.store.compact import SETTINGS_PREFIX
from libs.store.layout import layout_of, spell_streams
from libs.store.rows import COLUMNS, GENESIS_HASH

__all__ = [
    "Segment",
    "SegmentFiles",
    "archive_dir",
    "archive_prefix",
    "catalog",
    "cut_for",
    "finish",
    "live_bounds",
    "materialize",
    "segment_rows",
    "stream_head",
]

_logger = get_logger("archive")

ROW_COLUMNS = f"{COLUMNS}, hash"
SUFFIX = ".seg.zst"
ZSTD_LEVEL = 3          # ~300 MB/s on one core here; higher levels cost far more time than they save bytes
DELETE_CHUNK = 5_000    # rows per delete transaction: appends wait at most one chunk
# A segment read apart (SegmentFiles) is decompressed into memory up to this size, into a temporary
# file above it (an archive of a long history in one step can be gigabytes).
IN_MEMORY_LIMIT = 64 << 20
_SEGMENT_DDL = (
    """CREATE TABLE events (seq INTEGER PRIMARY KEY, recorded_at INTEGER NOT NULL, stream_id TEXT NOT NULL,
       version INTEGER NOT NULL, type TEXT NOT NULL, schema_v INTEGER NOT NULL, event_id BLOB NOT NULL,
       command_id TEXT, payload BLOB NOT NULL, hash BLOB NOT NULL) STRICT""",
    """CREATE TABLE segment (first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL, prev_hash BLOB NOT NULL,
       last_hash BLOB NOT NULL) STRICT""",
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) STRICT",
)
# The live log's meta rows a segment carries: the response settings its compact grants are reproduced from.
_SETTINGS_ROWS = f"SELECT key, value FROM main.meta WHERE key LIKE '{SETTINGS_PREFIX}%'"


class Segment(msgspec.Struct, kw_only=True):
    """One catalog row (``archive_segments``)."""

    first_seq: int
    last_seq: int
    first_at: int
    last_at: int
    prev_hash: bytes
    last_hash: bytes
    file: str
    sha256: bytes
    archived_at: int

    @property
    def events(self) -> int:
        return self.last_seq - self.first_seq + 1


_CATALOG_COLUMNS = ", ".join(Segment.__struct_fields__)


def archive_dir(log_path: Path) -> Path:
    return log_path.with_name(log_path.stem + ".archive")


def segment_name(first: int, last: int) -> str:
    return f"{first:012d}-{last:012d}{SUFFIX}"


def catalog(conn: sqlite3.Connection, schema: str = "main") -> list[Segment]:
    """The recorded segments, in seq order ([] for a log written before archiving existed)."""
    try:
        rows = conn.execute(f"SELECT {_CATALOG_COLUMNS} FROM {schema}.archive_segments ORDER BY first_seq").fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []
        raise
    return [Segment(**dict(zip(Segment.__struct_fields__, row, strict=True))) for row in rows]


def live_bounds(conn: sqlite3.Connection) -> tuple[int, int]:
    """(first, last) seq the live file holds; (0, 0) when empty."""
    table = layout_of(conn).table  # the table itself: the view's join would scan for MIN and MAX
    first, last = conn.execute(f"SELECT MIN(seq), MAX(seq) FROM main.{table}").fetchone()
    return int(first or 0), int(last or 0)


# --- writing (the allocator only) ---------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _compress(src: Path, dst: Path) -> bytes:
    """zstd ``src`` into ``dst`` (fsynced); the sha256 of what was written."""
    import zstandard  # only the archiving allocator and readers of archives need it

    digest = hashlib.sha256()

    class _Hashing:
        def __init__(self, f: object) -> None:
            self.f = f

        def write(self, data: bytes) -> int:
            digest.update(data)
            return self.f.write(data)  # type: ignore[attr-defined]

    with open(src, "rb") as fin, open(dst, "wb") as fout:
        zstandard.ZstdCompressor(level=ZSTD_LEVEL).copy_stream(fin, _Hashing(fout))
        fout.flush()
        os.fsync(fout.fileno())
    return digest.digest()


def _decompressed(src: Path, limit: int) -> bytearray | None:
    """The decompressed segment, or None when it is larger than ``limit`` bytes (handed to SQLite as
    it is: a copy into ``bytes`` would be a second pass over every archived byte)."""
    import zstandard

    out = bytearray()
    with open(src, "rb") as fin, zstandard.ZstdDecompressor().stream_reader(fin) as reader:
        while block := reader.read(1 << 20):
            out += block
            if len(out) > limit:
                return None
    return out


def _decompress(src: Path, dst: Path) -> None:
    import zstandard

    with open(src, "rb") as fin, open(dst, "wb") as fout:
        zstandard.ZstdDecompressor().copy_stream(fin, fout)


def file_sha256(path: Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.digest()


def _writable(log_path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(log_path, isolation_level=None)
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


def write_segment(log_path: Path, conn: sqlite3.Connection, first: int, last: int, prev_hash: bytes) -> Segment:
    """Step 1: the rows first..last of the live log as a durable segment file (not yet recorded)."""
    folder = archive_dir(log_path)
    folder.mkdir(parents=True, exist_ok=True)
    name = segment_name(first, last)
    plain = folder / f".{name}.sqlite.tmp"
    packed = folder / f".{name}.tmp"
    plain.unlink(missing_ok=True)
    try:
        seg = sqlite3.connect(plain, isolation_level=None)
        try:
            seg.execute("PRAGMA journal_mode=OFF")
            seg.execute("PRAGMA synchronous=OFF")
            for ddl in _SEGMENT_DDL:
                seg.execute(ddl)
            seg.execute("BEGIN")
            layout = layout_of(conn)
            listed, fix = layout.select(conn, ROW_COLUMNS)  # the table itself, spelled as the view spells it
            rows = conn.execute(f"SELECT {listed} FROM main.{layout.table} WHERE seq BETWEEN ? AND ? ORDER BY seq",
                                (first, last))
            while chunk := rows.fetchmany(2_000):
                if fix is not None:
                    spell_streams(chunk, fix)
                seg.executemany(f"INSERT INTO events ({ROW_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", chunk)
            got, first_at, last_at, last_hash = seg.execute(
                "SELECT COUNT(*), MIN(recorded_at), MAX(recorded_at), "
                "(SELECT hash FROM events ORDER BY seq DESC LIMIT 1) FROM events").fetchone()
            if got != last - first + 1:
                raise StoreError(f"the live log holds {got} of the rows {first}..{last}: nothing archived")
            seg.execute("INSERT INTO segment VALUES (?, ?, ?, ?)", (first, last, prev_hash, last_hash))
            seg.executemany("INSERT INTO meta VALUES (?, ?)", conn.execute(_SETTINGS_ROWS).fetchall())
            seg.execute("COMMIT")
        finally:
            seg.close()
        sha = _compress(plain, packed)
        os.replace(packed, folder / name)
        _fsync_dir(folder)
    finally:
        plain.unlink(missing_ok=True)
        packed.unlink(missing_ok=True)
    return Segment(first_seq=first, last_seq=last, first_at=first_at, last_at=last_at, prev_hash=prev_hash,
                   last_hash=last_hash, file=name, sha256=sha, archived_at=time.time_ns())


def heads_path(log_path: Path) -> Path:
    return archive_dir(log_path) / "heads.sqlite"


def _record_heads(log_path: Path, source: sqlite3.Connection, schema: str, upto: int) -> None:
    """Step 2: each stream's last version in ``schema``.events, kept in heads.sqlite (idempotent)."""
    heads = sqlite3.connect(heads_path(log_path), isolation_level=None)
    try:
        heads.execute("PRAGMA journal_mode=WAL")
        heads.execute("PRAGMA synchronous=FULL")
        heads.execute("CREATE TABLE IF NOT EXISTS heads (stream_id TEXT PRIMARY KEY, version INTEGER NOT NULL) "
                      "WITHOUT ROWID")
        heads.execute("CREATE TABLE IF NOT EXISTS covered (upto_seq INTEGER NOT NULL)")
        done = heads.execute("SELECT MAX(upto_seq) FROM covered").fetchone()[0] or 0
        if done >= upto:
            return
        found = source.execute(f"SELECT stream_id, MAX(version) FROM {schema}.events WHERE seq > ? AND seq <= ? "
                               "GROUP BY stream_id", (done, upto)).fetchall()
        heads.execute("BEGIN IMMEDIATE")
        heads.executemany("INSERT INTO heads VALUES (?, ?) ON CONFLICT (stream_id) DO UPDATE "
                          "SET version = MAX(version, excluded.version)", found)
        heads.execute("DELETE FROM covered")
        heads.execute("INSERT INTO covered VALUES (?)", (upto,))
        heads.execute("COMMIT")
    finally:
        heads.close()


def stream_head(heads_file: str) -> sqlite3.Connection | None:
    """A read connection to the stream heads of archived rows (the writer's fallback), if any.
    ``heads_file`` is ``heads_path(log)``, made once by the caller: it asks at every new stream until
    the first archive has made the file, so the question is one ``stat``."""
    if not os.path.exists(heads_file):
        return None
    conn = sqlite3.connect(heads_file, isolation_level=None, check_same_thread=False)  # WAL: read-write opens surely
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


def _record(conn: sqlite3.Connection, seg: Segment) -> None:
    """Step 3: the segment enters the catalog (its trigger checks continuity and the hash)."""
    conn.execute(f"INSERT INTO archive_segments ({_CATALOG_COLUMNS}) VALUES ({', '.join('?' * 9)})",
                 tuple(getattr(seg, f) for f in Segment.__struct_fields__))


def _delete_prefix(conn: sqlite3.Connection, upto: int) -> int:
    """Step 4: delete the rows <= ``upto`` (which a recorded segment holds), oldest first, in chunks."""
    gone = 0
    table = layout_of(conn).table
    while True:
        first = conn.execute(f"SELECT MIN(seq) FROM main.{table}").fetchone()[0]
        if first is None or first > upto:
            return gone
        end = min(upto, first + DELETE_CHUNK - 1)
        conn.execute("BEGIN IMMEDIATE")
        try:
            gone += conn.execute(f"DELETE FROM main.{table} WHERE seq <= ?", (end,)).rowcount
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


def cut_for(log_path: Path, *, before_ns: int | None = None, keep_events: int | None = None,
            limit: int | None = None) -> int:
    """The last seq an archive would take: recorded before ``before_ns`` and/or leaving ``keep_events``
    live (both: the smaller), never the live log's last row, never above ``limit``; 0 when nothing."""
    conn = sqlite3.connect(f"file:{log_path}?mode=ro", uri=True, isolation_level=None)
    try:
        first, last = live_bounds(conn)
        if not last:
            return 0
        cut = last - 1
        if before_ns is not None:
            cut = min(cut, _last_before(conn, layout_of(conn).table, first, last, before_ns))
        if keep_events is not None:
            cut = min(cut, last - keep_events)
        if limit is not None:
            cut = min(cut, limit)
        done = max((s.last_seq for s in catalog(conn)), default=0)
        return cut if cut > max(done, first - 1) else 0
    finally:
        conn.close()


def _last_before(conn: sqlite3.Connection, table: str, first: int, last: int, before_ns: int) -> int:
    """The last live seq recorded before ``before_ns`` (0 when none): a binary search by seq, as time
    never goes backwards (no index on the time)."""
    def at(seq: int) -> int:
        return int(conn.execute(f"SELECT recorded_at FROM main.{table} WHERE seq = ?", (seq,)).fetchone()[0])

    if at(first) >= before_ns:
        return 0
    lo, hi = first, last  # invariant: at(lo) < before_ns
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if at(mid) < before_ns:
            lo = mid
        else:
            hi = mid - 1
    return lo


def archive_prefix(log_path: Path, upto: int, *, fail_after: str = "") -> Segment | None:
    """Move the live rows up to ``upto`` into one new segment (steps 1-4). Blocking; the allocator's
    thread. ``fail_after`` (tests only) raises after the named step, as a crash would stop there."""
    conn = _writable(log_path)
    try:
        done = catalog(conn)
        last_done = done[-1].last_seq if done else 0
        prev = done[-1].last_hash if done else GENESIS_HASH
        first, last = live_bounds(conn)
        if upto <= last_done or upto >= last:
            return None
        start = last_done + 1
        if first > start:
            raise StoreError(f"the live log starts at seq {first} but the archive ends at seq {last_done}: "
                             "rows are missing; run `gpuledger audit verify`")
        conn.execute("BEGIN")  # one read snapshot for the copy and the hashes
        try:
            seg = write_segment(log_path, conn, start, upto, prev)
        finally:
            conn.execute("COMMIT")
        _crash_point(fail_after, "segment")
        _record_heads(log_path, conn, "main", upto)
        _crash_point(fail_after, "heads")
        conn.execute("BEGIN IMMEDIATE")
        _record(conn, seg)
        conn.execute("COMMIT")
        _crash_point(fail_after, "catalog")
        _delete_prefix(conn, upto)
        _logger.info("events archived", file=seg.file, first_seq=seg.first_seq, last_seq=seg.last_seq)
        return seg
    finally:
        conn.close()


class InjectedCrash(Exception):
    """Raised by ``archive_prefix(fail_after=...)``: a crash at that step, for the tests."""


def _crash_point(wanted: str, step: str) -> None:
    if wanted == step:
        raise InjectedCrash(step)


def finish(log_path: Path) -> list[str]:
    """Start-up repair: finish or undo a half-done archive. Returns what it did, one line each."""
    folder = archive_dir(log_path)
    if not folder.is_dir() or not log_path.exists():
        return []
    did: list[str] = []
    for tmp in folder.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
        did.append(f"removed the unfinished {tmp.name}")
    conn = _writable(log_path)
    try:
        done = catalog(conn)
        recorded = {s.file for s in done}
        last_done = done[-1].last_seq if done else 0
        for path in sorted(folder.glob(f"*{SUFFIX}")):
            if path.name in recorded:
                continue
            seg = _adoptable(conn, path, last_done, done[-1].last_hash if done else GENESIS_HASH)
            if seg is None:
                did.append(f"{path.name} is not in the catalog and does not continue it: left alone")
                continue
            with _opened(path) as (seg_conn, _):
                _record_heads(log_path, seg_conn, "main", seg.last_seq)
            conn.execute("BEGIN IMMEDIATE")
            _record(conn, seg)
            conn.execute("COMMIT")
            done.append(seg)
            last_done = seg.last_seq
            did.append(f"recorded {path.name}, written before a stop")
        if done:
            _ensure_heads(log_path, done)
            gone = _delete_prefix(conn, last_done)
            if gone:
                did.append(f"removed {gone} live rows already archived (up to seq {last_done})")
    finally:
        conn.close()
    for line in did:
        _logger.warning("archive repaired at start", action=line)
    return did


def _ensure_heads(log_path: Path, done: list[Segment]) -> None:
    """Bring heads.sqlite up to the last recorded segment (rebuilt from the segments if it was lost)."""
    try:
        heads = sqlite3.connect(f"file:{heads_path(log_path)}?mode=ro", uri=True)
        try:
            covered = heads.execute("SELECT MAX(upto_seq) FROM covered").fetchone()[0] or 0
        finally:
            heads.close()
    except sqlite3.DatabaseError:
        covered = 0
    for seg in done:
        if seg.last_seq > covered:
            with _opened_checked(archive_dir(log_path) / seg.file) as (seg_conn, _):
                _record_heads(log_path, seg_conn, "main", seg.last_seq)


def _adoptable(conn: sqlite3.Connection, path: Path, last_done: int, prev: bytes) -> Segment | None:
    """The catalog row for a complete segment file that continues the catalog and matches the live log."""
    try:
        with _opened(path) as (seg_conn, _):
            first, last, prev_hash, last_hash = seg_conn.execute("SELECT * FROM segment").fetchone()
            first_at, last_at = seg_conn.execute("SELECT MIN(recorded_at), MAX(recorded_at) FROM events").fetchone()
    except (sqlite3.DatabaseError, OSError, TypeError, StoreError):
        return None
    live = conn.execute("SELECT hash FROM main.events WHERE seq = ?", (last,)).fetchone()
    _, live_last = live_bounds(conn)
    if first != last_done + 1 or prev_hash != prev or live is None or live[0] != last_hash or last >= live_last:
        return None
    return Segment(first_seq=first, last_seq=last, first_at=first_at, last_at=last_at, prev_hash=prev_hash,
                   last_hash=last_hash, file=path.name, sha256=file_sha256(path), archived_at=time.time_ns())


# --- reading --------------------------------------------------------------------------------------

@contextlib.contextmanager
def _opened(path: Path) -> Iterator[tuple[sqlite3.Connection, Path]]:
    """One segment decompressed into a temporary file, opened read-only."""
    fd, tmp = tempfile.mkstemp(prefix="gpuledger-segment-", suffix=".sqlite")
    os.close(fd)
    plain = Path(tmp)
    try:
        _decompress(path, plain)
        conn = sqlite3.connect(f"file:{plain}?mode=ro&immutable=1", uri=True, isolation_level=None)
        try:
            yield conn, plain
        finally:
            conn.close()
    finally:
        plain.unlink(missing_ok=True)


def segment_rows(path: Path) -> Iterator[tuple[tuple[object, ...], tuple[object, ...]]]:
    """(segment header row, each event row with its hash) of one segment file, for verify (which names
    the file itself when it cannot be read)."""
    with _in_memory(path, checked=False) as conn:
        header = conn.execute("SELECT first_seq, last_seq, prev_hash, last_hash FROM segment").fetchone()
        cur = conn.execute(f"SELECT {ROW_COLUMNS} FROM events ORDER BY seq")
        while rows := cur.fetchmany(1_000):
            for row in rows:
                yield header, row


def materialize(log_path: Path, segments: list[Segment]) -> Path:
    """The rows of ``segments`` (contiguous, in order) in one temporary SQLite file; the caller
    attaches it and unlinks it. Missing or unreadable files are an error that names them."""
    folder = archive_dir(log_path)
    fd, tmp = tempfile.mkstemp(prefix="gpuledger-archive-", suffix=".sqlite")
    os.close(fd)
    out = Path(tmp)
    try:
        _decompress_checked(folder / segments[0].file, out)
        conn = sqlite3.connect(out, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=OFF")
            conn.execute("PRAGMA synchronous=OFF")
            conn.execute("DROP TABLE segment")
            conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) STRICT")
            for seg in segments[1:]:
                with _opened_checked(folder / seg.file) as (part_conn, plain):
                    has_meta = part_conn.execute(
                        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
                    conn.execute("ATTACH ? AS part", (f"file:{plain}?mode=ro&immutable=1",))
                    try:
                        conn.execute("INSERT INTO main.events SELECT * FROM part.events")
                        if has_meta:  # a segment written before the compact log has none
                            conn.execute("INSERT OR IGNORE INTO main.meta SELECT key, value FROM part.meta")
                    finally:
                        conn.execute("DETACH part")
        finally:
            conn.close()
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


class SegmentFiles:
    """The archived part of the history read segment by segment, never merged into one file: a scan
    decompresses each segment in turn, a lookup by seq only the segments that hold it. For a reader
    that scans the whole history once (the audit replay), merging (``materialize``) copies every
    archived row a second time and costs about as much as the scan itself.

    A segment is open only while it is read (in memory: ``_in_memory``); the last one opened for
    lookups stays open until the next or ``close``, since lookups come grouped by segment.
    """

    def __init__(self, log_path: Path, segments: list[Segment]) -> None:
        self.folder = archive_dir(log_path)
        self.segments = segments
        self._kept: tuple[Segment, contextlib.ExitStack, sqlite3.Connection] | None = None

    @property
    def last_seq(self) -> int:
        return self.segments[-1].last_seq if self.segments else 0

    def scan(self, columns: str, after: int, upto: int, chunk: int) -> Iterator[list[Any]]:
        """``columns`` of the archived rows in (after, upto], in seq order, ``chunk`` rows at a time."""
        for seg in self.segments:
            if seg.last_seq <= after or seg.first_seq > upto:
                continue
            with _in_memory(self.folder / seg.file) as conn:
                cur = conn.execute(f"SELECT {columns} FROM events WHERE seq > ? AND seq <= ? ORDER BY seq",
                                   (after, upto))
                while rows := cur.fetchmany(chunk):
                    yield rows

    def holding(self, seq: int) -> sqlite3.Connection | None:
        """A connection on the segment holding ``seq`` (None: no segment does): see ``open``."""
        seg = next((s for s in self.segments if s.first_seq <= seq <= s.last_seq), None)
        return None if seg is None else self.open(seg)

    def open(self, seg: Segment) -> sqlite3.Connection:
        """A connection on ``seg``, open until another segment is asked for or ``close``: its ``events``
        and ``meta`` are that segment's."""
        if self._kept is not None and self._kept[0] is seg:
            return self._kept[2]
        self.close()
        stack = contextlib.ExitStack()
        conn = stack.enter_context(_in_memory(self.folder / seg.file))
        self._kept = (seg, stack, conn)
        return conn

    def seq_at_time(self, time_ns: int) -> int:
        """The last archived seq recorded at or before ``time_ns`` (0 when none): the catalog's times
        find the segment, and only a time inside one segment opens it."""
        before = [s for s in self.segments if s.first_at <= time_ns]
        if not before:
            return 0
        seg = before[-1]
        if seg.last_at <= time_ns:
            return seg.last_seq
        row = self.open(seg).execute("SELECT MAX(seq) FROM events WHERE recorded_at <= ?", (time_ns,)).fetchone()
        return int(row[0])

    def close(self) -> None:
        if self._kept is not None:
            self._kept[1].close()
            self._kept = None


@contextlib.contextmanager
def _in_memory(path: Path, *, checked: bool = True) -> Iterator[sqlite3.Connection]:
    """One segment open for reading, decompressed into memory: no temporary file written and read
    back (about a tenth of a scan over the archive). Above ``IN_MEMORY_LIMIT``, into a file.
    ``checked``: a file that cannot be read is a StoreError that names it and says what to do."""
    try:
        data = _decompressed(path, IN_MEMORY_LIMIT)
    except Exception as exc:
        if not checked:
            raise
        raise _missing(path, exc) from exc
    if data is None:
        with _opened_checked(path) if checked else _opened(path) as (conn, _):
            yield conn
        return
    conn = sqlite3.connect(":memory:", isolation_level=None)
    try:
        conn.deserialize(data)
        yield conn
    finally:
        conn.close()


def _missing(path: Path, exc: Exception) -> StoreError:
    return StoreError(f"the archive segment {path} cannot be read ({exc}): restore it from a backup; "
                      "`gpuledger audit verify` checks every segment")


def _decompress_checked(path: Path, out: Path) -> None:
    try:
        _decompress(path, out)
    except Exception as exc:
        raise _missing(path, exc) from exc


@contextlib.contextmanager
def _opened_checked(path: Path) -> Iterator[tuple[sqlite3.Connection, Path]]:
    try:
        cm = _opened(path)
        opened = cm.__enter__()
    except Exception as exc:
        raise _missing(path, exc) from exc
    try:
        yield opened
    finally:
        cm.__exit__(None, None, None)
