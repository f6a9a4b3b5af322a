"""The fleet recorder's database (SQLAlchemy Core: SQLite by default, PostgreSQL by URL).

The recorder writes it, ``gpuledger fleet`` reads it. ``fleet_events`` keeps every node's committed
events as they reached the fleet stream, one row per (node, seq). ``fleet_holdings`` is the projection
that answers "who held what at T" with one indexed query: each row is one state of one allocation,
valid from the event that made it (``valid_from``, the node's ``recorded_at``) until the event that
changed or ended it (``valid_to``; NULL while it lasts), so a holding is live at T when
``valid_from <= T < valid_to``, which is exactly which events ``gpuledger replay --at T`` folds.
``fleet_gpus`` holds each node's GPUs the same way (for utilization per GPU model).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)

__all__ = ["fleet_events", "fleet_gpus", "fleet_holdings", "fleet_metadata", "fleet_nodes", "fleet_rejected",
           "fleet_witness"]

fleet_metadata = MetaData()

fleet_nodes = Table(
    "fleet_nodes", fleet_metadata,
    Column("node", String(253), primary_key=True),
    Column("last_seq", BigInteger, nullable=False),
    Column("last_hash", String(64), nullable=False),
    Column("last_event_at", BigInteger, nullable=False),   # the node's recorded_at of its last event (ns)
    Column("last_ingest_at", BigInteger, nullable=False),  # when the recorder stored it (unix ns)
    Column("events", BigInteger, nullable=False),
)

fleet_events = Table(
    "fleet_events", fleet_metadata,
    Column("node", String(253), primary_key=True),
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("fleet_seq", BigInteger, nullable=False),       # the fleet stream's sequence
    Column("type", String(64), nullable=False),
    Column("recorded_at", BigInteger, nullable=False),
    Column("event_id", String(32), nullable=False),
    Column("row_hash", String(64), nullable=False),
    Column("record", Text, nullable=False),                # the EventRecord JSON, as published
)
Index("fleet_events_time", fleet_events.c.recorded_at)

fleet_holdings = Table(
    "fleet_holdings", fleet_metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("node", String(253), nullable=False),
    Column("alloc_id", String(64), nullable=False),
    Column("pod_uid", String(64), nullable=False),
    Column("namespace", String(253), nullable=False),
    Column("pod_name", String(253), nullable=False),
    Column("container", String(253), nullable=False),
    Column("init_container", Boolean, nullable=False),
    Column("cores", Integer, nullable=False),
    Column("memory", BigInteger, nullable=False),
    Column("shares", Text, nullable=False),                # JSON list of GpuShare
    Column("gpu_uuids", Text, nullable=False),             # ",uuid1,uuid2," for filtering
    Column("since", BigInteger, nullable=False),
    Column("granted_seq", BigInteger, nullable=False),
    Column("request_id", String(128), nullable=False),
    Column("event_id", String(32), nullable=False),
    Column("source", Text, nullable=False),
    Column("core_limit", Integer),
    Column("charged", Boolean, nullable=False),
    Column("corrected_seq", BigInteger, nullable=False),
    Column("valid_from", BigInteger, nullable=False),
    Column("valid_to", BigInteger),
    Column("from_seq", BigInteger, nullable=False),
    Column("to_seq", BigInteger),
)
Index("fleet_holdings_at", fleet_holdings.c.valid_from, fleet_holdings.c.valid_to)
Index("fleet_holdings_node", fleet_holdings.c.node, fleet_holdings.c.alloc_id)
Index("fleet_holdings_pod", fleet_holdings.c.pod_name)
Index("fleet_holdings_ns", fleet_holdings.c.namespace)

fleet_gpus = Table(
    "fleet_gpus", fleet_metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("node", String(253), nullable=False),
    Column("uuid", String(128), nullable=False),
    Column("gpu_index", Integer, nullable=False),
    Column("model", String(253), nullable=False),
    Column("memory", BigInteger, nullable=False),
    Column("valid_from", BigInteger, nullable=False),
    Column("valid_to", BigInteger),
)
Index("fleet_gpus_node", fleet_gpus.c.node)

fleet_rejected = Table(
    "fleet_rejected", fleet_metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("fleet_seq", BigInteger, nullable=False),
    Column("subject", Text, nullable=False),
    Column("source", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("at", BigInteger, nullable=False),
)

# The recorder as a witness: per checkpoint origin (gpuledger/<cluster>/<node>) the last size and root it
# cosigned, the origin's key, and that cosigned checkpoint (libs/fleet/witness_store.py).
fleet_witness = Table(
    "fleet_witness", fleet_metadata,
    Column("origin", String(512), primary_key=True),
    Column("size", BigInteger, nullable=False),
    Column("root", String(64), nullable=False),            # hex of the RFC 6962 root
    Column("origin_key", Text, nullable=False),            # the origin's verifier key (signed-note string)
    Column("note", Text, nullable=False),                  # the checkpoint at size, with the cosignature
    Column("updated_at", BigInteger, nullable=False),      # unix ns
)
