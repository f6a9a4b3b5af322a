"""Helpers of the witness tests: a log rewritten the way an attacker who knows the hash chain would."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from libs.store.rows import COLUMNS, GENESIS_HASH, chain_hash

TRIGGERS = ("events_no_update", "events_no_delete", "events_dense_seq", "events_time_forward")


def rewrite_forward(path: Path, seq: int, *, command_id: str = "forged") -> None:
    """Edit row ``seq`` (its command_id) and recompute the hash of every row from there on: the chain is
    intact afterwards, so ``audit verify`` finds nothing."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for trigger in TRIGGERS:
            conn.execute(f"DROP TRIGGER IF EXISTS {trigger}")
        conn.execute("UPDATE rows SET command_id = ? WHERE seq = ?", (command_id, seq))
        prev = GENESIS_HASH
        for row in conn.execute(f"SELECT {COLUMNS} FROM events ORDER BY seq").fetchall():
            prev = chain_hash(prev, row)
            if row[0] >= seq:
                conn.execute("UPDATE rows SET hash = ? WHERE seq = ?", (prev, row[0]))
    finally:
        conn.close()
