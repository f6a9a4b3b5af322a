"""Format 2's type names: an insert skips the ``types`` row of a type already committed, never of one a
rolled-back transaction took away (the row would then name no type, and SQLite refuses it)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from libs.store.layout import layout_of
from libs.store.log import create_schema


def _row(seq: int, type_name: str) -> tuple[object, ...]:
    return (seq, seq, f"stream-{seq}", 1, type_name, 1, bytes(16), None, b"{}", bytes(32))


def test_a_type_is_inserted_again_after_a_rollback_and_skipped_once_committed(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    create_schema(path)
    conn = sqlite3.connect(path, isolation_level=None)
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    layout = layout_of(conn)

    conn.execute("BEGIN IMMEDIATE")
    layout.insert(conn, [_row(1, "test.kind")])
    conn.execute("ROLLBACK")
    layout.settled(False)
    assert conn.execute("SELECT count(*) FROM types WHERE name = 'test.kind'").fetchone() == (0,)

    conn.execute("BEGIN IMMEDIATE")
    layout.insert(conn, [_row(1, "test.kind")])  # the type row again: the rollback took the first away
    conn.execute("COMMIT")
    layout.settled(True)

    statements.clear()
    conn.execute("BEGIN IMMEDIATE")
    layout.insert(conn, [_row(2, "test.kind")])
    conn.execute("COMMIT")
    layout.settled(True)
    assert not [s for s in statements if "INTO types" in s]  # committed: known, not inserted again
    assert conn.execute("SELECT t.name FROM rows r JOIN types t ON t.id = r.type ORDER BY r.seq").fetchall() == [
        ("test.kind",), ("test.kind",)]
    conn.close()
