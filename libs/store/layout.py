"""How a log file stores its rows: format 1 (the table ``events``) or format 2 (``rows``, the view
``events`` over it; libs/store/schema.py). Every writer inserts through ``Layout``. A reader gets the
same columns, the same rows, in both formats: small reads select from ``events``; the scans (replay,
verify, the witness's leaves, the outbox relay) read the table itself through ``Layout.select``, as
the view's join and its stream spelling (in SQL, per row) cost more than the rest of the scan."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Sequence
from typing import Any

from libs.errors import StoreError
from libs.store.format import READABLE_FORMATS
from libs.store.rows import COLUMNS

__all__ = ["RAW_ROWS", "Layout", "layout_of", "spell_rows", "spell_streams", "stream_key", "stream_text"]


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

# Format 2's rows as stored, in the order of COLUMNS and hash (``spell_rows`` spells them as the view does).
RAW_ROWS = "SELECT seq, recorded_at, stream, version, type, schema_v, event_id, command_id, payload, hash FROM rows"


def stream_text(key: str | bytes) -> str:
    """A stored stream as readers see it (what the view ``events`` gives): the inverse of ``stream_key``."""
    if type(key) is not bytes:
        return key  # type: ignore[return-value]
    return f"pod:{key[1:5].hex()}-{key[5:11].hex('-', 2)}-{key[11:].hex()}"  # 8-4-4-4-12 (C does the middle dashes)


def spell_streams(rows: list[Any], at: int) -> None:
    """The rows of a chunk with the stream at column ``at`` spelled as text, in place (a rewritten row
    is a list, with the same items as the view's tuple)."""
    for i, row in enumerate(rows):
        if type(row[at]) is bytes:
            rows[i] = row = list(row)
            row[at] = stream_text(row[at])


def spell_rows(rows: list[Any], types: dict[int, str]) -> None:
    """Rows of ``RAW_ROWS`` in place as the view gives them: the stream as text, the type's name."""
    for i, (seq, at, stream, version, type_id, *rest) in enumerate(rows):
        rows[i] = (seq, at, stream_text(stream), version, types.get(type_id), *rest)


class Layout:
    """The format of one open log file: where its rows go, and how a stream's last version is found."""

    def __init__(self, log_format: str) -> None:
        if log_format not in READABLE_FORMATS:
            raise StoreError(f"log format {log_format} is not one this gpuledger reads ({', '.join(READABLE_FORMATS)})")
        self.format = log_format
        self.table = "events" if log_format == "1" else "rows"
        # Format 2's type names known to be committed in the file (``types`` is append-only), so an insert
        # of a known type skips its INSERT OR IGNORE; those the open transaction adds, until ``settled``.
        self._types: set[str] = set()
        self._adding: set[str] = set()

    def insert(self, conn: sqlite3.Connection, rows: Sequence[Sequence[object]]) -> None:
        """Insert rows of COLUMNS followed by their hash (in the caller's transaction)."""
        if self.format == "1":
            conn.executemany(_INSERT_1, rows)
            return
        names = {row[4] for row in rows} - self._types
        if names:
            conn.executemany("INSERT OR IGNORE INTO types (name) VALUES (?)", [(n,) for n in names])
            self._adding |= names  # type: ignore[arg-type]
        conn.executemany(_INSERT_2, [(r[0], r[1], stream_key(r[2]), *r[3:]) for r in rows])  # type: ignore[arg-type]

    def settled(self, committed: bool) -> None:
        """The caller's transaction ended: ``committed`` with every insert since the last call in it (no
        savepoint rolled back), so their types are in the file; else they are looked for again."""
        if committed:
            self._types |= self._adding
        self._adding.clear()

    def select(self, conn: sqlite3.Connection, columns: str, schema: str = "main") -> tuple[str, int | None]:
        """The select list over ``self.table`` giving the view's ``columns`` (a comma-separated list of
        its column names), and the column whose pod keys the caller spells as text (``stream_text``,
        ``spell_streams``; None: no column to spell).

        Format 2: the type's name comes from a CASE over ``types`` read now (in the caller's
        transaction, so it names every row that transaction sees), evaluated in SQLite; a pod stream's
        key is spelled as text in Python (~4 times cheaper than in SQL), only when ``stream_id`` is
        asked for. ``type_code``: the type as stored, format 2's id (``Layout.type_names``) or format 1's name
        (a scan that only looks types up saves the CASE and a string per row: ~15% of it)."""
        if self.format == "1":
            return plain_columns(columns), None
        names = [c.strip() for c in columns.split(",")]
        out: list[str] = []
        spelled: int | None = None
        for i, name in enumerate(names):
            if name == "type_code":
                out.append("type")  # the id as stored: ``type_names`` names it
            elif name == "type":
                whens = " ".join(f"WHEN {tid} THEN '{tname.replace(chr(39), chr(39) * 2)}'" for tid, tname in
                                 self.type_names(conn, schema).items())
                out.append(f"CASE type {whens} END" if whens else "NULL")
            elif name == "stream_id":
                out.append("stream")
                spelled = i
            else:
                out.append(name)
        return ", ".join(out), spelled

    def type_names(self, conn: sqlite3.Connection, schema: str = "main") -> dict[int, str]:
        """Format 2's type ids and their names (empty for format 1, whose rows hold the names)."""
        if self.format == "1":
            return {}
        return dict(conn.execute(f"SELECT id, name FROM {schema}.types").fetchall())

    def stream_version(self, conn: sqlite3.Connection, stream: str) -> int | None:
        """The last version of ``stream`` in the live rows (None when it has none)."""
        if self.format == "1":
            row = conn.execute("SELECT MAX(version) FROM events WHERE stream_id = ?", (stream,)).fetchone()
        else:
            row = conn.execute("SELECT MAX(version) FROM rows WHERE stream = ?", (stream_key(stream),)).fetchone()
        return None if row[0] is None else int(row[0])


def plain_columns(columns: str) -> str:
    """``columns`` for a table that stores the type's name (format 1, an archive segment, the ``events``
    view): there the ``type_code`` a scan may ask for is the name itself."""
    return ", ".join("type" if c.strip() == "type_code" else c.strip() for c in columns.split(","))


def layout_of(conn: sqlite3.Connection, schema: str = "main") -> Layout:
    """The layout of the log ``conn`` has open (``schema``: an attached one)."""
    try:
        row = conn.execute(f"SELECT value FROM {schema}.meta WHERE key = 'format'").fetchone()
    except sqlite3.OperationalError as exc:
        raise StoreError(f"not an event log (no meta table): {exc}") from exc
    return Layout(row[0] if row else "1")
