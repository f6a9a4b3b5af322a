"""Encoding of events: msgpack in the log, JSON on NATS and in the CLI, upcasting of old versions.

The log stores each event's msgpack body together with its ``type`` and ``schema_v`` columns. On read,
a body whose version is the current one takes the fast typed path; an older one is decoded untyped,
passed through the registered upcasters one version at a time, then converted to today's Struct.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec

from libs.errors import CorruptLog
from libs.events.schema import EVENT_TYPES, AnyEvent, Event

__all__ = [
    "EventRecord",
    "StoredEvent",
    "decode_body",
    "decode_record",
    "encode_body",
    "format_time",
    "from_record",
    "parse_time",
    "register_upcaster",
    "to_record",
]

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
_UPCASTERS: dict[tuple[str, int], Upcaster] = {}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyEvent)


class StoredEvent(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One committed row of the log, with its event decoded."""

    seq: int
    recorded_at: int          # unix nanoseconds, never smaller than the previous row's
    stream_id: str
    version: int
    event_id: str             # 32 hex characters
    command_id: str | None = None
    event: AnyEvent
    # hex sha256 chain hash of the row (empty where the reader did not read it): the relay publishes
    # it with the event, so that the fleet copy pins the node's chain
    row_hash: str = ""

    @property
    def type(self) -> str:
        return self.event.__struct_config__.tag  # type: ignore[return-value]


class EventRecord(msgspec.Struct, kw_only=True):
    """The JSON form: one line of ``gpuledger events --json`` and one NATS message payload."""

    seq: int
    time: str
    recorded_at: int
    type: str
    schema: int
    stream: str
    version: int
    event_id: str
    command_id: str | None = None
    data: dict[str, Any]


def register_upcaster(type_name: str, from_version: int, fn: Upcaster) -> None:
    """Register how a ``type_name`` body of ``from_version`` becomes ``from_version + 1``."""
    _UPCASTERS[(type_name, from_version)] = fn


def encode_body(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_body(type_name: str, schema_v: int, body: bytes, *, seq: int = 0) -> AnyEvent:
    cls = EVENT_TYPES.get(type_name)
    if cls is None:
        raise CorruptLog(seq, f"unknown event type {type_name!r}: written by a newer gpuledger?")
    try:
        if schema_v == cls.SCHEMA:
            return _decoder.decode(body)
        if schema_v > cls.SCHEMA:
            raise CorruptLog(seq, f"{type_name} schema {schema_v} is newer than this code ({cls.SCHEMA})")
        data = msgspec.msgpack.decode(body)
        return _upcast(type_name, schema_v, data, seq)
    except msgspec.DecodeError as exc:
        raise CorruptLog(seq, str(exc)) from exc
    except msgspec.ValidationError as exc:
        raise CorruptLog(seq, f"{type_name} v{schema_v}: {exc}") from exc


def _upcast(type_name: str, version: int, data: dict[str, Any], seq: int) -> AnyEvent:
    current = EVENT_TYPES[type_name].SCHEMA
    while version < current:
        step = _UPCASTERS.get((type_name, version))
        if step is None:
            raise CorruptLog(seq, f"no upcaster for {type_name} v{version} -> v{version + 1}")
        data = step(data)
        version += 1
    data["type"] = type_name
    return msgspec.convert(data, AnyEvent)


def format_time(ns: int) -> str:
    """RFC 3339 UTC with all nine digits, so a printed time names exactly one instant of the log."""
    seconds, frac = divmod(ns, 1_000_000_000)
    return f"{_second_text(seconds)}.{frac:09d}Z"


@functools.lru_cache(maxsize=256)
def _second_text(seconds: int) -> str:
    """A log's times come in runs within one second: the relay formats one per published event."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def parse_time(text: str) -> int:
    """ISO-8601 (``2026-11-22T14:00:00.123456789Z``; local time without a zone) or unix seconds -> ns.

    Up to nine fractional digits are kept exactly (``datetime`` alone stops at microseconds).
    """
    try:
        return int(float(text) * 1e9) if _NUMBER.match(text) else _parse_iso(text)
    except ValueError as exc:
        raise ValueError(f"not a time: {text!r} (use ISO-8601 like 2026-11-22T14:00:00Z, or unix seconds)") from exc


_NUMBER = re.compile(r"^\d+(\.\d*)?$")
_FRACTION = re.compile(r"\.(\d{1,9})")


def _parse_iso(text: str) -> int:
    text = text.strip().replace("Z", "+00:00")
    nanos = 0
    m = _FRACTION.search(text)
    if m:
        nanos = int(m.group(1).ljust(9, "0"))
        text = text[: m.start()] + text[m.end():]
    return int(datetime.fromisoformat(text).timestamp()) * 1_000_000_000 + nanos


def to_record(stored: StoredEvent) -> EventRecord:
    data = msgspec.to_builtins(stored.event)
    data.pop("type", None)
    return EventRecord(
        seq=stored.seq,
        time=format_time(stored.recorded_at),
        recorded_at=stored.recorded_at,
        type=stored.type,
        schema=type(stored.event).SCHEMA,
        stream=stored.stream_id,
        version=stored.version,
        event_id=stored.event_id,
        command_id=stored.command_id,
        data=data,
    )


def from_record(record: EventRecord) -> StoredEvent:
    data = dict(record.data)
    cls = EVENT_TYPES.get(record.type)
    if cls is None:
        raise CorruptLog(record.seq, f"unknown event type {record.type!r}")
    try:
        event = (
            msgspec.convert({**data, "type": record.type}, AnyEvent)
            if record.schema == cls.SCHEMA
            else _upcast(record.type, record.schema, data, record.seq)
        )
    except msgspec.ValidationError as exc:
        raise CorruptLog(record.seq, f"{record.type} v{record.schema}: {exc}") from exc
    return StoredEvent(
        seq=record.seq,
        recorded_at=record.recorded_at,
        stream_id=record.stream,
        version=record.version,
        event_id=record.event_id,
        command_id=record.command_id,
        event=event,
    )


_record_decoder = msgspec.json.Decoder(EventRecord)


def decode_record(data: bytes) -> StoredEvent:
    """One NATS message payload (an ``EventRecord`` in JSON) -> the committed event it carries.

    Raises msgspec's DecodeError/ValidationError for a payload that is not a record, CorruptLog for
    one whose event this code cannot read."""
    return from_record(_record_decoder.decode(data))
