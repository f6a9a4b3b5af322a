"""How a log file stores its rows: format 1 (the table ``events``) or format 2 (``rows``, the view
``events`` over it; libs/store/schema.py). Every writer inserts through ``Layout``, every reader
selects from ``events``: the same columns, the same rows, in both formats."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Sequence

from libs.errors import StoreError
from libs.store.format import READABLE_FORMATS
from libs.store.rows import COLUMNS

__all__ = ["Layout", "layout_of", "stream_key"]

_POD_UUID = re.compile(r"^pod:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_POD_KEY = b"\x01"
_INSERT_1 = f"INSERT INTO events ({COLUMNS}, hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
_INSERT_2 = ("INSERT INTO rows (seq, recorded_at, stream, version, type, schema_v, event_id, command_id, payload, "
             "hash) VALUES (?, ?, ?, ?, (SELECT id FROM types WHERE name = ?), ?, ?, ?, ?, ?)")


def stream_key(stream: str) -> str | bytes:
    """How format 2 stores a stream: ``pod:<lowercase uuid>`` as x'01' + the 16 bytes (the view spells it
    back exactly), any other stream as its text."""
    if _POD_UUID.match(stream):
        return _POD_KEY + bytes.fromhex(stream[4:].replace("-", ""))
    return stream


class Layout:
    """The format of one open log file: where its rows go, and how a stream's last version is found."""

    def __init__(self, log_format: str) -> None:
        if log_format not in READABLE_FORMATS:
            raise StoreError(f"log format {log_format} is not one this gpuledger reads ({', '.join(READABLE_FORMATS)})")
        self.format = log_format
        self.table = "events" if log_format == "1" else "rows"

    def insert(self, conn: sqlite3.Connection, rows: Sequence[Sequence[object]]) -> None:
        """Insert rows of COLUMNS followed by their hash (in the caller's transaction)."""
        if self.format == "1":
            conn.executemany(_INSERT_1, rows)
            return
        names = {row[4] for row in rows}
        conn.executemany("INSERT OR IGNORE INTO types (name) VALUES (?)", [(n,) for n in names])
        conn.executemany(_INSERT_2, [(r[0], r[1], stream_key(r[2]), *r[3:]) for r in rows])  # type: ignore[arg-type]

    def stream_version(self, conn: sqlite3.Connection, stream: str) -> int | None:
        """The last version of ``stream`` in the live rows (None when it has none)."""
        if self.format == "1":
            row = conn.execute("SELECT MAX(version) FROM events WHERE stream_id = ?", (stream,)).fetchone()
        else:
            row = conn.execute("SELECT MAX(version) FROM rows WHERE stream = ?", (stream_key(stream),)).fetchone()
        return None if row[0] is None else int(row[0])


def layout_of(conn: sqlite3.Connection, schema: str = "main") -> Layout:
    """The layout of the log ``conn`` has open (``schema``: an attached one)."""
    try:
        row = conn.execute(f"SELECT value FROM {schema}.meta WHERE key = 'format'").fetchone()
    except sqlite3.OperationalError as exc:
        raise StoreError(f"not an event log (no meta table): {exc}") from exc
    return Layout(row[0] if row else "1")
