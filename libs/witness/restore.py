"""Rebuild a node's ledger.sqlite from a copy of its events (the fleet stream, or the node's own JetStream
stream), checked against the hash chain and a cosigned checkpoint before anything is written.

    report = restore_ledger(records, dest, checkpoint=note, witness_key=key, node_key=node_key)

``records`` are the node's ``EventRecord`` messages in seq order (the JSON each stream message holds),
optionally paired with the row hash the fleet stream carries: ``(record, hash)``. Every row is rebuilt
exactly as the writer stored it, its chain hash recomputed (and compared with the carried one), its
leaf added to the RFC 6962 tree; at the checkpoint's size the root must be the cosigned one, so a copy
that lost, reordered or altered a witnessed event is refused, naming the seq where it can. The ledger is
written to a temporary file in one transaction and renamed into place: the allocator, started on the
state dir afterwards, replays it like any log it wrote itself. Rows past the checkpoint are kept, and
reported as not yet witnessed.

A payload is rebuilt by re-encoding the record's event: exact for events stored at today's schema
version (all of them today). An event stored at an older schema is carried upcast in a record, so its
original bytes cannot be rebuilt from the record alone and the chain check names it. A grant, import or
correction is stored compact (docs/compact-log.md): its record spells the response out, its row names
the response settings it was written under, so ``response_settings`` passes those the node used (its
log's ``meta`` entries); with a carried hash the form that gives it is taken (``rows.rebuilt_row``),
without one the most compact form. The settings used are recorded in the restored log's ``meta``.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from libs.errors import StoreError
from libs.events.codec import EventRecord, from_record
from libs.placement.recorded import ResponseSettings
from libs.store.compact import settings_row
from libs.store.layout import layout_of
from libs.store.log import create_schema
from libs.store.rows import GENESIS_HASH, chain_hash, rebuilt_row
from libs.witness.audit import trusted_checkpoint
from libs.witness.files import NodeFiles, row_leaf
from libs.witness.merkle import CompactRange
from libs.witness.note import SignedNote, Verifier

__all__ = ["RestoreReport", "install_witness_files", "restore_ledger"]



class RestoreReport(msgspec.Struct, kw_only=True):
    path: str
    events: int
    witnessed_size: int          # rows covered by the cosigned checkpoint
    head_hash: str               # the chain hash of the last row (hex)
    origin: str


def restore_ledger(
    records: Iterable[EventRecord | tuple[EventRecord, bytes | None]],
    dest: Path,
    *,
    checkpoint: SignedNote,
    witness_key: Verifier,
    node_key: Verifier | None = None,
    response_settings: Sequence[ResponseSettings] = (),
) -> RestoreReport:
    if dest.exists():
        raise StoreError(f"{dest} exists: restore writes a fresh ledger only (move the old one aside first)")
    cp, _ = trusted_checkpoint(checkpoint, node_key, witness_key)
    rows: list[tuple[object, ...]] = []
    used: dict[bytes, ResponseSettings] = {}
    prev, tree, last_at = GENESIS_HASH, CompactRange(), 0
    for item in records:
        record, carried = item if isinstance(item, tuple) else (item, None)
        seq = len(rows) + 1
        if record.seq != seq:
            raise StoreError(f"the copy jumps from seq {seq - 1} to {record.seq}: seq {seq} is missing")
        if record.recorded_at < last_at:
            raise StoreError(f"seq {seq}: recorded_at goes backwards in the copy")
        row, settings = rebuilt_row(from_record(record), prev, response_settings, carried)
        if settings is not None:
            used.setdefault(settings.digest, settings)
        prev = chain_hash(prev, row)
        if carried is not None and carried != prev:
            raise StoreError(f"seq {seq}: the copy's row hash is not the recomputed chain hash: this row, or one "
                             "before it, differs from what the node wrote")
        tree.append(row_leaf(row))
        if tree.size == cp.size and tree.root() != cp.root:
            raise StoreError(f"the copy's first {cp.size} events do not give the root the witness cosigned for "
                             f"{cp.origin}: the copy differs from the node's witnessed log (or its grants were "
                             "written under response settings not given to the restore)")
        rows.append((*row, prev))
        last_at = record.recorded_at
    if len(rows) < cp.size:
        raise StoreError(f"the copy ends at seq {len(rows)} but the witness cosigned {cp.size} events of {cp.origin}: "
                         "events are missing from the copy")
    if cp.size == 0 and tree.size == 0:
        raise StoreError("nothing to restore: the copy holds no event")
    _write(rows, dest, list(used.values()))
    return RestoreReport(path=str(dest), events=len(rows), witnessed_size=cp.size, head_hash=prev.hex(),
                         origin=cp.origin)


def _write(rows: list[tuple[object, ...]], dest: Path, settings: list[ResponseSettings]) -> None:
    tmp = dest.with_name(dest.name + ".restoring")
    for stale in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
        stale.unlink(missing_ok=True)
    create_schema(tmp)
    conn = sqlite3.connect(tmp, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("BEGIN IMMEDIATE")
        layout_of(conn).insert(conn, rows)
        conn.executemany("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", [settings_row(s) for s in settings])
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    os.replace(tmp, dest)


def install_witness_files(state_dir: Path, checkpoint: SignedNote, witness_key: Verifier) -> None:
    """Give the restored state dir the cosigned checkpoint it was checked against and the witness key, so
    ``audit verify --witness`` works there at once. The node key is not restored: see docs/witness.md."""
    files = NodeFiles(state_dir)
    files.dir.mkdir(parents=True, exist_ok=True)
    files.append_cosigned(checkpoint)
    files.witness_pub.write_text(witness_key.encode() + "\n")
