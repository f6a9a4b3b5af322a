"""Reading the fleet recorder's database: holdings at T, history, utilization (``gpuledger fleet``)."""

from __future__ import annotations

from collections import defaultdict

import msgspec
from sqlalchemy import Engine, and_, or_, select

from libs.events.schema import GpuShare
from libs.fleet.tables import fleet_gpus, fleet_holdings, fleet_nodes
from libs.ledger.holdings import Holding

__all__ = [
    "FleetNodeState", "HistoryRow", "NodeStatus", "Utilization", "fleet_at", "history", "holding_of_row", "nodes",
    "utilization",
]

_shares = msgspec.json.Decoder(tuple[GpuShare, ...])


class FleetNodeState(msgspec.Struct, kw_only=True):
    """One node's holdings at T, as that node's own ``gpuledger replay --at T`` lists them."""

    node: str
    allocations: list[Holding]


class HistoryRow(msgspec.Struct, kw_only=True):
    """One state of one allocation: held from ``valid_from`` until ``valid_to`` (None: still held)."""

    node: str
    holding: Holding
    valid_from: int
    valid_to: int | None
    from_seq: int
    to_seq: int | None


class Utilization(msgspec.Struct, kw_only=True):
    node: str
    model: str
    gpus: int
    core_seconds: float        # sum of held vcuda-cores x seconds (100 = one whole GPU) in the window
    capacity_core_seconds: float
    utilization: float         # core_seconds / capacity (0..1)


class NodeStatus(msgspec.Struct, kw_only=True):
    node: str
    last_seq: int
    last_hash: str
    last_event_at: int
    last_ingest_at: int
    events: int


def holding_of_row(row: object) -> Holding:
    r = row._mapping  # type: ignore[attr-defined]
    return Holding(alloc_id=r["alloc_id"], pod_uid=r["pod_uid"], namespace=r["namespace"], pod_name=r["pod_name"],
                   container=r["container"], init_container=bool(r["init_container"]), cores=r["cores"],
                   memory=r["memory"], shares=_shares.decode(r["shares"]), since=r["since"],
                   granted_seq=r["granted_seq"], request_id=r["request_id"], event_id=r["event_id"],
                   source=r["source"], core_limit=r["core_limit"], charged=bool(r["charged"]),
                   corrected_seq=r["corrected_seq"])


def _live_at(table: object, at: int) -> object:
    return and_(table.c.valid_from <= at, or_(table.c.valid_to.is_(None), table.c.valid_to > at))  # type: ignore[attr-defined]


def fleet_at(engine: Engine, at: int, *, node: str | None = None) -> list[FleetNodeState]:
    """Every holding on every node at ``at`` (unix ns), per node, oldest grant first."""
    query = select(fleet_holdings).where(_live_at(fleet_holdings, at))
    if node:
        query = query.where(fleet_holdings.c.node == node)
    by_node: dict[str, list[Holding]] = defaultdict(list)
    with engine.connect() as conn:
        for row in conn.execute(query.order_by(fleet_holdings.c.node, fleet_holdings.c.granted_seq)):
            by_node[row.node].append(holding_of_row(row))
    return [FleetNodeState(node=n, allocations=by_node[n]) for n in sorted(by_node)]


def history(
    engine: Engine, *, node: str | None = None, pod: str | None = None, namespace: str | None = None,
    gpu: str | None = None, since: int | None = None, until: int | None = None, limit: int = 10_000,
) -> list[HistoryRow]:
    """The states of allocations matching every filter given (pod: name or UID; gpu: UUID), oldest first."""
    h = fleet_holdings.c
    query = select(fleet_holdings)
    if node:
        query = query.where(h.node == node)
    if pod:
        query = query.where(or_(h.pod_name == pod, h.pod_uid == pod))
    if namespace:
        query = query.where(h.namespace == namespace)
    if gpu:
        query = query.where(h.gpu_uuids.contains(f",{gpu},", autoescape=True))
    if since is not None:
        query = query.where(or_(h.valid_to.is_(None), h.valid_to > since))
    if until is not None:
        query = query.where(h.valid_from <= until)
    query = query.order_by(h.valid_from, h.id).limit(limit)
    with engine.connect() as conn:
        return [HistoryRow(node=r.node, holding=holding_of_row(r), valid_from=r.valid_from, valid_to=r.valid_to,
                           from_seq=r.from_seq, to_seq=r.to_seq) for r in conn.execute(query)]


def utilization(engine: Engine, start: int, end: int) -> list[Utilization]:
    """Held vcuda-cores over the window per node and GPU model, against what the node's GPUs offer."""
    if end <= start:
        raise ValueError("the window's end must be after its start")
    window = and_(or_(fleet_gpus.c.valid_to.is_(None), fleet_gpus.c.valid_to > start), fleet_gpus.c.valid_from < end)
    held = and_(or_(fleet_holdings.c.valid_to.is_(None), fleet_holdings.c.valid_to > start),
                fleet_holdings.c.valid_from < end, fleet_holdings.c.charged.is_(True))
    capacity: dict[tuple[str, str], float] = defaultdict(float)
    count: dict[tuple[str, str], set[str]] = defaultdict(set)
    model_of: dict[tuple[str, str], str] = {}
    used: dict[tuple[str, str], float] = defaultdict(float)

    def overlap(a: int, b: int | None) -> float:
        return max(0, min(end, b if b is not None else end) - max(start, a)) / 1e9

    with engine.connect() as conn:
        for g in conn.execute(select(fleet_gpus).where(window)):
            key = (g.node, g.model or "unknown")
            capacity[key] += 100 * overlap(g.valid_from, g.valid_to)
            count[key].add(g.uuid)
            model_of[(g.node, g.uuid)] = g.model or "unknown"
        for r in conn.execute(select(fleet_holdings.c.node, fleet_holdings.c.shares, fleet_holdings.c.valid_from,
                                     fleet_holdings.c.valid_to).where(held)):
            seconds = overlap(r.valid_from, r.valid_to)
            for share in _shares.decode(r.shares):
                used[(r.node, model_of.get((r.node, share.uuid), "unknown"))] += share.cores * seconds
    keys = sorted(set(capacity) | set(used))
    return [Utilization(node=n, model=m, gpus=len(count[(n, m)]), core_seconds=used[(n, m)],
                        capacity_core_seconds=capacity[(n, m)],
                        utilization=used[(n, m)] / capacity[(n, m)] if capacity[(n, m)] else 0.0)
            for n, m in keys]


def nodes(engine: Engine) -> list[NodeStatus]:
    with engine.connect() as conn:
        return [NodeStatus(**dict(r._mapping)) for r in conn.execute(select(fleet_nodes).order_by(fleet_nodes.c.node))]
