"""The recorder's projection: every node's events folded as the node's own audit replay folds them.

Each node has an ``AuditFold`` (the fold of ``gpuledger replay``) fed with that node's events in seq
order. After each event the allocations it touched are compared with the rows open for them: a
changed one is closed at the event's time and a new state opened, so ``fleet_holdings`` answers
"who held what at T" for every node with one query, and the answer is the union of what each node's
own ``replay --at T`` prints. Incoming messages are checked before they are folded (see ``check``):
an event must come from its own node's stream, continue that node's seq, and not speak for another
node; a refused one is kept in ``fleet_rejected`` with the reason, never folded.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from sqlalchemy import Engine, and_, insert, select, update

from libs.bus.outbox import ROW_HASH_HEADER
from libs.errors import CorruptLog
from libs.events.codec import StoredEvent, decode_record
from libs.events.schema import AllocationGranted, InventoryRecorded
from libs.events.subjects import Subjects, unescape_token
from libs.fleet.naming import SOURCE_HEADER, source_stream
from libs.fleet.queries import holding_of_row
from libs.fleet.tables import fleet_events, fleet_gpus, fleet_holdings, fleet_metadata, fleet_nodes, fleet_rejected
from libs.ledger.holdings import AuditFold, Holding
from libs.ledger.views import CorrectionView, GrantView, ImportView, ReleaseView, view_of
from libs.logger import get_logger

__all__ = ["Batch", "FleetMessage", "FleetProjection", "Rejected"]

_logger = get_logger("fleet-projection")
_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class FleetMessage:
    """One message of the fleet stream, as the consumer hands it over."""

    fleet_seq: int
    subject: str
    headers: dict[str, str]
    data: bytes


@dataclass(frozen=True)
class Rejected:
    fleet_seq: int
    subject: str
    source: str
    reason: str


@dataclass
class Batch:
    """What one ``apply`` did."""

    stored: dict[str, int] = field(default_factory=dict)  # node -> events stored
    duplicates: int = 0
    gaps: int = 0
    rejected: list[Rejected] = field(default_factory=list)


class _Reject(Exception):
    pass


@dataclass
class _NodeFold:
    node: str
    fold: AuditFold
    last_seq: int = 0
    last_hash: str = ""
    last_event_at: int = 0
    events: int = 0
    open: dict[str, Holding] = field(default_factory=dict)          # alloc_id -> the open row's state
    gpus: dict[str, tuple[int, str]] = field(default_factory=dict)  # uuid -> (index, model) of the open rows
    device_ids: dict[int, tuple[str, ...]] = field(default_factory=dict)


class FleetProjection:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        fleet_metadata.create_all(engine)
        self.folds: dict[str, _NodeFold] = {}
        # Per node, the last seq whose rows are committed. The folds run ahead of it while a batch is
        # folded (on the ingest's thread): whoever reads progress to query the database reads this.
        self.committed: dict[str, int] = {}

    # --- start: rebuild the folds from what the database holds -----------------------------------

    def load(self) -> int:
        """Refold every node's stored events (no rows are written); the number of events read."""
        count = 0
        with self.engine.connect() as conn:
            for n in conn.execute(select(fleet_nodes)):
                nf = self._fold_for(n.node)
                nf.last_seq, nf.last_hash = n.last_seq, n.last_hash
                nf.last_event_at, nf.events = n.last_event_at, n.events
            for r in conn.execute(select(fleet_events.c.node, fleet_events.c.record)
                                  .order_by(fleet_events.c.node, fleet_events.c.seq)):
                stored = decode_record(r.record.encode())
                self._fold(self.folds[r.node], stored)
                count += 1
            for h in conn.execute(select(fleet_holdings).where(fleet_holdings.c.valid_to.is_(None))):
                self.folds[h.node].open[h.alloc_id] = holding_of_row(h)
            for g in conn.execute(select(fleet_gpus).where(fleet_gpus.c.valid_to.is_(None))):
                self.folds[g.node].gpus[g.uuid] = (g.gpu_index, g.model)
        self.committed = {n: f.last_seq for n, f in self.folds.items()}
        return count

    def last_seqs(self) -> dict[str, int]:
        """Per node, the last seq stored in the database (committed)."""
        return dict(self.committed)

    def _fold_for(self, node: str) -> _NodeFold:
        nf = self.folds.get(node)
        if nf is None:
            holder: dict[str, _NodeFold] = {}
            nf = _NodeFold(node=node, fold=AuditFold(lambda seq: holder["nf"].device_ids.get(seq, ())))
            holder["nf"] = nf
            self.folds[node] = nf
        return nf

    # --- ingest -------------------------------------------------------------------------------------

    def check(self, msg: FleetMessage) -> tuple[str, StoredEvent]:
        """The node and event a fleet message carries, or ``_Reject`` with why it cannot be taken."""
        parts = msg.subject.split(".")
        if len(parts) < 4 or parts[0] != "gpuledger":
            raise _Reject(f"not an event subject: {msg.subject}")
        node = unescape_token(parts[1])
        source = msg.headers.get(SOURCE_HEADER, "")
        origin = source_stream(source)
        if origin != Subjects(node).stream:
            raise _Reject(f"an event on node {node!r}'s subject came from stream {origin or '(none)'!r}, "
                          f"not from {Subjects(node).stream}: a node may only speak for itself")
        try:
            stored = decode_record(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError, CorruptLog) as exc:
            raise _Reject(f"unreadable event: {exc}") from None
        origin_seq = source.split(" ")[1] if len(source.split(" ")) > 1 else ""
        if origin_seq.isdigit() and int(origin_seq) != stored.seq:
            raise _Reject(f"the record says seq {stored.seq} but the node's stream holds it at {origin_seq}")
        if parts[2:] != stored.type.split("."):
            raise _Reject(f"the subject says {'.'.join(parts[2:])} but the record is a {stored.type}")
        if isinstance(stored.event, InventoryRecorded) and stored.event.node != node:
            raise _Reject(f"node {node!r} published an inventory of node {stored.event.node!r}")
        return node, msgspec.structs.replace(stored, row_hash=msg.headers.get(ROW_HASH_HEADER, ""))

    def apply(self, messages: Iterable[FleetMessage]) -> Batch:
        """Fold and store a batch of fleet messages in one transaction."""
        batch = Batch()
        now = time.time_ns()
        events: list[dict[str, Any]] = []
        opens: list[dict[str, Any]] = []
        pending: dict[tuple[str, str], dict[str, Any]] = {}  # open rows inserted in this batch
        closes: list[dict[str, Any]] = []
        gpu_opens: list[dict[str, Any]] = []
        gpu_closes: list[dict[str, Any]] = []
        touched_nodes: set[str] = set()
        for msg in messages:
            try:
                node, stored = self.check(msg)
            except _Reject as exc:
                source = msg.headers.get(SOURCE_HEADER, "")
                batch.rejected.append(Rejected(msg.fleet_seq, msg.subject, source, str(exc)))
                continue
            nf = self._fold_for(node)
            if stored.seq <= nf.last_seq:
                batch.duplicates += 1  # delivered again (a redelivery after a recorder crash)
                continue
            if stored.seq != nf.last_seq + 1:
                batch.gaps += 1
                _logger.error("a gap in a node's events", node=node, expected=nf.last_seq + 1, got=stored.seq)
            events.append({"node": node, "seq": stored.seq, "fleet_seq": msg.fleet_seq, "type": stored.type,
                           "recorded_at": stored.recorded_at, "event_id": stored.event_id,
                           "row_hash": stored.row_hash, "record": msg.data.decode()})
            touched = self._fold(nf, stored)
            at, seq = stored.recorded_at, stored.seq
            for alloc_id in touched:
                before = nf.open.get(alloc_id)
                after = self._holding(nf, alloc_id, stored, before)
                if after == before:
                    continue
                if before is not None:
                    row = pending.pop((node, alloc_id), None)
                    if row is not None:
                        row["valid_to"], row["to_seq"] = at, seq
                    else:
                        closes.append({"n": node, "a": alloc_id, "vt": at, "ts": seq})
                    del nf.open[alloc_id]
                if after is not None:
                    row = _row(node, after, at, seq)
                    opens.append(row)
                    pending[(node, alloc_id)] = row
                    nf.open[alloc_id] = after
            if isinstance(stored.event, InventoryRecorded):
                fresh = {g.uuid: (g.index, g.name) for g in stored.event.gpus}
                for uuid in [u for u, v in nf.gpus.items() if fresh.get(u) != v]:
                    gpu_closes.append({"n": node, "u": uuid, "vt": at})
                    del nf.gpus[uuid]
                for g in stored.event.gpus:
                    if g.uuid not in nf.gpus:
                        gpu_opens.append({"node": node, "uuid": g.uuid, "gpu_index": g.index, "model": g.name,
                                          "memory": g.memory, "valid_from": at, "valid_to": None})
                        nf.gpus[g.uuid] = (g.index, g.name)
            nf.last_seq, nf.last_hash, nf.last_event_at = seq, stored.row_hash, at
            nf.events += 1
            batch.stored[node] = batch.stored.get(node, 0) + 1
            touched_nodes.add(node)
        with self.engine.begin() as conn:
            if events:
                conn.execute(insert(fleet_events), events)
            h = fleet_holdings.c
            if closes:
                conn.execute(update(fleet_holdings).where(and_(h.node == _bind("n"), h.alloc_id == _bind("a"),
                                                               h.valid_to.is_(None)))
                             .values(valid_to=_bind("vt"), to_seq=_bind("ts")), closes)
            if opens:
                conn.execute(insert(fleet_holdings), opens)
            g = fleet_gpus.c
            if gpu_closes:
                conn.execute(update(fleet_gpus).where(and_(g.node == _bind("n"), g.uuid == _bind("u"),
                                                           g.valid_to.is_(None)))
                             .values(valid_to=_bind("vt")), gpu_closes)
            if gpu_opens:
                conn.execute(insert(fleet_gpus), gpu_opens)
            if batch.rejected:
                conn.execute(insert(fleet_rejected), [{"fleet_seq": r.fleet_seq, "subject": r.subject,
                                                       "source": r.source, "reason": r.reason, "at": now}
                                                      for r in batch.rejected])
            for node in touched_nodes:
                nf = self.folds[node]
                values = {"last_seq": nf.last_seq, "last_hash": nf.last_hash, "last_event_at": nf.last_event_at,
                          "last_ingest_at": now, "events": nf.events}
                done = conn.execute(update(fleet_nodes).where(fleet_nodes.c.node == node).values(**values))
                if done.rowcount == 0:
                    conn.execute(insert(fleet_nodes).values(node=node, **values))
        for node in touched_nodes:
            self.committed[node] = self.folds[node].last_seq
        return batch

    # --- the fold ----------------------------------------------------------------------------------

    def _fold(self, nf: _NodeFold, stored: StoredEvent) -> set[str]:
        """Apply one event to the node's fold; the allocations whose state it may have changed."""
        view = view_of(stored)
        touched: set[str] = set()
        if isinstance(stored.event, AllocationGranted):
            nf.device_ids[stored.seq] = stored.event.device_ids
        if isinstance(view, GrantView | ImportView):
            touched.add(view.alloc_id)
            touched |= nf.fold.inits.get(view.pod_uid, set())
        elif isinstance(view, ReleaseView | CorrectionView):
            touched.add(view.alloc_id)
        nf.fold.apply(stored.seq, stored.recorded_at, view)
        if isinstance(view, GrantView) and not view.init_container:
            nf.device_ids.pop(stored.seq, None)  # only init-container grants are asked for again
        return touched

    @staticmethod
    def _holding(nf: _NodeFold, alloc_id: str, stored: StoredEvent, before: Holding | None) -> Holding | None:
        live = nf.fold.live.get(alloc_id)
        if live is None:
            return None
        seq, at, g = live
        if before is not None and before.granted_seq == seq:
            event_id = before.event_id
        else:
            event_id = stored.event_id if stored.seq == seq else ""
        return Holding(alloc_id=g.alloc_id, pod_uid=g.pod_uid, namespace=g.namespace, pod_name=g.pod_name,
                       container=g.container, init_container=g.init_container, cores=g.cores, memory=g.memory,
                       shares=g.shares, since=at, granted_seq=seq, request_id=g.request_id, event_id=event_id,
                       source=g.source if isinstance(g, ImportView) else "allocate", core_limit=g.core_limit,
                       charged=g.alloc_id not in nf.fold.uncharged, corrected_seq=nf.fold.corrected.get(g.alloc_id, 0))


def _bind(name: str) -> Any:
    from sqlalchemy import bindparam

    return bindparam(name)


def _row(node: str, h: Holding, at: int, seq: int) -> dict[str, Any]:
    return {"node": node, "alloc_id": h.alloc_id, "pod_uid": h.pod_uid, "namespace": h.namespace,
            "pod_name": h.pod_name, "container": h.container, "init_container": h.init_container, "cores": h.cores,
            "memory": h.memory, "shares": _json.encode(h.shares).decode(),
            "gpu_uuids": "," + ",".join(s.uuid for s in h.shares) + ",", "since": h.since,
            "granted_seq": h.granted_seq, "request_id": h.request_id, "event_id": h.event_id, "source": h.source,
            "core_limit": h.core_limit, "charged": h.charged, "corrected_seq": h.corrected_seq,
            "valid_from": at, "valid_to": None, "from_seq": seq, "to_seq": None}
