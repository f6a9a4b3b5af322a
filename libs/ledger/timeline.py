"""The timeline of one pod or one GPU, read from the log (``gpuledger history``).

A pod is named by UID or by name (``name`` or ``namespace/name``; a name can match several UIDs over
time, each is listed). A GPU is named by NVML index or UUID. Grants and releases come from the same
narrow views as the audit replay; any other event type is matched by the fields it carries
(``pod_uid`` for pods; ``index``/``uuid``/``gpu_index``/``gpu_uuid`` for GPUs), so types added later
show up without changes here.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import msgspec

from libs.events.codec import StoredEvent, format_time
from libs.events.schema import GpuShare
from libs.ledger.views import (
    ClaimPreparedView,
    ClaimUnpreparedView,
    CorrectionView,
    GrantView,
    HealthView,
    ImportView,
    InventoryView,
    ReleaseView,
    id_text,
    iter_views,
    plain,
    request_id_in_row,
    uid_text,
    view_tag,
)
from libs.store.packed import pack_gpu
from libs.store.replay import by_seq, open_reader

__all__ = ["NOT_IN_INVENTORY", "Entry", "gpu_history", "pod_history"]

NOT_IN_INVENTORY = "not in the inventory"  # an inventory entry of a GPU history that does not name the GPU


class Entry(msgspec.Struct, kw_only=True, omit_defaults=True):
    seq: int
    recorded_at: int          # unix ns
    type: str
    pod_uid: str = ""
    namespace: str = ""
    pod_name: str = ""
    container: str = ""
    alloc_id: str = ""
    cores: int = 0
    memory: int = 0
    shares: tuple[GpuShare, ...] = ()
    request_id: str = ""
    detail: str = ""

    @property
    def time(self) -> str:
        return format_time(self.recorded_at)


def _grant_entry(seq: int, at: int, g: GrantView) -> Entry:
    detail = f"imported from {g.source}" if isinstance(g, ImportView) else ""
    if isinstance(g, ClaimPreparedView):
        detail = f"DRA claim {g.claim_namespace}/{g.claim_name} uid {g.claim_uid}"
    return Entry(seq=seq, recorded_at=at, type=view_tag(g),
                 pod_uid=g.pod_uid, namespace=g.namespace, pod_name=g.pod_name, container=g.container,
                 alloc_id=g.alloc_id, cores=g.cores, memory=g.memory, shares=g.shares, request_id=g.request_id,
                 detail=detail)


def _fill_request_ids(conn: sqlite3.Connection, entries: list[Entry]) -> None:
    """The request ids of grant entries whose bodies leave them to the row's ``command_id``
    (``request_id_in_row``), read in one pass at the end."""
    ids = by_seq(conn, "command_id", [e.seq for e in entries])
    for e in entries:
        e.request_id = ids[e.seq][0] or ""


def _release_type(view: ReleaseView) -> str:
    return "claim.unprepared" if isinstance(view, ClaimUnpreparedView) else "alloc.released"


_COPIED = ("pod_uid", "namespace", "pod_name", "container", "alloc_id", "request_id")


def _other_entry(stored: StoredEvent) -> Entry:
    ev = stored.event
    fields = {k: v for k in _COPIED if isinstance(v := getattr(ev, k, None), str)}
    return Entry(seq=stored.seq, recorded_at=stored.recorded_at, type=stored.type,
                 detail=getattr(ev, "reason", "") or "", **fields)


def _correction_entry(seq: int, at: int, c: CorrectionView, cores: int, shares: tuple[GpuShare, ...]) -> Entry:
    return Entry(seq=seq, recorded_at=at, type="alloc.corrected", pod_uid=c.pod_uid, namespace=c.namespace,
                 pod_name=c.pod_name, container=c.container, alloc_id=c.alloc_id, cores=cores,
                 memory=sum(s.memory for s in shares), shares=shares,
                 detail=f"was pod {c.previous_pod_uid} container {c.previous_container} ({c.reason})")


def _health_entry(seq: int, at: int, h: HealthView) -> Entry:
    state = "healthy" if h.healthy else f"UNHEALTHY: {h.why}"
    return Entry(seq=seq, recorded_at=at, type="gpu.health",
                 detail=f"GPU{h.index} {h.uuid} {state}" + (f" ({h.detail})" if h.detail else ""))


def pod_history(path: Path, pod: str) -> list[Entry]:
    """Every event of the pod(s) named ``pod`` (UID, ``name`` or ``namespace/name``).

    A correction is on the timelines of both pods: the one that lost the grant and the one that has it.
    """
    ns, _, name = pod.rpartition("/")
    uids = {pod}

    def named(pod_uid: str, namespace: str, pod_name: str) -> bool:
        return pod_uid in uids or (pod_name == name and ns in ("", namespace))

    live: dict[str, tuple[str, str, int]] = {}  # alloc_id -> (namespace, pod_name, cores) of every live grant
    out: list[Entry] = []
    in_row: list[Entry] = []  # grant entries whose request id is the row's command_id
    conn = open_reader(path, merged=False)  # one scan of the history: its segments are read one by one
    try:
        # Only what a pod is matched on is spelled out for every event (ids as text, whatever the body
        # version); the whole view (``plain``) only for the pod's own events. Spelling out every view
        # was most of a scan's time.
        for seq, at, view in iter_views(conn):
            if isinstance(view, GrantView):
                live[id_text(view.alloc_id)] = (view.namespace, view.pod_name, view.cores)
                if named(uid_text(view.pod_uid), view.namespace, view.pod_name):
                    grant = plain(view)
                    uids.add(grant.pod_uid)
                    out.append(entry := _grant_entry(seq, at, grant))
                    if request_id_in_row(view):
                        in_row.append(entry)
            elif isinstance(view, ReleaseView):
                owner = live.pop(id_text(view.alloc_id), ("", "", 0))
                if uid_text(view.pod_uid) in uids:
                    release = plain(view)
                    out.append(Entry(seq=seq, recorded_at=at, type=_release_type(release), pod_uid=release.pod_uid,
                                     namespace=owner[0], pod_name=owner[1], container=release.container,
                                     alloc_id=release.alloc_id, detail=release.reason))
            elif isinstance(view, CorrectionView):
                alloc_id = id_text(view.alloc_id)
                held = live.get(alloc_id)
                cores = held[2] if held else 0
                if held:
                    live[alloc_id] = (view.namespace, view.pod_name, cores)
                onto = named(uid_text(view.pod_uid), view.namespace, view.pod_name)
                if onto or uid_text(view.previous_pod_uid) in uids:
                    moved = plain(view)
                    if onto:
                        uids.add(moved.pod_uid)
                    out.append(_correction_entry(seq, at, moved, cores, moved.shares))
            elif isinstance(view, StoredEvent):
                ev = view.event
                uid = getattr(ev, "pod_uid", "")
                if uid in uids or (name and getattr(ev, "pod_name", None) == name
                                   and ns in ("", getattr(ev, "namespace", ""))):
                    if uid:
                        uids.add(uid)
                    out.append(_other_entry(view))
        _fill_request_ids(conn, in_row)
    finally:
        conn.close()
    return out


def _names_gpu(gpu: str, index: int, uuid: str) -> bool:
    return gpu == uuid or (gpu.isdigit() and int(gpu) == index)


def gpu_history(path: Path, gpu: str) -> list[Entry]:
    """Every grant on the GPU (by index or UUID), its release, and inventory changes naming the GPU."""
    on_gpu: dict[str, GrantView] = {}
    out: list[Entry] = []
    in_row: list[Entry] = []  # grant entries whose request id is the row's command_id
    packed_uuid = pack_gpu(gpu)  # how a version 4 body stores the UUID asked for

    def on_gpu_asked(shares: tuple[Any, ...]) -> bool:
        """Whether a share is on the GPU, read as stored (a version 4 share's UUID left packed)."""
        return any(_names_gpu(gpu, s.index, s.uuid) or s.uuid == packed_uuid for s in shares)

    def concerns(ev: ReleaseView | CorrectionView) -> bool:
        """Whether it ends or moves a grant on the GPU, or (a correction) moves one onto it."""
        return id_text(ev.alloc_id) in on_gpu or (isinstance(ev, CorrectionView) and on_gpu_asked(ev.shares))

    conn = open_reader(path, merged=False)  # one scan of the history: its segments are read one by one
    try:
        # As in pod_history: the whole view spelled out (``plain``) only for the GPU's own events.
        for seq, at, packed in iter_views(conn):
            if isinstance(packed, GrantView):
                if on_gpu_asked(packed.shares):
                    view = plain(packed)
                    mine = tuple(s for s in view.shares if _names_gpu(gpu, s.index, s.uuid))
                    on_gpu[view.alloc_id] = view
                    entry = _grant_entry(seq, at, view)
                    entry.shares = mine
                    out.append(entry)
                    if request_id_in_row(packed):
                        in_row.append(entry)
                continue
            if isinstance(packed, ReleaseView | CorrectionView) and not concerns(packed):
                continue
            view = plain(packed)
            if isinstance(view, ReleaseView):
                g = on_gpu.pop(view.alloc_id, None)
                if g is not None:
                    shares = tuple(s for s in g.shares if _names_gpu(gpu, s.index, s.uuid))
                    out.append(Entry(seq=seq, recorded_at=at, type=_release_type(view), pod_uid=g.pod_uid,
                                     namespace=g.namespace, pod_name=g.pod_name, container=g.container,
                                     alloc_id=g.alloc_id, cores=sum(s.cores for s in shares),
                                     memory=sum(s.memory for s in shares), shares=shares, detail=view.reason))
            elif isinstance(view, CorrectionView):  # one that ``concerns`` the GPU
                before = on_gpu.pop(view.alloc_id, None)  # put back below if it stays on the GPU
                mine = tuple(s for s in view.shares if _names_gpu(gpu, s.index, s.uuid))
                cores = before.cores if before is not None else sum(s.cores for s in mine)
                if mine:
                    on_gpu[view.alloc_id] = GrantView(
                        alloc_id=view.alloc_id, request_id=before.request_id if before else "", pod_uid=view.pod_uid,
                        namespace=view.namespace, pod_name=view.pod_name, container=view.container, cores=cores,
                        memory=view.memory, shares=view.shares, init_container=view.init_container)
                out.append(_correction_entry(seq, at, view, cores, mine))
            elif isinstance(view, HealthView):
                if _names_gpu(gpu, view.index, view.uuid):
                    out.append(_health_entry(seq, at, view))
            elif isinstance(view, InventoryView):
                found = [g for g in view.gpus if _names_gpu(gpu, g.index, g.uuid)]
                detail = (f"GPU{found[0].index} {found[0].uuid} {found[0].name}".strip() if found
                          else NOT_IN_INVENTORY)
                out.append(Entry(seq=seq, recorded_at=at, type="inventory.recorded", detail=detail))
            elif isinstance(view, StoredEvent) and _event_names_gpu(view.event, gpu):
                out.append(_other_entry(view))
        _fill_request_ids(conn, in_row)
    finally:
        conn.close()
    return out


def _event_names_gpu(ev: Any, gpu: str) -> bool:
    index = getattr(ev, "gpu_index", getattr(ev, "index", None))
    uuid = getattr(ev, "gpu_uuid", getattr(ev, "uuid", None))
    return (isinstance(index, int) and gpu.isdigit() and int(gpu) == index) or (uuid is not None and uuid == gpu)
