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
from libs.store.compact import (
    COMPACT_TYPES,
    COMPACT_V,
    COMPACT_V2,
    COMPACT_V2_TYPES,
    COMPACT_V3,
    MetaSource,
    compact_body,
    expand,
)

__all__ = ["COLUMNS", "GENESIS_HASH", "chain_hash", "event_row", "rebuilt_row", "row_to_stored"]

COLUMNS = "seq, recorded_at, stream_id, version, type, schema_v, event_id, command_id, payload"
GENESIS_HASH = bytes(32)

_pack = msgspec.msgpack.Encoder().encode


def chain_hash(prev: bytes, row: Sequence[Any]) -> bytes:
    """sha256(prev || msgpack(row)) where row is the tuple of COLUMNS, in that order."""
    return hashlib.sha256(prev + _pack(row if type(row) in (tuple, list) else tuple(row))).digest()


def event_row(
    seq: int, recorded_at: int, stream: str, version: int, event: Event, event_id: bytes, command_id: str | None,
    settings: ResponseSettings | None = None, body_version: int = COMPACT_V,
) -> tuple[Any, ...]:
    """The stored columns of one event, in COLUMNS order (what ``chain_hash`` covers).

    Grants, imports, corrections and releases are stored compact (``libs.store.compact``, body version
    ``body_version``: the current one, or 3 or 2 where an old row is stored again); ``settings`` are the
    response settings their responses are reproduced from (recorded in ``meta`` by the writer)."""
    body = compact_body(event, settings, body_version, command_id)
    if body is None:
        return (seq, recorded_at, stream, version, type(event).__struct_config__.tag, type(event).SCHEMA,
                event_id, command_id, encode_body(event))
    return (seq, recorded_at, stream, version, type(event).__struct_config__.tag, body_version,
            event_id, command_id, body)


def rebuilt_row(
    stored: StoredEvent, prev: bytes, candidates: Sequence[ResponseSettings] = (), carried: bytes | None = None,
) -> tuple[tuple[Any, ...], ResponseSettings | None]:
    """The row the writer stored for an event read back from a copy (a stream record: a grant's response
    spelled out, schema 1), and the response settings its body names (None when it names none).

    A grant's stored form depends on what wrote it: body version 1 (a log written before the compact
    form), or version 2, 3 or 4 (a release: 1, 3 or 4) with the response kept, or named by the writer's
    response settings. With
    ``carried`` (the row's chain hash, which the stream carries) the form that gives that hash is taken,
    so the row is the original byte for byte; without, the most compact form the ``candidates`` give.
    When no form gives ``carried``, that compact form is returned and the caller's chain check names the row."""
    args = (stored.seq, stored.recorded_at, stored.stream_id, stored.version, stored.event,
            bytes.fromhex(stored.event_id), stored.command_id)

    def forms(version: int, kept: tuple[Any, ...]) -> list[tuple[tuple[Any, ...], ResponseSettings | None]]:
        """The rows of body ``version``: named by each candidate settings that reproduce the response,
        then ``kept`` (the response kept: readable without any settings)."""
        return [(row, s) for s in candidates if (row := event_row(*args, s, version)) != kept] + [(kept, None)]

    kept = event_row(*args)
    if kept[5] != COMPACT_V:
        return kept, None
    current = forms(COMPACT_V, kept)
    if carried is None:
        return current[0]
    # What an older gpuledger stored for the same event: body version 3 or 2 (with its settings, or the
    # response kept), or the whole event (schema 1).
    older = forms(COMPACT_V3, event_row(*args, body_version=COMPACT_V3))
    if kept[4] in COMPACT_V2_TYPES:
        older += forms(COMPACT_V2, event_row(*args, body_version=COMPACT_V2))
    legacy = (*args[:4], kept[4], type(stored.event).SCHEMA, *args[5:], encode_body(stored.event))
    for row, settings in (*current, *older, (legacy, None)):
        if chain_hash(prev, row) == carried:
            return row, settings
    return current[0]


def row_to_stored(row: Sequence[Any], source: MetaSource = None) -> StoredEvent:
    """A row of COLUMNS, optionally followed by its ``hash``, decoded; ``source`` (the log's connection
    or path) is where the response settings a compact grant names are read from, the first time this
    process meets them."""
    seq, recorded_at, stream_id, version, type_name, schema_v, event_id, command_id, payload = row[:9]
    row_hash = row[9].hex() if len(row) > 9 and isinstance(row[9], bytes) else ""
    if not isinstance(payload, bytes):
        raise CorruptLog(seq, "payload is not a blob")
    if (schema_v in (COMPACT_V, COMPACT_V3) and type_name in COMPACT_TYPES) or (schema_v == COMPACT_V2
                                                                  and type_name in COMPACT_V2_TYPES):
        event = expand(type_name, schema_v, payload, source, seq=seq, command_id=command_id)
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
        row_hash=row_hash,
    )

