"""Logs in format 1, the row format before format 2 (docs/compact-log.md, "Rows"), as release 0.1 and
every release before format 2 wrote them: the schema is taken from the committed release 0.1 fixture
(so it is the old one exactly: no archive catalog, the unconditional DELETE trigger)."""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from libs.events.schema import AllocationGranted, Event
from libs.store.layout import Layout
from libs.store.rows import GENESIS_HASH, chain_hash, event_row

__all__ = ["FIXTURE", "write_format1_log"]

FIXTURE = Path(__file__).parent.parent / "fixtures" / "ledger-v1.sqlite"
START_NS = 1_790_000_000_000_000_000


def write_format1_log(path: Path, events: Iterable[Event], *, step_ns: int = 1_000_000) -> int:
    """A new format 1 log at ``path`` holding ``events`` (grants stored compact, their responses kept); the
    last seq."""
    source = sqlite3.connect(f"file:{FIXTURE}?mode=ro", uri=True)
    try:
        ddl = [sql for (sql,) in source.execute(
            "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL ORDER BY type = 'table' DESC, rowid")]
    finally:
        source.close()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        for sql in ddl:
            conn.execute(sql)
        conn.execute("INSERT INTO meta VALUES ('format', '1')")
        rng, versions, prev, seq = random.Random(1), dict[str, int](), GENESIS_HASH, 0
        rows = []
        for seq, ev in enumerate(events, start=1):
            stream = ev.stream()
            versions[stream] = versions.get(stream, 0) + 1
            command = ev.request_id if isinstance(ev, AllocationGranted) else None
            row = event_row(seq, START_NS + seq * step_ns, stream, versions[stream], ev, rng.randbytes(16), command)
            prev = chain_hash(prev, row)
            rows.append((*row, prev))
        conn.execute("BEGIN")
        Layout("1").insert(conn, rows)
        conn.execute("COMMIT")
        return seq
    finally:
        conn.close()
