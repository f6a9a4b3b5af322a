"""The allocation log's tables, declared once with SQLAlchemy Core.

The invariants are enforced by SQLite itself, not only by our writer:
- append-only: UPDATE on ``events`` aborts, and so does DELETE, except of the oldest row when an archive
  segment recorded in ``archive_segments`` already holds it (how archiving moves a prefix out, see
  libs/store/archive.py); ``archive_segments`` itself is append-only and contiguous, and a segment can
  only be recorded if its last hash is the live log's hash at its last seq;
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

__all__ = ["ARCHIVE_TRIGGERS", "LOG_FORMAT_VERSION", "archive_segments", "events", "meta", "metadata"]

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

# The catalog of archive segments (libs/store/archive.py): one row per segment, in seq order. It is
# what lets rows leave the live log, and what ``audit verify`` checks the segment files against.
archive_segments = Table(
    "archive_segments",
    metadata,
    Column("first_seq", Integer, primary_key=True, autoincrement=False),
    Column("last_seq", Integer, nullable=False),
    Column("first_at", Integer, nullable=False),   # recorded_at of the first and last rows (unix ns)
    Column("last_at", Integer, nullable=False),
    Column("prev_hash", LargeBinary, nullable=False),  # the chain hash before first_seq
    Column("last_hash", LargeBinary, nullable=False),  # the chain hash at last_seq
    Column("file", Text, nullable=False),
    Column("sha256", LargeBinary, nullable=False),     # of the compressed file, as written
    Column("archived_at", Integer, nullable=False),
    sqlite_strict=True,
)

# Guards on the catalog and the one controlled way out of ``events``. DELETE is allowed only for the
# oldest row, and only when a recorded segment covers it: a prefix, never a row in the middle, never
# a row no segment holds. Everything else still aborts, whoever writes.
ARCHIVE_TRIGGERS = (
    """CREATE TRIGGER IF NOT EXISTS events_no_delete BEFORE DELETE ON events
       WHEN OLD.seq > COALESCE((SELECT MAX(last_seq) FROM archive_segments), 0)
         OR OLD.seq IS NOT (SELECT MIN(seq) FROM events)
       BEGIN SELECT RAISE(ABORT, 'events is append-only: DELETE refused (only the oldest rows, once an archive \
segment holds them)'); END""",
    """CREATE TRIGGER IF NOT EXISTS archive_segments_no_update BEFORE UPDATE ON archive_segments
       BEGIN SELECT RAISE(ABORT, 'archive_segments is append-only: UPDATE refused'); END""",
    """CREATE TRIGGER IF NOT EXISTS archive_segments_no_delete BEFORE DELETE ON archive_segments
       BEGIN SELECT RAISE(ABORT, 'archive_segments is append-only: DELETE refused'); END""",
    """CREATE TRIGGER IF NOT EXISTS archive_segments_contiguous BEFORE INSERT ON archive_segments
       WHEN NEW.first_seq IS NOT COALESCE((SELECT MAX(last_seq) FROM archive_segments), 0) + 1
         OR NEW.last_seq < NEW.first_seq
         OR NEW.last_seq >= (SELECT MAX(seq) FROM events)
         OR NEW.last_hash IS NOT (SELECT hash FROM events WHERE seq = NEW.last_seq)
       BEGIN SELECT RAISE(ABORT, 'an archive segment must continue the last one, end before the live log''s \
last row and end on its hash'); END""",
)

_TRIGGERS = (
    """CREATE TRIGGER events_no_update BEFORE UPDATE ON events
       BEGIN SELECT RAISE(ABORT, 'events is append-only: UPDATE refused'); END""",
    """CREATE TRIGGER events_dense_seq BEFORE INSERT ON events
       WHEN NEW.seq IS NOT (SELECT COALESCE(MAX(seq), 0) + 1 FROM events)
       BEGIN SELECT RAISE(ABORT, 'events.seq must be max(seq) + 1'); END""",
    """CREATE TRIGGER events_time_forward BEFORE INSERT ON events
       WHEN NEW.recorded_at < COALESCE((SELECT recorded_at FROM events ORDER BY seq DESC LIMIT 1), 0)
       BEGIN SELECT RAISE(ABORT, 'events.recorded_at must not go backwards'); END""",
)
for _ddl in _TRIGGERS:
    event.listen(events, "after_create", DDL(_ddl))
