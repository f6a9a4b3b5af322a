"""The allocation log's tables, declared once with SQLAlchemy Core.

The invariants are enforced by SQLite itself, not only by our writer:
- append-only: UPDATE and DELETE on ``events`` abort;
- dense ``seq``: a row must take exactly max(seq) + 1;
- time never goes backwards: ``recorded_at`` >= the previous row's.
Each row also carries ``hash`` = sha256(previous hash || this row), chaining the log so that an
edited, removed or reordered row can be detected later.
"""

from __future__ import annotations

from sqlalchemy import (
    DDL,
    Column,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    Text,
    UniqueConstraint,
    event,
)

from libs.store.format import LOG_FORMAT_VERSION

__all__ = ["LOG_FORMAT_VERSION", "events", "meta", "metadata"]

metadata = MetaData()

events = Table(
    "events",
    metadata,
    Column("seq", Integer, primary_key=True, autoincrement=False),  # rowid alias: dense, commit order
    Column("stream_id", Text, nullable=False),
    Column("version", Integer, nullable=False),
    Column("type", Text, nullable=False),
    Column("schema_v", Integer, nullable=False),
    Column("event_id", LargeBinary, nullable=False, unique=True),
    Column("command_id", Text),
    Column("recorded_at", Integer, nullable=False),  # unix ns
    Column("payload", LargeBinary, nullable=False),  # msgpack of the typed event
    Column("hash", LargeBinary, nullable=False),
    UniqueConstraint("stream_id", "version"),
    sqlite_strict=True,
)
Index("events_command", events.c.command_id, sqlite_where=events.c.command_id.isnot(None))
Index("events_time", events.c.recorded_at)

meta = Table(
    "meta",
    metadata,
    Column("key", Text, primary_key=True),
    Column("value", Text, nullable=False),
    sqlite_strict=True,
)

_TRIGGERS = (
    """CREATE TRIGGER events_no_update BEFORE UPDATE ON events
       BEGIN SELECT RAISE(ABORT, 'events is append-only: UPDATE refused'); END""",
    """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
       BEGIN SELECT RAISE(ABORT, 'events is append-only: DELETE refused'); END""",
    """CREATE TRIGGER events_dense_seq BEFORE INSERT ON events
       WHEN NEW.seq IS NOT (SELECT COALESCE(MAX(seq), 0) + 1 FROM events)
       BEGIN SELECT RAISE(ABORT, 'events.seq must be max(seq) + 1'); END""",
    """CREATE TRIGGER events_time_forward BEFORE INSERT ON events
       WHEN NEW.recorded_at < COALESCE((SELECT recorded_at FROM events ORDER BY seq DESC LIMIT 1), 0)
       BEGIN SELECT RAISE(ABORT, 'events.recorded_at must not go backwards'); END""",
)
for _ddl in _TRIGGERS:
    event.listen(events, "after_create", DDL(_ddl))
