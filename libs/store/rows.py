"""Row <-> StoredEvent mapping and the hash chain, shared by the writer and every reader."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

from libs.errors import CorruptLog
from libs.events.codec import StoredEvent, decode_body, encode_body
from libs.events.schema import Event
from libs.placement.recorded import ResponseSettings
from libs.store.compact import COMPACT_TYPES, COMPACT_V, MetaSource, compact_body, expand

__all__ = ["COLUMNS", "GENESIS_HASH", "chain_hash", "event_row", "row_to_stored"]

COLUMNS = "seq, recorded_at, stream_id, version, type, schema_v, event_id, command_id, payload"
GENESIS_HASH = bytes(32)

_pack = msgspec.msgpack.Encoder().encode


def chain_hash(prev: bytes, row: Sequence[Any]) -> bytes:
    """sha256(prev || msgpack(row)) where row is the tuple of COLUMNS, in that order."""
    return hashlib.sha256(prev + _pack(tuple(row))).digest()


def event_row(
    seq: int, recorded_at: int, stream: str, version: int, event: Event, event_id: bytes, command_id: str | None,
    settings: ResponseSettings | None = None,
) -> tuple[Any, ...]:
    """The stored columns of one event, in COLUMNS order (what ``chain_hash`` covers).

    Grants, imports and corrections are stored compact (``libs.store.compact``); ``settings`` are the
    response settings their responses are reproduced from (recorded in ``meta`` by the writer)."""
    body = compact_body(event, settings)
    if body is None:
        return (seq, recorded_at, stream, version, type(event).__struct_config__.tag, type(event).SCHEMA,
                event_id, command_id, encode_body(event))
    return (seq, recorded_at, stream, version, type(event).__struct_config__.tag, COMPACT_V,
            event_id, command_id, body)


def row_to_stored(row: Sequence[Any], source: MetaSource = None) -> StoredEvent:
    """The row's event, decoded; ``source`` (the log's connection or path) is where the response
    settings a compact grant names are read from, the first time this process meets them."""
    seq, recorded_at, stream_id, version, type_name, schema_v, event_id, command_id, payload = row
    if not isinstance(payload, bytes):
        raise CorruptLog(seq, "payload is not a blob")
    if schema_v == COMPACT_V and type_name in COMPACT_TYPES:
        event = expand(payload, source, seq=seq)
    else:
        event = decode_body(type_name, schema_v, payload, seq=seq)
    return StoredEvent(
        seq=seq,
        recorded_at=recorded_at,
        stream_id=stream_id,
        version=version,
        event_id=event_id.hex(),
        command_id=command_id,
        event=event,
    )

