"""Rebuild a damaged event log from a copy of its events: the node's JetStream stream (where every
event is published with stream seq == log seq) or a backup file (``gpuledger log restore``).

The new log is written next to the old one and then swapped in, so a failed restore changes nothing;
the damaged file (with its -wal/-shm and the fold snapshot taken from it) is kept beside it under a
``.damaged-<time>`` suffix for inspection. Each row's hash is computed afresh over the same columns
the writer hashes, so the result passes ``gpuledger audit verify``; an event of an older schema that
the stream carries upcast is stored at its current schema version (its hash then differs from the
original's, which ``log restore`` reports against the snapshot's recorded hash when there is one).

A stream record spells a grant's response out; the log stored it compact (docs/compact-log.md), named by
the response settings it was written under. Each grant is stored again in the form whose chain hash is
the one the stream carries (``rows.rebuilt_row``: under one of the given response settings, with its
response kept, or as body version 1), so a restored log is the lost one byte for byte when the settings
are known; the settings used are recorded in the new log's ``meta``. Without a match the grant is stored
with its response kept: still exact to read, only the hash differs.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from libs.errors import StoreError
from libs.events.codec import StoredEvent
from libs.placement.recorded import ResponseSettings
from libs.store.compact import SETTINGS_PREFIX, settings_row
from libs.store.layout import layout_of
from libs.store.rows import GENESIS_HASH, chain_hash, rebuilt_row
from libs.store.writer import connect

__all__ = ["recorded_settings", "set_aside", "swap_in", "write_restored"]

_COMPANIONS = ("-wal", "-shm")


def write_restored(path: Path, events: Iterable[StoredEvent], response_settings: Sequence[ResponseSettings] = ()
                   ) -> tuple[int, dict[int, str]]:
    """Write ``events`` (seq 1, 2, ... without a gap) as a fresh log at ``path``; (count, seq -> hex hash).
    ``response_settings``: those the grants may have been written under (see the module's docstring)."""
    from libs.store.log import create_schema

    for leftover in (path, *(Path(f"{path}{s}") for s in _COMPANIONS)):
        leftover.unlink(missing_ok=True)
    create_schema(path)
    conn = connect(path)
    layout = layout_of(conn)
    hashes: dict[int, str] = {}
    prev, count = GENESIS_HASH, 0
    recorded: set[bytes] = set()
    try:
        conn.execute("BEGIN IMMEDIATE")
        for stored in events:
            if stored.seq != count + 1:
                raise StoreError(f"the source skips from seq {count} to seq {stored.seq}: it is not a whole log")
            carried = bytes.fromhex(stored.row_hash) if stored.row_hash else None
            row, settings = rebuilt_row(stored, prev, response_settings, carried)
            if settings is not None and settings.digest not in recorded:
                conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", settings_row(settings))
                recorded.add(settings.digest)
            prev = chain_hash(prev, row)
            layout.insert(conn, [(*row, prev)])
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


def recorded_settings(path: Path) -> list[ResponseSettings]:
    """The response settings recorded in the log (or backup) at ``path``, as far as it can still be read
    (a damaged log may have lost them: [] then)."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = conn.execute("SELECT value FROM meta WHERE key LIKE ?", (SETTINGS_PREFIX + "%",)).fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        return []
    found = []
    for (value,) in rows:
        with contextlib.suppress(msgspec.MsgspecError):
            found.append(msgspec.json.decode(value, type=ResponseSettings))
    return found


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
