"""Ad-hoc reads on the event loop: SQLAlchemy Core over aiosqlite.

Used where a query is small and must not block the loop, like the outbox relay's "events after
seq N". Bulk replay does not come here (see replay.py).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from libs.events.codec import StoredEvent
from libs.store.rows import row_to_stored
from libs.store.schema import events

__all__ = ["LogQueries"]

_COLUMNS = (
    events.c.seq, events.c.recorded_at, events.c.stream_id, events.c.version, events.c.type,
    events.c.schema_v, events.c.event_id, events.c.command_id, events.c.payload,
)


class LogQueries:
    def __init__(self, path: Path) -> None:
        self.engine: AsyncEngine = create_async_engine(f"sqlite+aiosqlite:///{path}")

        @event.listens_for(self.engine.sync_engine, "connect")
        def _pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA busy_timeout=5000")
            cur.execute("PRAGMA query_only=ON")  # this engine never writes: the writer thread does
            cur.close()

    async def read_after(self, after_seq: int, limit: int = 512) -> list[StoredEvent]:
        stmt = select(*_COLUMNS).where(events.c.seq > after_seq).order_by(events.c.seq).limit(limit)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(stmt)).all()
        return [row_to_stored(tuple(r)) for r in rows]

    async def by_command(self, command_id: str) -> list[StoredEvent]:
        """The events a command appended (the ``events_command`` index), in seq order."""
        stmt = select(*_COLUMNS).where(events.c.command_id == command_id).order_by(events.c.seq)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(stmt)).all()
        return [row_to_stored(tuple(r)) for r in rows]

    async def close(self) -> None:
        await self.engine.dispose()
