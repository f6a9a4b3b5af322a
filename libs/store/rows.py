"""Row <-> StoredEvent mapping and the hash chain, shared by the writer and every reader."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

from libs.errors import CorruptLog
from libs.events.codec import StoredEvent, decode_body, encode_body
from libs.events.schema import Event

__all__ = ["COLUMNS", "GENESIS_HASH", "chain_hash", "event_row", "row_to_stored"]

COLUMNS = "seq, recorded_at, stream_id, version, type, schema_v, event_id, command_id, payload"
GENESIS_HASH = bytes(32)

_pack = msgspec.msgpack.Encoder().encode


def chain_hash(prev: bytes, row: Sequence[Any]) -> bytes:
    """sha256(prev || msgpack(row)) where row is the tuple of COLUMNS, in that order."""
    return hashlib.sha256(prev + _pack(tuple(row))).digest()


def event_row(
    seq: int, recorded_at: int, stream: str, version: int, event: Event, event_id: bytes, command_id: str | None
) -> tuple[Any, ...]:
    """The stored columns of one event, in COLUMNS order (what ``chain_hash`` covers)."""
    return (seq, recorded_at, stream, version, type(event).__struct_config__.tag, type(event).SCHEMA,
            event_id, command_id, encode_body(event))


def row_to_stored(row: Sequence[Any]) -> StoredEvent:
    """A row of COLUMNS, optionally followed by its ``hash``."""
    seq, recorded_at, stream_id, version, type_name, schema_v, event_id, command_id, payload = row[:9]
    row_hash = row[9].hex() if len(row) > 9 and isinstance(row[9], bytes) else ""
    if not isinstance(payload, bytes):
        raise CorruptLog(seq, "payload is not a blob")
    return StoredEvent(
        seq=seq,
        recorded_at=recorded_at,
        stream_id=stream_id,
        version=version,
        event_id=event_id.hex(),
        command_id=command_id,
        event=decode_body(type_name, schema_v, payload, seq=seq),
        row_hash=row_hash,
    )
