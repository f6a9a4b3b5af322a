"""The witness's state in the recorder's SQL database: ``WitnessStore`` over SQLAlchemy Core.

One row per checkpoint origin in ``fleet_witness``. ``advance`` is a compare-and-set in one statement:
``UPDATE ... WHERE origin = ? AND size = ? AND root = ?`` (one row changed, or none when another
recorder advanced it first), or an ``INSERT`` for an origin seen the first time, refused by the primary
key when another got there first. Both are atomic on SQLite and on PostgreSQL at their default
isolation, so two recorders sharing one database never cosign two inconsistent checkpoints of one node.
"""

from __future__ import annotations

import time

from sqlalchemy import Engine, and_, insert, select, update
from sqlalchemy.exc import IntegrityError

from libs.fleet.tables import fleet_metadata, fleet_witness
from libs.witness.witness import WitnessState

__all__ = ["SqlWitnessStore"]


class SqlWitnessStore:
    def __init__(self, engine: Engine, *, create: bool = True) -> None:
        self.engine = engine
        if create:
            fleet_metadata.create_all(engine, tables=[fleet_witness])

    def get(self, origin: str) -> WitnessState | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(fleet_witness).where(fleet_witness.c.origin == origin)).first()
        if row is None:
            return None
        return WitnessState(int(row.size), bytes.fromhex(row.root), row.origin_key, row.note)

    def origins(self) -> list[str]:
        with self.engine.connect() as conn:
            return [r.origin for r in conn.execute(select(fleet_witness.c.origin).order_by(fleet_witness.c.origin))]

    def advance(self, origin: str, old: WitnessState | None, new: WitnessState) -> bool:
        values = {"size": new.size, "root": new.root.hex(), "origin_key": new.key, "note": new.note,
                  "updated_at": time.time_ns()}
        try:
            with self.engine.begin() as conn:
                if old is None:
                    conn.execute(insert(fleet_witness).values(origin=origin, **values))
                    return True
                done = conn.execute(update(fleet_witness).where(and_(
                    fleet_witness.c.origin == origin, fleet_witness.c.size == old.size,
                    fleet_witness.c.root == old.root.hex())).values(**values))
                return done.rowcount == 1
        except IntegrityError:  # another writer inserted the origin first
            return False
