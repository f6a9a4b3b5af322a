"""A log written by release 0.1 stays readable, with the same meaning, by every later version.

``tests/fixtures/ledger-v1.sqlite`` is committed and never rewritten (how it was made:
``tests/fixtures/make_fixture_log.py``). Its expected reading is committed beside it. Later code may add
fields (with defaults) to what it reads; it may not drop, rename or change anything that was there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import msgspec

from libs.events.codec import to_record
from libs.ledger.holdings import audit_replay
from libs.ledger.state import LedgerState
from libs.store import EventLog, iter_events, open_reader, replay
from libs.store.verify import verify_log

FIXTURES = Path(__file__).parent.parent / "fixtures"
LOG = FIXTURES / "ledger-v1.sqlite"
EXPECTED = json.loads((FIXTURES / "ledger-v1.expected.json").read_text())

# The stable names of the event types in the fixture: the `type` column, the JSON `type`, the subject suffix.
STABLE_TYPES = ["inventory.recorded", "alloc.imported", "alloc.granted", "alloc.refused", "alloc.released",
                "alloc.granted"]


def as_json(value: Any) -> Any:
    return json.loads(msgspec.json.encode(value))


def assert_contains(actual: Any, expected: Any, where: str = "$") -> None:
    """``actual`` holds everything ``expected`` does (dicts may have gained keys)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        for key, value in expected.items():
            assert key in actual, f"{where}.{key} is gone"
            assert_contains(actual[key], value, f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_contains(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def test_the_fixture_is_intact() -> None:
    report = verify_log(LOG)
    assert report.ok and report.events == len(STABLE_TYPES)


def test_every_event_reads_as_it_did() -> None:
    conn = open_reader(LOG)
    records = [as_json(to_record(e)) for e in iter_events(conn)]
    conn.close()
    assert [r["type"] for r in records] == STABLE_TYPES
    assert_contains(records, EXPECTED["records"])


def test_the_folded_state_at_every_seq_is_what_it_was() -> None:
    for seq, expected in EXPECTED["ledger_state"].items():
        state = LedgerState()
        replay(LOG, state.apply, upto_seq=int(seq))
        assert_contains(as_json(state.snapshot()), expected, f"ledger_state[{seq}]")


def test_the_audit_view_at_every_seq_is_what_it_was() -> None:
    for seq, expected in EXPECTED["audit_view"].items():
        assert_contains(as_json(audit_replay(LOG, upto_seq=int(seq))), expected, f"audit_view[{seq}]")


async def test_todays_writer_continues_the_old_log(tmp_path: Path) -> None:
    copy = tmp_path / "ledger.sqlite"
    shutil.copyfile(LOG, copy)
    event_log = await EventLog.open(copy)
    try:
        last = EXPECTED["records"][-1]
        stored = await event_log.append([to_record_event()])
        assert stored[0].seq == last["seq"] + 1
    finally:
        await event_log.close()
    assert verify_log(copy).ok


def to_record_event():  # type: ignore[no-untyped-def]
    from libs.events.schema import AllocationReleased

    return AllocationReleased(alloc_id="a1", pod_uid="uid-1", container="main", reason="deleted")
