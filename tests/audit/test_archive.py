"""Archive segments: the chain continues across them, readers span them, verify names a bad one, a
crash at any step leaves a consistent log + archive that start-up finishes, and the CLI asks the
running allocator to archive."""

from __future__ import annotations

import asyncio
import importlib
import shutil
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench.make_log import START_NS, synthetic, write_log
from gpuledger.cli import main
from gpuledger.inspect import audit_view, last_seq, print_events, replay_state
from libs.bus.server import NatsServer
from libs.config import Settings
from libs.events.codec import StoredEvent
from libs.events.schema import InventoryRecorded
from libs.ledger.holdings import audit_replay
from libs.ledger.timeline import gpu_history, pod_history
from libs.store import EventLog, create_schema
from libs.store import compact as compact_module
from libs.store.archive import InjectedCrash, archive_dir, archive_prefix, catalog, finish, segment_rows
from libs.store.replay import iter_rows, open_reader
from libs.store.rows import COLUMNS, GENESIS_HASH, row_to_stored
from libs.store.verify import verify_log
from libs.witness.audit import log_leaves
from services.allocator import app as allocator_app
from tests.builders.format1 import FIXTURE, write_format1_log
from tests.polling import eventually

EVENTS = 3_000
replay_module = importlib.import_module("libs.store.replay")
archive_module = importlib.import_module("libs.store.archive")  # the module (the package exports a function so named)


def _rows(path: Path) -> list[tuple[object, ...]]:
    conn = open_reader(path)
    try:
        return [tuple(r) for r in iter_rows(conn, "seq, recorded_at, stream_id, version, type, payload, hash")]
    finally:
        conn.close()


def _live(path: Path) -> tuple[int, int]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT MIN(seq), MAX(seq) FROM events").fetchone()
    finally:
        conn.close()


@pytest.fixture
def logs(tmp_path: Path) -> tuple[Path, Path]:
    """(a log of EVENTS events, an untouched copy of it in another state dir)."""
    path = tmp_path / "state" / "ledger.sqlite"
    write_log(path, synthetic(EVENTS), progress=False)
    copy = tmp_path / "copy" / "ledger.sqlite"
    copy.parent.mkdir()
    shutil.copyfile(path, copy)
    return path, copy


def test_segments_continue_the_chain_and_readers_see_one_history(logs: tuple[Path, Path]) -> None:
    path, copy = logs
    first = archive_prefix(path, 1_000)
    second = archive_prefix(path, 2_000)
    assert first is not None and second is not None
    assert (first.first_seq, first.last_seq, first.prev_hash) == (1, 1_000, GENESIS_HASH)
    assert (second.first_seq, second.last_seq, second.prev_hash) == (1_001, 2_000, first.last_hash)
    assert _live(path) == (2_001, EVENTS)
    conn = sqlite3.connect(path)
    live_first_hash = conn.execute("SELECT hash FROM events WHERE seq = 1000").fetchone()
    assert live_first_hash is None  # really gone from the live file
    assert [s.file for s in catalog(conn)] == [first.file, second.file]
    conn.close()
    # compressed: the segment holds 1,000 of the file's events (its pages stay allocated) in well under a
    # quarter of the file (about 1/10 with version 4 bodies, 1/14 with version 3)
    assert (archive_dir(path) / first.file).stat().st_size < path.stat().st_size / 8

    assert _rows(path) == _rows(copy)  # every row, every hash, in seq order
    report = verify_log(path)
    assert report.ok, report.problem
    assert (report.events, report.last_seq, report.segments) == (EVENTS, EVENTS, 2)
    assert report.head_hash == verify_log(copy).head_hash
    assert archive_prefix(path, 1_500) is None  # already archived: nothing to do


def test_the_live_log_still_refuses_every_other_delete_and_update(logs: tuple[Path, Path]) -> None:
    path, _ = logs
    conn = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        conn.execute("DELETE FROM rows WHERE seq = 1")  # no segment holds it yet
    conn.close()
    archive_prefix(path, 1_000)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for sql in ("DELETE FROM rows WHERE seq = 1500",  # not archived
                    "DELETE FROM rows WHERE seq = 2999",
                    "UPDATE rows SET version = 7 WHERE seq = 2000",
                    "DELETE FROM archive_segments",
                    "UPDATE archive_segments SET last_seq = 5"):
            with pytest.raises(sqlite3.IntegrityError, match="append-only"):
                conn.execute(sql)
        with pytest.raises(sqlite3.IntegrityError, match="continue the last one"):  # a gap, then a wrong hash
            conn.execute("INSERT INTO archive_segments VALUES (1500, 1600, 0, 0, x'', x'', 'f', x'', 0)")
        with pytest.raises(sqlite3.IntegrityError, match="continue the last one"):
            conn.execute("INSERT INTO archive_segments VALUES (1001, 1600, 0, 0, x'', x'00', 'f', x'', 0)")
    finally:
        conn.close()
    assert verify_log(path).ok


@pytest.mark.parametrize("damage", ["missing", "edited", "reordered"])
def test_verify_names_a_missing_edited_or_reordered_segment(logs: tuple[Path, Path], damage: str) -> None:
    path, _ = logs
    segs = [archive_prefix(path, upto) for upto in (1_000, 2_000)]
    files = [archive_dir(path) / s.file for s in segs if s is not None]
    if damage == "missing":
        files[1].unlink()
    elif damage == "edited":
        raw = bytearray(files[1].read_bytes())
        raw[len(raw) // 2] ^= 0x01
        files[1].write_bytes(bytes(raw))
    else:  # the two segments' files swapped
        a, b = files[0].read_bytes(), files[1].read_bytes()
        files[0].write_bytes(b)
        files[1].write_bytes(a)
    report = verify_log(path)
    assert not report.ok
    bad = files[0] if damage == "reordered" else files[1]
    assert report.bad_segment == bad.name
    assert bad.name in report.problem
    assert ("missing" if damage == "missing" else "edited or replaced") in report.problem
    assert report.first_bad_seq == (1 if damage == "reordered" else 1_001)

    result = CliRunner().invoke(main, ["audit", "verify", "--state-dir", str(path.parent)])
    assert result.exit_code == 1
    assert f"NOT INTACT at seq {report.first_bad_seq}" in result.output and bad.name in result.output


def test_compact_grants_in_a_segment_carry_their_response_settings(logs: tuple[Path, Path]) -> None:
    path, copy = logs
    seg = archive_prefix(path, 1_500)
    assert seg is not None
    key = compact_module.SETTINGS_PREFIX
    segment_grants = [row for _, row in segment_rows(archive_dir(path) / seg.file) if row[4] == "alloc.granted"]
    assert segment_grants and {row[5] for row in segment_grants} == {compact_module.COMPACT_V}
    # A log whose live meta lost the entry (as a log assembled from parts would): the segment's own copy
    # of the settings still reproduces its grants' responses, in a process that has not met them yet.
    conn = sqlite3.connect(path)
    assert conn.execute("DELETE FROM meta WHERE key LIKE ?", (key + "%",)).rowcount == 1
    conn.commit()
    conn.close()
    compact_module._KNOWN.clear()
    reader, original = open_reader(path), open_reader(copy)
    try:
        archived = [row_to_stored(r, reader) for r in iter_rows(reader, COLUMNS, upto_seq=1_500)]
        compact_module._KNOWN.clear()
        expected = [row_to_stored(r, original) for r in iter_rows(original, COLUMNS, upto_seq=1_500)]
    finally:
        reader.close()
        original.close()
    assert archived == expected


def test_replay_at_a_time_inside_an_archive_equals_the_replay_before_archiving(logs: tuple[Path, Path]) -> None:
    path, copy = logs
    archive_prefix(path, 1_200)
    archive_prefix(path, 2_400)
    for seq in (700, 1_800, 2_900):
        at = START_NS + seq * 1_000_000  # make_log: seq n is recorded at START_NS + n ms
        assert audit_view(path, at=at) == audit_view(copy, at=at)
        assert replay_state(path, at=at) == replay_state(copy, at=at)
        assert audit_view(path, seq=seq).seq == seq
    assert pod_history(path, "job-10") == pod_history(copy, "job-10")
    assert gpu_history(path, "3") == gpu_history(copy, "3")


@pytest.mark.parametrize("in_memory", [True, False], ids=["in-memory", "segment-over-the-memory-limit"])
def test_the_audit_replay_reads_each_segment_apart_and_sees_what_a_merged_reading_sees(
    logs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, in_memory: bool
) -> None:
    # The audit replay scans the history once, so it reads the segments one by one instead of merging
    # them (open_reader(merged=False)): every holder's event id (looked up in the segment holding its
    # grant), every time inside a segment and between two, the same view as the unarchived copy's.
    path, copy = logs
    archive_prefix(path, 1_000)
    archive_prefix(path, 2_000)
    if not in_memory:  # a segment too big for memory is decompressed into a temporary file instead
        monkeypatch.setattr(archive_module, "IN_MEMORY_LIMIT", 1_000)
    merged = []
    monkeypatch.setattr(replay_module, "materialize", lambda *a: merged.append(a) or pytest.fail("merged"))
    for seq in (1, 999, 1_000, 1_001, 2_000, 2_500, EVENTS):
        assert audit_view(path, seq=seq) == audit_view(copy, seq=seq)
        at = START_NS + seq * 1_000_000 + 500_000  # between two events
        assert audit_view(path, at=at) == audit_view(copy, at=at)
    assert audit_view(path, at=START_NS) == audit_view(copy, at=START_NS)  # before the first event
    # The other readers that scan the history once read it the same way: history, the witness's leaves,
    # and the last seq (`events --since`, `replay --seq` check it), which needs no segment at all.
    assert pod_history(path, "job-10") == pod_history(copy, "job-10")
    assert gpu_history(path, "3") == gpu_history(copy, "3")
    assert log_leaves(path) == log_leaves(copy)
    assert last_seq(path) == last_seq(copy) == EVENTS
    assert not merged


def test_rows_the_audit_replay_decodes_in_full_come_from_their_segment(tmp_path: Path) -> None:
    # The release 0.1 fixture: older body versions and a refusal (a type without a view), which the
    # audit replay decodes in full, by seq. Once archived, those rows are only in the segment.
    path = tmp_path / "ledger.sqlite"
    shutil.copyfile(FIXTURE, path)
    create_schema(path)
    before = [audit_replay(path, upto_seq=seq) for seq in range(1, 7)]
    others_before: list[StoredEvent] = []
    audit_replay(path, on_other=others_before.append)
    assert archive_prefix(path, 5) is not None and _live(path) == (6, 6)
    assert [audit_replay(path, upto_seq=seq) for seq in range(1, 7)] == before
    others: list[StoredEvent] = []
    audit_replay(path, on_other=others.append)
    assert [type(o.event).__name__ for o in others] == ["AllocationRefused"] and others == others_before


def test_events_since_a_seq_prints_the_same_lines(logs: tuple[Path, Path], tmp_path: Path) -> None:
    path, copy = logs
    archive_prefix(path, 2_000)
    for since in (0, 1_500, 2_500):
        out_a, out_b = tmp_path / "a.txt", tmp_path / "b.txt"
        with open(out_a, "w") as a, open(out_b, "w") as b:
            print_events(path, since=since, as_json=True, out=a)
            print_events(copy, since=since, as_json=True, out=b)
        assert out_a.read_text() == out_b.read_text() and out_a.read_text()


@pytest.mark.parametrize("step", ["segment", "heads", "catalog"])
def test_a_crash_after_any_step_leaves_a_consistent_log_that_start_up_finishes(
    logs: tuple[Path, Path], step: str
) -> None:
    path, copy = logs
    archive_prefix(path, 1_000)
    with pytest.raises(InjectedCrash):
        archive_prefix(path, 2_000, fail_after=step)
    (archive_dir(path) / ".000000001001-000000002000.seg.zst.tmp").write_bytes(b"torn")  # a half-written file

    assert verify_log(path).ok  # consistent as it stands: nothing lost, nothing read twice
    assert _rows(path) == _rows(copy)

    did = finish(path)
    assert any("unfinished" in line for line in did)
    assert not list(archive_dir(path).glob(".*.tmp"))
    assert _live(path) == (2_001, EVENTS)  # the half-done archive is finished
    assert [s.last_seq for s in catalog(sqlite3.connect(path))] == [1_000, 2_000]
    report = verify_log(path)
    assert report.ok and report.segments == 2 and report.events == EVENTS
    assert _rows(path) == _rows(copy)
    assert finish(path) == []  # idempotent


def test_a_crash_half_way_through_the_delete(logs: tuple[Path, Path]) -> None:
    path, copy = logs
    with pytest.raises(InjectedCrash):
        archive_prefix(path, 2_000, fail_after="catalog")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("DELETE FROM rows WHERE seq <= 700")  # one chunk of the prefix went, then the crash
    conn.close()
    report = verify_log(path)
    assert report.ok and any("still holds rows" in n for n in report.notes)
    assert _rows(path) == _rows(copy)
    finish(path)
    assert _live(path) == (2_001, EVENTS)
    assert verify_log(path).notes == []


async def test_stream_versions_continue_after_their_rows_were_archived(logs: tuple[Path, Path]) -> None:
    path, _ = logs
    archive_prefix(path, 2_000)  # seq 1, the only "inventory" event (version 1), is archived
    event_log = await EventLog.open(path)
    try:
        stored = await event_log.append([InventoryRecorded(node="bench", backend="fake", driver_version="", gpus=())])
    finally:
        await event_log.close()
    assert stored[0].stream_id == "inventory" and stored[0].version == 2
    assert verify_log(path).ok


async def test_cli_archive_against_a_running_allocator_and_a_restart_that_needs_no_segment(
    nats_server: NatsServer, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(node_name="n1", state_dir=str(short_dir / "state"), nats_url=nats_server.url, gpus="fake")
    write_log(settings.log_path, synthetic(EVENTS), progress=False)
    async with allocator_app.service(settings) as svc:
        last = svc.handlers.state.seq
        await svc.relay.wait_published(last, timeout=30)
        before = svc.handlers.state.snapshot()
        args = ["log", "archive", "--keep-events", "1000", "--nats-url", nats_server.url, "--node-name", "n1"]
        result = await asyncio.to_thread(CliRunner().invoke, main, args)
        assert result.exit_code == 0, result.output
        assert f"archived {last - 1_000:,} events (seq 1..{last - 1_000})" in result.output
        assert _live(settings.log_path) == (last - 999, last)
        again = await asyncio.to_thread(CliRunner().invoke, main, args)
        assert "nothing archived" in again.output
        bad = await asyncio.to_thread(CliRunner().invoke, main, ["log", "archive", "--nats-url", nats_server.url])
        assert bad.exit_code == 2 and "--before" in bad.output

    def no_segments(*_args: object) -> None:
        raise AssertionError("start-up read an archive segment")

    monkeypatch.setattr(replay_module, "materialize", no_segments)
    async with allocator_app.service(settings) as svc:  # the snapshot and the live tail are enough
        assert svc.handlers.state.snapshot() == before
    monkeypatch.undo()
    assert verify_log(settings.log_path).ok
    listing = CliRunner().invoke(main, ["log", "segments", "--state-dir", settings.state_dir])
    assert listing.exit_code == 0 and f"1..{last - 1_000}" in listing.output


async def test_retention_archives_by_itself(nats_server: NatsServer, short_dir: Path) -> None:
    settings = Settings(node_name="n1", state_dir=str(short_dir / "state"), nats_url=nats_server.url, gpus="fake",
                        log_retention_events=500)
    write_log(settings.log_path, synthetic(EVENTS), progress=False)
    async with allocator_app.service(settings) as svc:
        last = svc.handlers.state.seq
        await svc.relay.wait_published(last, timeout=30)
        assert svc.archiver.due(1, last) and not svc.archiver.due(last - 600, last)
        task = asyncio.create_task(svc.archiver.retention_forever(lambda: last, interval=0.05))
        try:
            await eventually(lambda: _live(settings.log_path)[0] == last - 499, timeout=30, interval=0.05,
                             what="the retention archive")
        finally:
            task.cancel()
    assert verify_log(settings.log_path).ok


async def test_a_stream_rebuilt_after_archiving_starts_where_the_live_log_starts(
    nats_server: NatsServer, short_dir: Path
) -> None:
    settings = Settings(node_name="n1", state_dir=str(short_dir / "state"), nats_url=nats_server.url, gpus="fake")
    write_log(settings.log_path, synthetic(EVENTS), progress=False)
    archive_prefix(settings.log_path, 2_000)
    async with allocator_app.service(settings) as svc:  # this broker has no stream for the node: rebuilt
        last = svc.handlers.state.seq
        await svc.relay.wait_published(last, timeout=30)
        bus = svc.relay.bus
        info = await bus.js.stream_info(bus.subjects.stream)
        assert (info.state.first_seq, info.state.last_seq) == (2_001, last)  # stream seq == log seq
        msg = await bus.js.get_msg(bus.subjects.stream, 2_001)
        assert b'"seq":2001' in msg.data


def test_a_log_written_before_archiving_existed_gets_the_guarded_trigger(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    write_format1_log(path, synthetic(100))  # format 1, no catalog, the unconditional DELETE trigger
    assert _rows(path)  # readers take a log without a catalog as it is

    create_schema(path)  # what the allocator's start does
    conn = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        conn.execute("DELETE FROM events WHERE seq = 1")  # format 1 keeps its table
    conn.close()
    assert archive_prefix(path, 50) is not None
    assert _live(path) == (51, 100) and verify_log(path).ok


async def test_the_allocator_finishes_a_half_done_archive_before_it_replays(
    nats_server: NatsServer, short_dir: Path
) -> None:
    settings = Settings(node_name="n1", state_dir=str(short_dir / "state"), nats_url=nats_server.url, gpus="fake")
    write_log(settings.log_path, synthetic(EVENTS), progress=False)
    with pytest.raises(InjectedCrash):
        archive_prefix(settings.log_path, 2_000, fail_after="segment")  # the file is written, nothing recorded
    async with allocator_app.service(settings) as svc:
        assert svc.handlers.state.seq == EVENTS + 1  # the whole history folded, nothing twice
        assert _live(settings.log_path)[0] == 2_001
    report = verify_log(settings.log_path)
    assert report.ok and report.segments == 1 and report.events == EVENTS + 1
