"""Rebuild a damaged event log from a copy of its events: the node's JetStream stream (where every
event is published with stream seq == log seq) or a backup file (``gpuledger log restore``).

The new log is written next to the old one and then swapped in, so a failed restore changes nothing;
the damaged file (with its -wal/-shm and the fold snapshot taken from it) is kept beside it under a
``.damaged-<time>`` suffix for inspection. Each row's hash is computed afresh over the same columns
the writer hashes, so the result passes ``gpuledger audit verify``; an event of an older schema that
the stream carries upcast is stored at its current schema version (its hash then differs from the
original's, which ``log restore`` reports against the snapshot's recorded hash when there is one).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path

from libs.errors import StoreError
from libs.events.codec import StoredEvent
from libs.store.rows import COLUMNS, GENESIS_HASH, chain_hash, event_row
from libs.store.writer import connect

__all__ = ["set_aside", "swap_in", "write_restored"]

_INSERT = f"INSERT INTO events ({COLUMNS}, hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
_COMPANIONS = ("-wal", "-shm")


def write_restored(path: Path, events: Iterable[StoredEvent]) -> tuple[int, dict[int, str]]:
    """Write ``events`` (seq 1, 2, ... without a gap) as a fresh log at ``path``; (count, seq -> hex hash)."""
    from libs.store.log import create_schema

    for leftover in (path, *(Path(f"{path}{s}") for s in _COMPANIONS)):
        leftover.unlink(missing_ok=True)
    create_schema(path)
    conn = connect(path)
    hashes: dict[int, str] = {}
    prev, count = GENESIS_HASH, 0
    try:
        conn.execute("BEGIN IMMEDIATE")
        for stored in events:
            if stored.seq != count + 1:
                raise StoreError(f"the source skips from seq {count} to seq {stored.seq}: it is not a whole log")
            row = event_row(stored.seq, stored.recorded_at, stored.stream_id, stored.version, stored.event,
                            bytes.fromhex(stored.event_id), stored.command_id)
            prev = chain_hash(prev, row)
            conn.execute(_INSERT, (*row, prev))
            hashes[stored.seq] = prev.hex()
            count += 1
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    finally:
        conn.close()
    return count, hashes


def set_aside(path: Path, *also: Path) -> list[Path]:
    """Rename ``path`` (and its -wal/-shm, and ``also``) to ``<name>.damaged-<UTC time>``; the new names."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = []
    for old in (path, *(Path(f"{path}{s}") for s in _COMPANIONS), *also):
        if old.exists():
            new = old.with_name(f"{old.name}.damaged-{stamp}")
            old.rename(new)
            moved.append(new)
    return moved


def swap_in(fresh: Path, path: Path) -> None:
    """Put the restored log ``fresh`` at ``path`` (renames within one directory: atomic)."""
    for suffix in _COMPANIONS:
        with contextlib.suppress(FileNotFoundError):
            Path(f"{fresh}{suffix}").unlink()
    fresh.rename(path)


def readable(path: Path) -> bool:
    """Whether SQLite can open the file as a log at all (a backup being checked)."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            conn.execute("SELECT 1 FROM events LIMIT 1").fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        return False
    return True
