"""The allocation log's tables, views and guards, as SQL: ``CATALOG_DDL`` (``meta`` and the archive
catalog, in every format), the rows (format 2, ``FORMAT_2_DDL``) and every guard.

Plain SQL run through ``sqlite3``, as the writer and the readers are: creating a log needs nothing
else loaded, so a node's allocator never carries SQLAlchemy (about 12 MB of RSS), not even on the start
that creates its log (docs/benchmarks.md, the footprint). SQLAlchemy is the fleet recorder's, where
one schema serves SQLite and PostgreSQL.

The invariants are enforced by SQLite itself, not only by our writer:
- append-only: UPDATE on the rows aborts, and so does DELETE, except of the oldest row when an archive
  segment recorded in ``archive_segments`` already holds it (how archiving moves a prefix out, see
  libs/store/archive.py); ``archive_segments`` itself is append-only and contiguous, and a segment can
  only be recorded if its last hash is the live log's hash at its last seq;
- dense ``seq``: a row must take exactly max(seq) + 1;
- time never goes backwards: ``recorded_at`` >= the previous row's.
Each row also carries ``hash`` = sha256(previous hash || this row), chaining the log so that an
edited, removed or reordered row can be detected later.
"""

from __future__ import annotations

from libs.store.format import LOG_FORMAT_VERSION

__all__ = ["CATALOG_DDL", "FORMAT_1_DDL", "FORMAT_2_DDL", "LOG_FORMAT_VERSION", "archive_triggers"]

# In every format: the log's own facts (``format``) and the catalog of archive segments
# (libs/store/archive.py): one row per segment, in seq order. The catalog is what lets rows leave
# the live log, and what ``audit verify`` checks the segment files against.
CATALOG_DDL = (
    """CREATE TABLE IF NOT EXISTS meta ("key" TEXT NOT NULL, value TEXT NOT NULL, PRIMARY KEY ("key")) STRICT""",
    """CREATE TABLE IF NOT EXISTS archive_segments (
       first_seq INTEGER NOT NULL,
       last_seq INTEGER NOT NULL,
       first_at INTEGER NOT NULL,   -- recorded_at of the first and last rows (unix ns)
       last_at INTEGER NOT NULL,
       prev_hash BLOB NOT NULL,     -- the chain hash before first_seq
       last_hash BLOB NOT NULL,     -- the chain hash at last_seq
       file TEXT NOT NULL,
       sha256 BLOB NOT NULL,        -- of the compressed file, as written
       archived_at INTEGER NOT NULL,
       PRIMARY KEY (first_seq)) STRICT""",
)

# Guards on the catalog and the one controlled way out of the rows. DELETE is allowed only for the
# oldest row, and only when a recorded segment covers it: a prefix, never a row in the middle, never
# a row no segment holds. Everything else still aborts, whoever writes. ``{t}`` is the table holding
# the rows: ``events`` in a format 1 log, ``rows`` in format 2.
_ARCHIVE_TRIGGERS = (
    """CREATE TRIGGER IF NOT EXISTS events_no_delete BEFORE DELETE ON {t}
       WHEN OLD.seq > COALESCE((SELECT MAX(last_seq) FROM archive_segments), 0)
         OR OLD.seq IS NOT (SELECT MIN(seq) FROM {t})
       BEGIN SELECT RAISE(ABORT, 'events is append-only: DELETE refused (only the oldest rows, once an archive \
segment holds them)'); END""",
    """CREATE TRIGGER IF NOT EXISTS archive_segments_no_update BEFORE UPDATE ON archive_segments
       BEGIN SELECT RAISE(ABORT, 'archive_segments is append-only: UPDATE refused'); END""",
    """CREATE TRIGGER IF NOT EXISTS archive_segments_no_delete BEFORE DELETE ON archive_segments
       BEGIN SELECT RAISE(ABORT, 'archive_segments is append-only: DELETE refused'); END""",
    """CREATE TRIGGER IF NOT EXISTS archive_segments_contiguous BEFORE INSERT ON archive_segments
       WHEN NEW.first_seq IS NOT COALESCE((SELECT MAX(last_seq) FROM archive_segments), 0) + 1
         OR NEW.last_seq < NEW.first_seq
         OR NEW.last_seq >= (SELECT MAX(seq) FROM {t})
         OR NEW.last_hash IS NOT (SELECT hash FROM {t} WHERE seq = NEW.last_seq)
       BEGIN SELECT RAISE(ABORT, 'an archive segment must continue the last one, end before the live log''s \
last row and end on its hash'); END""",
)


def archive_triggers(table: str) -> tuple[str, ...]:
    """The archive guards for a log whose rows are in ``table``."""
    return tuple(ddl.replace("{t}", table) for ddl in _ARCHIVE_TRIGGERS)


# The row guards, the same in both formats (and under the same names): append-only, dense seq, time forward.
_ROW_TRIGGERS = (
    """CREATE TRIGGER IF NOT EXISTS events_no_update BEFORE UPDATE ON {t}
       BEGIN SELECT RAISE(ABORT, 'events is append-only: UPDATE refused'); END""",
    """CREATE TRIGGER IF NOT EXISTS events_dense_seq BEFORE INSERT ON {t}
       WHEN NEW.seq IS NOT (SELECT COALESCE(MAX(seq), 0) + 1 FROM {t})
       BEGIN SELECT RAISE(ABORT, 'events.seq must be max(seq) + 1'); END""",
    """CREATE TRIGGER IF NOT EXISTS events_time_forward BEFORE INSERT ON {t}
       WHEN NEW.recorded_at < COALESCE((SELECT recorded_at FROM {t} ORDER BY seq DESC LIMIT 1), 0)
       BEGIN SELECT RAISE(ABORT, 'events.recorded_at must not go backwards'); END""",
)

# The hex digits of a pod stream's 16-byte key, spelled back as ``pod:<uuid>`` (the view below).
_HEX = "hex(r.stream)"
_POD_STREAM = ("'pod:' || lower(" + " || '-' || ".join(
    f"substr({_HEX}, {start}, {length})" for start, length in ((3, 8), (11, 4), (15, 4), (19, 4), (23, 12))) + ")")

# Format 2 (docs/compact-log.md, "Rows"): what format 1 stored per row, without what made it large.
# - ``stream``: a pod's stream (``pod:<uuid>``, most of them) as 17 bytes, x'01' and the UUID's 16;
#   any other stream as its text. (stream, version) stays unique, so SQLite still refuses a second
#   event at one version of a stream;
# - ``type``: a small integer, its name in ``types`` (append-only, like the rows);
# - no index on ``event_id`` (16 random bytes, unique by chance alone: nothing looks events up by
#   it) nor on ``recorded_at`` (time never goes backwards: a lookup by time is a binary search by seq).
# ``events`` is the view that gives every reader format 1's columns, and so the same rows: the chain
# hash is computed over them, in both formats.
FORMAT_2_DDL = (
    """CREATE TABLE IF NOT EXISTS types (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE) STRICT""",
    """CREATE TABLE IF NOT EXISTS rows (
       seq INTEGER PRIMARY KEY, recorded_at INTEGER NOT NULL, stream ANY NOT NULL, version INTEGER NOT NULL,
       type INTEGER NOT NULL, schema_v INTEGER NOT NULL, event_id BLOB NOT NULL, command_id TEXT,
       payload BLOB NOT NULL, hash BLOB NOT NULL, UNIQUE (stream, version)) STRICT""",
    "CREATE INDEX IF NOT EXISTS rows_command ON rows (command_id) WHERE command_id IS NOT NULL",
    f"""CREATE VIEW IF NOT EXISTS events AS
       SELECT r.seq AS seq, r.recorded_at AS recorded_at,
              CASE WHEN typeof(r.stream) = 'blob' THEN {_POD_STREAM} ELSE r.stream END AS stream_id,
              r.version AS version, t.name AS type, r.schema_v AS schema_v, r.event_id AS event_id,
              r.command_id AS command_id, r.payload AS payload, r.hash AS hash
       FROM rows AS r CROSS JOIN types AS t ON t.id = r.type""",
    """CREATE TRIGGER IF NOT EXISTS types_no_update BEFORE UPDATE ON types
       BEGIN SELECT RAISE(ABORT, 'types is append-only: UPDATE refused'); END""",
    """CREATE TRIGGER IF NOT EXISTS types_no_delete BEFORE DELETE ON types
       BEGIN SELECT RAISE(ABORT, 'types is append-only: DELETE refused'); END""",
    *(ddl.replace("{t}", "rows") for ddl in _ROW_TRIGGERS),
)

# Format 1, as every release before format 2 created it (a format 1 log is still read and appended to;
# bench/log_size.py writes one to compare the two).
FORMAT_1_DDL = (
    """CREATE TABLE events (seq INTEGER NOT NULL, stream_id TEXT NOT NULL, version INTEGER NOT NULL,
       type TEXT NOT NULL, schema_v INTEGER NOT NULL, event_id BLOB NOT NULL, command_id TEXT,
       recorded_at INTEGER NOT NULL, payload BLOB NOT NULL, hash BLOB NOT NULL, PRIMARY KEY (seq),
       UNIQUE (stream_id, version), UNIQUE (event_id)) STRICT""",
    "CREATE INDEX events_command ON events (command_id) WHERE command_id IS NOT NULL",
    "CREATE INDEX events_time ON events (recorded_at)",
    """CREATE TABLE meta ("key" TEXT NOT NULL, value TEXT NOT NULL, PRIMARY KEY ("key")) STRICT""",
    *(ddl.replace("{t}", "events") for ddl in _ROW_TRIGGERS),
)
