"""The append-only SQLite event log (see log.py for the API)."""

from libs.store.log import EventLog, create_schema
from libs.store.replay import iter_events, open_reader, replay, seq_at_time

__all__ = ["EventLog", "create_schema", "iter_events", "open_reader", "replay", "seq_at_time"]
