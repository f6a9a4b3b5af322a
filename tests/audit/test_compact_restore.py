"""A log rebuilt from stream records (what `gpuledger log restore` writes) is the lost one byte for byte:
a record spells a compact grant's response out, and the grant is stored again under the response settings
its row named, chosen by the row hash the stream carries; without hashes or settings it stays readable."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec
import pytest

from bench.make_log import SETTINGS, as_format_1, synthetic, write_log
from libs.events.codec import EventRecord, StoredEvent, from_record, to_record
from libs.placement.recorded import ResponseSettings
from libs.store import compact as compact_module
from libs.store import iter_events, open_reader
from libs.store.replay import iter_rows
from libs.store.restore import recorded_settings, write_restored
from libs.store.rows import COLUMNS, row_to_stored
from libs.store.verify import verify_log

FIXTURE = Path(__file__).parent.parent / "fixtures" / "ledger-v1.sqlite"  # body version 1 rows
DECOY = ResponseSettings(vm_root="/elsewhere/vm", vdriver_root="/elsewhere/vdriver")


def stream_copy(path: Path, *, hashes: bool = True) -> list[StoredEvent]:
    """The log's events as the node's stream gives them back: JSON records (+ the row-hash header)."""
    conn = open_reader(path)
    try:
        stored = [row_to_stored(row, conn) for row in iter_rows(conn, f"{COLUMNS}, hash")]
    finally:
        conn.close()
    copied = []
    for s in stored:
        back = from_record(msgspec.json.decode(msgspec.json.encode(to_record(s)), type=EventRecord))
        copied.append(msgspec.structs.replace(back, row_hash=s.row_hash if hashes else ""))
    return copied


def events_of(path: Path) -> list[StoredEvent]:
    conn = open_reader(path)
    try:
        return [msgspec.structs.replace(s, row_hash="") for s in iter_events(conn)]
    finally:
        conn.close()


@pytest.fixture
def compact_log(tmp_path: Path) -> Path:
    path = tmp_path / "ledger.sqlite"
    write_log(path, synthetic(600), progress=False)  # grants stored compact under SETTINGS
    return path


def test_the_carried_hashes_pick_the_settings_and_the_log_comes_back_byte_for_byte(
        compact_log: Path, tmp_path: Path) -> None:
    restored = tmp_path / "restored.sqlite"
    count, _ = write_restored(restored, stream_copy(compact_log), [DECOY, *recorded_settings(compact_log)])
    assert count == 600
    report = verify_log(restored)
    assert report.ok, report.problem
    assert report.head_hash == verify_log(compact_log).head_hash
    compact_module._KNOWN.clear()  # the restored log's own meta reproduces the responses
    assert events_of(restored) == events_of(compact_log)
    with sqlite3.connect(restored) as db:
        keys = [k for (k,) in db.execute("SELECT key FROM meta WHERE key LIKE 'response-settings:%'")]
    assert keys == [compact_module.settings_row(SETTINGS)[0]]  # only what the rows name


def test_without_hashes_or_settings_the_responses_are_kept_and_every_event_reads_back(
        compact_log: Path, tmp_path: Path) -> None:
    restored = tmp_path / "restored.sqlite"
    write_restored(restored, stream_copy(compact_log, hashes=False))
    report = verify_log(restored)
    assert report.ok, report.problem
    assert report.head_hash != verify_log(compact_log).head_hash  # another stored form: a new chain
    compact_module._KNOWN.clear()
    assert events_of(restored) == events_of(compact_log)


def test_a_log_of_body_version_1_comes_back_as_it_was(tmp_path: Path) -> None:
    restored = tmp_path / "restored.sqlite"
    write_restored(restored, stream_copy(FIXTURE), [SETTINGS])
    assert verify_log(restored).head_hash == verify_log(FIXTURE).head_hash


def test_a_log_of_body_version_2_comes_back_as_it_was(compact_log: Path, tmp_path: Path) -> None:
    """Grants stored as maps (version 2) and releases whole, as the release before body version 3 wrote them."""
    old, restored = tmp_path / "v2.sqlite", tmp_path / "restored.sqlite"
    as_format_1(compact_log, old)
    with sqlite3.connect(old) as db:
        versions = dict(db.execute("SELECT type, MAX(schema_v) FROM events GROUP BY type").fetchall())
    assert versions == {"inventory.recorded": 1, "alloc.granted": compact_module.COMPACT_V2, "alloc.released": 1}
    write_restored(restored, stream_copy(old), [DECOY, *recorded_settings(old)])
    report = verify_log(restored)
    assert report.ok, report.problem
    assert report.head_hash == verify_log(old).head_hash
    assert events_of(restored) == events_of(old) == events_of(compact_log)
