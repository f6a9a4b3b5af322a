"""The audit view of the log: who held which GPU share, since when, granted by which request.

``LedgerState`` keeps everything the allocator needs to answer (the full Allocate response of every
live allocation). An audit needs much less, and replaying a million events must stay under two
seconds, so this fold reads narrow *views* of the events: msgspec decodes only the fields listed
in ``libs.ledger.views`` and skips the rest of each body (the stored response, the kubelet device IDs)
without building objects for it. Event types the view does not know are decoded in full and passed to
``on_other``.

It folds every event type that changes holdings exactly as ``LedgerState`` does: grants, imports,
releases, corrections (``alloc.corrected`` moves a grant to its real owner), an app container taking
over its init container's hold (the kubelet device IDs are read from the rows only for a pod that has
a charged init-container grant), inventories and GPU health. The rules themselves live in
``libs.ledger.rules``, shared with ``LedgerState``.

    view = audit_replay(path, upto_seq=120)       # or upto_time=ns
    view.holders()                                # [Holding], oldest grant first
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from functools import partial
from pathlib import Path

import msgspec

from libs.events.codec import StoredEvent
from libs.events.schema import AllocationGranted, GpuInfo, GpuShare
from libs.ledger.rules import move_to_real_owner, takes_over
from libs.ledger.views import (
    ClaimPreparedView,
    CorrectionView,
    GrantView,
    HealthView,
    ImportView,
    InventoryView,
    ReleaseView,
    View,
    iter_views,
    plain,
    request_id_in_row,
    view_of,
)
from libs.store.packed import hex_text, pack_uuid, uuid_text
from libs.store.replay import by_seq, last_seq_wanted, open_reader, stored_at

__all__ = ["AuditFold", "AuditView", "GpuHolding", "Holding", "audit_replay", "grant_device_ids"]


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
    core_limit: int | None = None
    # False once a later container of the pod reuses this init container's devices (held once, by it)
    charged: bool = True
    corrected_seq: int = 0         # seq of the last alloc.corrected (0: the grant's guess stood)


class GpuHolding(msgspec.Struct, kw_only=True):
    index: int
    uuid: str
    memory_total: int
    cores_used: int = 0
    memory_used: int = 0
    holders: list[str] = msgspec.field(default_factory=list)  # alloc_ids, oldest first
    healthy: bool = True
    health_reason: str = ""        # why it is unhealthy (empty when healthy)


class AuditView(msgspec.Struct, kw_only=True):
    """What ``gpuledger replay --json`` prints."""

    seq: int
    time: int
    node: str
    gpus: list[GpuHolding]
    allocations: list[Holding]


class AuditFold:
    """``LedgerState``'s fold over the views; GPU usage is summed once, at the end.

    ``device_ids(seq)`` reads a grant's kubelet device IDs from its row: the views leave them out
    (decoding them costs ~10% of a replay), and only an app container of a pod with a charged
    init-container grant needs them.
    """

    def __init__(self, device_ids: Callable[[int], tuple[str, ...]]) -> None:
        self.device_ids = device_ids
        self.seq = 0
        self.time = 0
        self.node = ""
        self.gpus: tuple[GpuInfo, ...] = ()
        # Keys are the ids as the views give them: text, or bytes from a version 4 body (spelled out by
        # ``result``); a log written across the upgrade is matched by the other form when one misses.
        self.live: dict[str | bytes, tuple[int, int, GrantView]] = {}  # alloc_id -> (seq, at, grant as now owned)
        self.inits: dict[str | bytes, set[str | bytes]] = {}  # pod_uid, both forms -> its charged init grants
        self.uncharged: set[str | bytes] = set()  # grants handed on to a later container of the pod
        self.corrected: dict[str | bytes, int] = {}  # alloc_id -> seq of its last correction
        self.health: dict[str, HealthView] = {}  # GPU uuid -> last transition

    def apply(self, seq: int, at: int, view: View | StoredEvent) -> None:
        if isinstance(view, GrantView):  # the common types first: this runs a million times a second
            if view.init_container:
                self._add_init(view.pod_uid, view.alloc_id)
            elif view.pod_uid in self.inits:
                self._absorb(seq, view)
            self.live[view.alloc_id] = (seq, at, view)
        elif isinstance(view, ReleaseView):
            gone = self.live.pop(self._live_key(view.alloc_id), None)
            if gone is not None and gone[2].init_container:
                self._forget_init(gone[2])
        elif isinstance(view, InventoryView):
            self.node, self.gpus = view.node, view.gpus
        elif isinstance(view, CorrectionView):
            self._correct(seq, view)
        elif isinstance(view, HealthView):
            self.health[view.uuid] = view
        elif isinstance(view, StoredEvent):  # an older schema version, or a type that changes no holding
            full = view_of(view)
            if full is not view:
                self.apply(seq, at, full)
                return
        self.seq, self.time = seq, at

    def _absorb(self, seq: int, grant: GrantView) -> None:
        """As ``LedgerState._absorb_reused``: the app container takes over the init grants whose
        kubelet device IDs it shares (``rules.takes_over``)."""
        mine = set(self.device_ids(seq))
        for alloc_id in list(self.inits[grant.pod_uid]):
            if takes_over(mine, self.device_ids(self.live[alloc_id][0])):
                self.uncharged.add(alloc_id)
                self._forget_init(self.live[alloc_id][2])

    def _live_key(self, alloc_id: str | bytes) -> str | bytes:
        """The key of the live grant ``alloc_id`` names: itself, or its text when the grant was read
        from an older body (a release of version 4 for a grant of version 3)."""
        if alloc_id in self.live or type(alloc_id) is not bytes:
            return alloc_id
        text = hex_text(alloc_id)
        return text if text in self.live else alloc_id

    def _add_init(self, pod_uid: str | bytes, alloc_id: str | bytes) -> None:
        for key in _pod_keys(pod_uid):  # rare: both forms, so a grant of either body version finds it
            self.inits.setdefault(key, set()).add(alloc_id)

    def _forget_init(self, grant: GrantView) -> None:
        for key in _pod_keys(grant.pod_uid):
            held = self.inits.get(key)
            if held is not None:
                held.discard(grant.alloc_id)
                if not held:
                    del self.inits[key]

    def _correct(self, seq: int, ev: CorrectionView) -> None:
        """As ``LedgerState._correct``: the grant now belongs to the real owner; the cores, kubelet
        device IDs and whether it is charged stay."""
        key = self._live_key(ev.alloc_id)
        old = self.live.get(key)
        if old is None:
            return
        granted_seq, at, grant = old
        if grant.init_container:
            self._forget_init(grant)
        moved = move_to_real_owner(grant, ev)
        self.live[key] = (granted_seq, at, moved)
        self.corrected[key] = seq
        if moved.init_container and key not in self.uncharged:
            self._add_init(moved.pod_uid, key)

    def result(self, conn: sqlite3.Connection) -> AuditView:
        uncharged, corrected = self.uncharged, self.corrected
        holders = [
            Holding(alloc_id=g.alloc_id, pod_uid=g.pod_uid, namespace=g.namespace, pod_name=g.pod_name,
                    container=g.container, init_container=g.init_container, cores=g.cores, memory=g.memory,
                    shares=g.shares, since=at, granted_seq=seq, request_id=g.request_id,
                    source=_source(g), core_limit=g.core_limit,
                    charged=key not in uncharged, corrected_seq=corrected.get(key, 0))
            for key, (seq, at, raw) in sorted(self.live.items(), key=lambda t: t[1][0])
            for g in (plain(raw),)
        ]
        in_row = {seq for seq, _, raw in self.live.values() if request_id_in_row(raw)}
        _fill_event_ids(conn, holders, in_row)
        gpus = {g.index: GpuHolding(index=g.index, uuid=g.uuid, memory_total=g.memory) for g in self.gpus}
        for gpu in gpus.values():
            health = self.health.get(gpu.uuid)  # by uuid, as LedgerState: health follows a GPU that moved
            if health is not None:
                gpu.healthy, gpu.health_reason = health.healthy, health.why
        for h in holders:
            if not h.charged:
                continue
            for share in h.shares:
                gpu = gpus.get(share.index)
                if gpu is not None:
                    gpu.cores_used += share.cores
                    gpu.memory_used += share.memory
                    gpu.holders.append(h.alloc_id)
        return AuditView(seq=self.seq, time=self.time, node=self.node,
                         gpus=[gpus[i] for i in sorted(gpus)], allocations=holders)


def _pod_keys(pod_uid: str | bytes) -> tuple[str | bytes, ...]:
    """A pod UID in both forms a view may give it: text and (a canonical UUID) version 4's bytes."""
    return (pod_uid, uuid_text(pod_uid)) if type(pod_uid) is bytes else (pod_uid, pack_uuid(pod_uid))  # type: ignore[arg-type]


def _source(g: GrantView) -> str:
    if isinstance(g, ImportView):
        return g.source
    return "dra-claim" if isinstance(g, ClaimPreparedView) else "allocate"


def _fill_event_ids(conn: sqlite3.Connection, holders: list[Holding], in_row: set[int]) -> None:
    """Each holder's event id, and its request id where the grant's body leaves it to the row
    (``in_row``: their seqs)."""
    ids = by_seq(conn, "event_id, command_id", [h.granted_seq for h in holders])
    for h in holders:
        event_id, command_id = ids[h.granted_seq]
        h.event_id = event_id.hex()
        if h.granted_seq in in_row:
            h.request_id = command_id or ""


def grant_device_ids(conn: sqlite3.Connection, seq: int) -> tuple[str, ...]:
    """The kubelet device IDs of the grant at ``seq`` (read in full: rare, so simple)."""
    stored = stored_at(conn, seq)
    ev = None if stored is None else stored.event
    return ev.device_ids if isinstance(ev, AllocationGranted) else ()


def audit_replay(
    path: Path,
    *,
    upto_seq: int | None = None,
    upto_time: int | None = None,
    on_other: Callable[[StoredEvent], object] | None = None,
) -> AuditView:
    """The holdings right after ``upto_seq`` / at ``upto_time`` (both: the earlier), else now."""
    conn = open_reader(path, merged=False)  # one scan of the history: its segments are read one by one
    try:
        upto_seq = last_seq_wanted(conn, upto_seq, upto_time)
        fold = AuditFold(partial(grant_device_ids, conn))
        apply = fold.apply
        for seq, at, view in iter_views(conn, upto_seq=upto_seq):
            apply(seq, at, view)
            if on_other is not None and isinstance(view, StoredEvent):
                on_other(view)
        return fold.result(conn)
    finally:
        conn.close()

