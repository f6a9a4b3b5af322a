"""Event encoding, JSON records, upcasting of old schema versions, subject escaping."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.errors import CorruptLog
from libs.events import codec
from libs.events.codec import (
    StoredEvent,
    decode_body,
    encode_body,
    from_record,
    parse_time,
    register_upcaster,
    to_record,
)
from libs.events.schema import EVENT_TYPES, AllocationReleased
from libs.events.subjects import Subjects, escape_token, unescape_token


def test_body_round_trip_and_record_round_trip() -> None:
    ev = AllocationReleased(alloc_id="a1", pod_uid="u1", container="c", reason="deleted")
    assert decode_body("alloc.released", 1, encode_body(ev)) == ev
    stored = StoredEvent(seq=7, recorded_at=1_700_000_000_123_456_789, stream_id="pod:u1", version=2,
                         event_id="ab" * 16, event=ev)
    rec = to_record(stored)
    assert rec.type == "alloc.released" and rec.data == {"alloc_id": "a1", "pod_uid": "u1", "container": "c",
                                                          "reason": "deleted"}
    assert rec.time == "2023-11-14T22:13:20.123456789Z"
    assert parse_time(rec.time) == stored.recorded_at
    assert from_record(msgspec.json.decode(msgspec.json.encode(rec), type=codec.EventRecord)) == stored


def test_old_versions_are_upcast_on_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend alloc.released is at schema 2 today and v1 called the field `why`.
    monkeypatch.setattr(AllocationReleased, "SCHEMA", 2)
    monkeypatch.setattr(codec, "_UPCASTERS", {})  # a fresh registry, restored after the test
    register_upcaster("alloc.released", 1,
                      lambda d: {**{k: v for k, v in d.items() if k != "why"}, "reason": d["why"]})
    old = msgspec.msgpack.encode({"type": "alloc.released", "alloc_id": "a", "pod_uid": "u", "container": "c",
                                  "why": "deleted"})
    assert decode_body("alloc.released", 1, old).reason == "deleted"  # type: ignore[union-attr]
    with pytest.raises(CorruptLog, match="newer than this code"):
        decode_body("alloc.released", 3, old, seq=5)


def test_unreadable_bodies_name_the_seq() -> None:
    with pytest.raises(CorruptLog, match="seq=9"):
        decode_body("alloc.released", 1, b"\xc1garbage", seq=9)
    with pytest.raises(CorruptLog, match="unknown event type"):
        decode_body("alloc.teleported", 1, b"", seq=3)
    with pytest.raises(CorruptLog, match="no upcaster"):
        decode_body("alloc.released", 0, msgspec.msgpack.encode({"type": "alloc.released"}), seq=4)


def test_every_event_type_has_a_schema_and_a_subject() -> None:
    subjects = Subjects("node-1")
    for name, cls in EVENT_TYPES.items():
        assert cls.SCHEMA >= 1
        subject = subjects.event(name)
        assert any(subject.startswith(s[:-1]) for s in subjects.event_subjects())


@given(st.text(min_size=1, max_size=80))
def test_escaping_round_trips_and_stays_one_token(name: str) -> None:
    token = escape_token(name)
    assert unescape_token(token) == name
    assert not set(token) & set(". *>\t\r\n")


def test_node_names_with_dots() -> None:
    s = Subjects("ip-10-0-0-1.ec2.internal")
    assert s.prefix == "gpuledger.ip-10-0-0-1_2Eec2_2Einternal"
    assert s.allocate == "gpuledger.ip-10-0-0-1_2Eec2_2Einternal.allocator.allocate"
    assert s.event("alloc.granted") == "gpuledger.ip-10-0-0-1_2Eec2_2Einternal.alloc.granted"
    assert s.stream == "GPULEDGER_ip-10-0-0-1_2Eec2_2Einternal"


@pytest.mark.parametrize(
    ("text", "ns"),
    [
        ("2023-11-14T22:13:20Z", 1_700_000_000 * 10**9),
        ("2023-11-14T22:13:20.5Z", 1_700_000_000 * 10**9 + 500_000_000),
        ("2023-11-14T22:13:20.000000001+00:00", 1_700_000_000 * 10**9 + 1),
        ("2023-11-15T00:13:20+02:00", 1_700_000_000 * 10**9),
        ("1700000000", 1_700_000_000 * 10**9),
    ],
)
def test_times_parse_exactly(text: str, ns: int) -> None:
    assert parse_time(text) == ns


@pytest.mark.parametrize("text", ["yesterday", "2023-13-40T00:00:00Z", ""])
def test_bad_times_are_named(text: str) -> None:
    with pytest.raises(ValueError, match="not a time"):
        parse_time(text)


# Published names: the log's `type` column, the JSON record's `type`, the NATS subject suffix and the
# docs/schemas file name. Never rename or remove one; add new types beside them.
STABLE_EVENT_NAMES = {"inventory.recorded", "alloc.granted", "alloc.released", "alloc.refused", "alloc.imported"}


def test_stable_event_names_are_kept() -> None:
    assert set(EVENT_TYPES) >= STABLE_EVENT_NAMES
    for name in EVENT_TYPES:
        domain, _, verb = name.partition(".")
        assert domain and verb and "." not in verb and name == name.lower()
