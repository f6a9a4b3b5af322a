"""``gpuledger audit verify``: is the log the one the allocator wrote?

Checks, in one read transaction:
- the file is a SQLite database SQLite itself finds sound (``PRAGMA quick_check``);
- ``seq`` runs 1, 2, 3... without a hole (a deleted row leaves one, even with the triggers dropped);
- ``recorded_at`` never goes backwards;
- every row's ``hash`` is sha256(previous hash || the row), so an edited row, or a row moved or
  removed before it, breaks the chain at the first row touched: that seq is reported.
- the archive segments (archive.py) come first, in the catalog's order: each file must be there, have
  the sha256 recorded when it was written (an edited, replaced or swapped segment is named), hold the
  rows its catalog entry says, chain from the previous segment's last hash (the first from genesis)
  and end on the recorded hash; the live log's rows then chain from the last segment's hash;
- optionally, the chain reaches what a snapshot recorded (``expect``: seq + hash), which catches
  rows cut off the end, the one change a chain cannot see from inside.

A crash never needs a repair step here. The log runs in WAL mode with ``synchronous=FULL``: a
transaction is acknowledged only after its commit frame is on disk, and SQLite, when it next opens
the file, replays the WAL up to the last intact commit frame and ignores anything after it (a torn
or half-written last transaction, garbage appended to the WAL). What is discarded was therefore never
acknowledged to a caller. ``verify`` reports what it found so an operator knows, and the allocator's
next start does the same recovery implicitly.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

import msgspec

from libs.errors import StoreError
from libs.store.archive import SUFFIX, Segment, archive_dir, catalog, file_sha256, segment_rows
from libs.store.replay import iter_rows, open_reader
from libs.store.rows import COLUMNS, GENESIS_HASH, chain_hash

__all__ = ["Report", "verify_log"]


class Report(msgspec.Struct, kw_only=True):
    path: str
    ok: bool
    events: int = 0
    last_seq: int = 0
    head_hash: str = ""             # hex hash of the last intact row: quote it to pin the log's state
    first_bad_seq: int | None = None
    problem: str = ""
    segments: int = 0               # archive segments checked (their events are counted in ``events``)
    bad_segment: str = ""           # the segment file the problem is in, when it is in the archive
    notes: list[str] = msgspec.field(default_factory=list)


def verify_log(
    path: Path,
    *,
    expect: tuple[int, bytes] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Report:
    report = Report(path=str(path), ok=True)
    wal = Path(f"{path}-wal")
    if wal.exists() and wal.stat().st_size:
        report.notes.append(f"{wal.name} holds {wal.stat().st_size} bytes not yet checkpointed: SQLite reads "
                            "its committed transactions and ignores a torn or garbage tail")
    conn = open_reader(path, archives=False)
    try:
        _check_pages(conn, path, report)
        if not report.ok:
            return report
        chain = _Chain(report, progress)
        segments = catalog(conn)
        for seg in segments:
            if not _verify_segment(path, seg, chain):
                return report
        _stray_files(path, segments, report)
        archived = segments[-1].last_seq if segments else 0
        if archived and conn.execute("SELECT 1 FROM events WHERE seq <= ?", (archived,)).fetchone():
            report.notes.append(f"the live log still holds rows up to seq {archived} that a segment holds (an "
                                "archive was stopped before it removed them): the allocator's next start does")
        prev, expected_seq, last_at = chain.prev, chain.expected_seq, chain.last_at
        for row in iter_rows(conn, f"{COLUMNS}, hash", after_seq=archived):
            seq, at, stored_hash = row[0], row[1], row[-1]
            if seq != expected_seq:
                return _bad(report, expected_seq, f"seq {expected_seq} is missing (next row is seq {seq}): "
                                                  "a row was deleted")
            if at < last_at:
                return _bad(report, seq, "recorded_at goes backwards: rows were reordered or edited")
            prev = chain_hash(prev, row[:-1])
            if prev != stored_hash:
                return _bad(report, seq, "hash does not match the row: this row was edited, or rows before it "
                                         "were removed, inserted or reordered")
            report.events, report.last_seq, report.head_hash = report.events + 1, seq, prev.hex()
            expected_seq, last_at = seq + 1, at
            if progress is not None and seq % 100_000 == 0:
                progress(seq)
        if expect is not None:
            _check_expectation(report, expect)
        return report
    except (sqlite3.DatabaseError, StoreError) as exc:
        return _bad(report, report.last_seq + 1, f"SQLite cannot read the file past seq {report.last_seq}: {exc}")
    finally:
        conn.close()


class _Chain:
    """Where the chain check stands: the hash, the next seq and the last time seen."""

    def __init__(self, report: Report, progress: Callable[[int], None] | None) -> None:
        self.report, self.progress = report, progress
        self.prev, self.expected_seq, self.last_at = GENESIS_HASH, 1, 0

    def row(self, row: tuple[object, ...], where: str) -> bool:
        seq, at, stored_hash = row[0], row[1], row[-1]
        assert isinstance(seq, int) and isinstance(at, int)
        if seq != self.expected_seq:
            _bad(self.report, self.expected_seq,
                 f"seq {self.expected_seq} is missing in {where} (next row is seq {seq})")
            return False
        if at < self.last_at:
            _bad(self.report, seq, f"recorded_at goes backwards in {where}: rows were reordered or edited")
            return False
        self.prev = chain_hash(self.prev, row[:-1])
        if self.prev != stored_hash:
            _bad(self.report, seq, f"hash does not match the row in {where}: it was edited, or rows before it were "
                                   "removed, inserted or reordered")
            return False
        self.report.events, self.report.last_seq, self.report.head_hash = self.report.events + 1, seq, self.prev.hex()
        self.expected_seq, self.last_at = seq + 1, at
        if self.progress is not None and seq % 100_000 == 0:
            self.progress(seq)
        return True


def _verify_segment(log_path: Path, seg: Segment, chain: _Chain) -> bool:
    report = chain.report
    path = archive_dir(log_path) / seg.file
    where = f"archive segment {seg.file}"

    def bad(seq: int, problem: str) -> bool:
        _bad(report, seq, problem)
        report.bad_segment = seg.file
        return False

    if seg.first_seq != chain.expected_seq or seg.prev_hash != chain.prev:
        return bad(chain.expected_seq, f"{where} (seq {seg.first_seq}..{seg.last_seq}) does not continue the chain "
                                       f"at seq {chain.expected_seq}: the archive catalog was altered")
    if not path.exists():
        return bad(seg.first_seq, f"{where} (seq {seg.first_seq}..{seg.last_seq}) is missing from {path.parent}: "
                                  "restore it from a backup")
    if file_sha256(path) != seg.sha256:
        return bad(seg.first_seq, f"{where} (seq {seg.first_seq}..{seg.last_seq}) was edited or replaced: its "
                                  "sha256 differs from the one recorded when it was written")
    try:
        for header, row in segment_rows(path):
            if tuple(header) != (seg.first_seq, seg.last_seq, seg.prev_hash, seg.last_hash):
                return bad(seg.first_seq, f"{where}: its header does not match the catalog")
            if not chain.row(row, where):
                report.bad_segment = seg.file
                return False
    except (sqlite3.DatabaseError, OSError, StoreError, ImportError) as exc:
        return bad(chain.expected_seq, f"{where} cannot be read: {exc}")
    if chain.expected_seq != seg.last_seq + 1 or chain.prev != seg.last_hash:
        return bad(chain.expected_seq, f"{where} ends before seq {seg.last_seq} or on another hash than recorded")
    report.segments += 1
    return True


def _stray_files(log_path: Path, segments: list[Segment], report: Report) -> None:
    folder = archive_dir(log_path)
    if not folder.is_dir():
        return
    known = {s.file for s in segments}
    for path in sorted(folder.glob(f"*{SUFFIX}")):
        if path.name not in known:
            report.notes.append(f"{path.name} in {folder} is not in the archive catalog (an archive stopped before "
                                "recording it, or a foreign file): not checked")


def _check_pages(conn: sqlite3.Connection, path: Path, report: Report) -> None:
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    extra = os.path.getsize(path) - page_size * pages
    if extra > 0:
        report.notes.append(f"{extra} bytes after the last page of {path.name} (a crashed copy or another "
                            "program appended them): SQLite ignores them")
    problems = [r[0] for r in conn.execute("PRAGMA quick_check(5)").fetchall()]
    if problems != ["ok"]:
        _bad(report, None, f"SQLite finds the file damaged: {'; '.join(problems)}")


def _check_expectation(report: Report, expect: tuple[int, bytes]) -> None:
    seq, digest = expect
    if report.last_seq < seq:
        _bad(report, report.last_seq + 1, f"the log ends at seq {report.last_seq} but a snapshot saw it reach "
                                          f"seq {seq}: rows were cut off the end")
    elif report.ok and seq and _hash_at(report, seq) != digest:
        _bad(report, seq, "the hash at this seq differs from the one a snapshot recorded: the log was rewritten")


def _hash_at(report: Report, seq: int) -> bytes | None:
    conn = open_reader(Path(report.path), from_seq=seq)
    try:
        row = conn.execute("SELECT hash FROM events WHERE seq = ?", (seq,)).fetchone()
        return row[0] if row else None
    finally:
        conn.close()


def _bad(report: Report, seq: int | None, problem: str) -> Report:
    report.ok = False
    report.first_bad_seq = seq
    report.problem = problem
    return report

