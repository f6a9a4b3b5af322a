"""The audit view of the log: who held which GPU share, since when, granted by which request.

``LedgerState`` keeps everything the allocator needs to answer (the full Allocate response of every
live allocation). An audit needs much less, and replaying a million events must stay under two
seconds, so this fold reads narrow *views* of the events: msgspec decodes only the fields listed
below and skips the rest of each body (the stored response, the kubelet device IDs) without building
objects for it. Event types the view does not know are decoded in full and passed to ``on_other``.

    view = audit_replay(path, upto_seq=120)       # or upto_time=ns
    view.holders()                                # [Holding], oldest grant first
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from libs.events.codec import StoredEvent
from libs.events.schema import EVENT_TYPES, AllocationGranted, AllocationReleased, GpuInfo, GpuShare, InventoryRecorded
from libs.store.replay import iter_rows, open_reader, seq_at_time
from libs.store.rows import COLUMNS, row_to_stored

__all__ = ["AuditView", "GpuHolding", "Holding", "audit_replay", "iter_views"]


class _Granted(msgspec.Struct, frozen=True, gc=False, tag="alloc.granted"):
    alloc_id: str
    request_id: str
    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    cores: int
    memory: int
    shares: tuple[GpuShare, ...]
    init_container: bool = False


class _Imported(_Granted, frozen=True, gc=False, tag="alloc.imported"):
    source: str = ""


class _Released(msgspec.Struct, frozen=True, gc=False, tag="alloc.released"):
    alloc_id: str
    pod_uid: str
    container: str
    reason: str


class _Inventory(msgspec.Struct, frozen=True, gc=False, tag="inventory.recorded"):
    node: str
    gpus: tuple[GpuInfo, ...]


_VIEWS = (_Granted, _Imported, _Released, _Inventory)
_VIEW_TAGS = {cls.__struct_config__.tag for cls in _VIEWS}
_decode_view = msgspec.msgpack.Decoder(_Granted | _Imported | _Released | _Inventory).decode

View = _Granted | _Released | _Inventory


class Holding(msgspec.Struct, kw_only=True):
    """One live allocation as an auditor reads it."""

    alloc_id: str
    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    init_container: bool
    cores: int
    memory: int
    shares: tuple[GpuShare, ...]
    since: int                     # unix ns of the grant
    granted_seq: int
    request_id: str                # the Allocate request (the grant's command_id)
    event_id: str = ""             # the grant's event id (filled for the holders printed)
    source: str = "allocate"       # or the checkpoint an alloc.imported came from


class GpuHolding(msgspec.Struct, kw_only=True):
    index: int
    uuid: str
    memory_total: int
    cores_used: int = 0
    memory_used: int = 0
    holders: list[str] = msgspec.field(default_factory=list)  # alloc_ids, oldest first


class AuditView(msgspec.Struct, kw_only=True):
    """What ``gpuledger replay --json`` prints."""

    seq: int
    time: int
    node: str
    gpus: list[GpuHolding]
    allocations: list[Holding]


def iter_views(
    conn: sqlite3.Connection, *, after_seq: int = 0, upto_seq: int | None = None
) -> Iterator[tuple[int, int, View | StoredEvent]]:
    """(seq, recorded_at, view) in seq order; types without a view come as a full ``StoredEvent``."""
    # Only the columns the views need: each extra column costs ~10% of the scan. The rare row that
    # needs the full decode (an old schema version, a type without a view) is read again by seq.
    current = {tag: EVENT_TYPES[tag].SCHEMA for tag in _VIEW_TAGS if tag in EVENT_TYPES}
    for seq, at, type_name, schema_v, payload in iter_rows(
        conn, "seq, recorded_at, type, schema_v, payload", after_seq=after_seq, upto_seq=upto_seq
    ):
        if current.get(type_name) == schema_v:
            yield seq, at, _decode_view(payload)
        else:
            row = conn.execute(f"SELECT {COLUMNS} FROM events WHERE seq = ?", (seq,)).fetchone()
            yield seq, at, row_to_stored(row)


class _Fold:
    def __init__(self) -> None:
        self.seq = 0
        self.time = 0
        self.node = ""
        self.gpus: tuple[GpuInfo, ...] = ()
        self.live: dict[str, tuple[int, int, _Granted]] = {}  # alloc_id -> (seq, at, grant)

    def apply(self, seq: int, at: int, view: View | StoredEvent) -> None:
        if isinstance(view, _Granted):
            self.live[view.alloc_id] = (seq, at, view)
        elif isinstance(view, _Released):
            self.live.pop(view.alloc_id, None)
        elif isinstance(view, _Inventory):
            self.node, self.gpus = view.node, view.gpus
        elif isinstance(view.event, AllocationGranted):  # an upcast grant, read on the full path
            fields = {f: getattr(view.event, f) for f in _Granted.__struct_fields__}
            self.live[view.event.alloc_id] = (seq, at, _Granted(**fields))
        elif isinstance(view.event, AllocationReleased):
            self.live.pop(view.event.alloc_id, None)
        elif isinstance(view.event, InventoryRecorded):
            self.node, self.gpus = view.event.node, view.event.gpus
        self.seq, self.time = seq, at

    def result(self, conn: sqlite3.Connection) -> AuditView:
        holders = [
            Holding(alloc_id=g.alloc_id, pod_uid=g.pod_uid, namespace=g.namespace, pod_name=g.pod_name,
                    container=g.container, init_container=g.init_container, cores=g.cores, memory=g.memory,
                    shares=g.shares, since=at, granted_seq=seq, request_id=g.request_id,
                    source=g.source if isinstance(g, _Imported) else "allocate")
            for seq, at, g in sorted(self.live.values(), key=lambda t: t[0])
        ]
        _fill_event_ids(conn, holders)
        gpus = {g.index: GpuHolding(index=g.index, uuid=g.uuid, memory_total=g.memory) for g in self.gpus}
        for h in holders:
            for share in h.shares:
                gpu = gpus.get(share.index)
                if gpu is not None:
                    gpu.cores_used += share.cores
                    gpu.memory_used += share.memory
                    gpu.holders.append(h.alloc_id)
        return AuditView(seq=self.seq, time=self.time, node=self.node,
                         gpus=[gpus[i] for i in sorted(gpus)], allocations=holders)


def _fill_event_ids(conn: sqlite3.Connection, holders: list[Holding]) -> None:
    for start in range(0, len(holders), 500):
        part = holders[start:start + 500]
        marks = ",".join("?" * len(part))
        ids = dict(conn.execute(f"SELECT seq, event_id FROM events WHERE seq IN ({marks})",
                                [h.granted_seq for h in part]).fetchall())
        for h in part:
            h.event_id = ids[h.granted_seq].hex()


def audit_replay(
    path: Path,
    *,
    upto_seq: int | None = None,
    upto_time: int | None = None,
    on_other: Callable[[StoredEvent], object] | None = None,
) -> AuditView:
    """The holdings right after ``upto_seq`` / at ``upto_time`` (both: the earlier), else now."""
    conn = open_reader(path)
    try:
        if upto_time is not None:
            bound = seq_at_time(conn, upto_time)
            upto_seq = bound if upto_seq is None else min(upto_seq, bound)
        fold = _Fold()
        apply = fold.apply
        for seq, at, view in iter_views(conn, upto_seq=upto_seq):
            apply(seq, at, view)
            if on_other is not None and isinstance(view, StoredEvent):
                on_other(view)
        return fold.result(conn)
    finally:
        conn.close()

