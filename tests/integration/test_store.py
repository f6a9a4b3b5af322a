"""The SQLite event log: durability rules enforced by SQLite itself, group commit, replay."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from libs.errors import CorruptLog, StoreError
from libs.events.schema import AllocationGranted, AllocationReleased, ContainerResponse, InventoryRecorded
from libs.ledger.state import LedgerState
from libs.store import EventLog, iter_events, open_reader, replay, seq_at_time
from libs.store.replay import iter_rows
from libs.store.rows import COLUMNS, GENESIS_HASH, chain_hash
from libs.store.verify import verify_log
from libs.store.writer import LogWriter
from tests.builders.format1 import write_format1_log


def released(i: int, pod: str = "p") -> AllocationReleased:
    return AllocationReleased(alloc_id=f"a{i}", pod_uid=pod, container="c", reason="deleted")


@pytest.fixture(params=[False, True], ids=["writer-thread", "inline"])
async def event_log(tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Both ways to commit (libs/store/writer.py): every property below holds for each."""
    opened = await EventLog.open(tmp_path / "ledger.sqlite", inline=request.param)
    yield opened
    await opened.close()


async def test_concurrent_appends_get_dense_seq_and_per_stream_versions(event_log: EventLog) -> None:
    results = await asyncio.gather(*(event_log.append([released(i, pod=f"p{i % 4}")]) for i in range(300)))
    seqs = sorted(r[0].seq for r in results)
    assert seqs == list(range(1, 301))
    rows = sqlite3.connect(event_log.path).execute("SELECT stream_id, version FROM events ORDER BY seq").fetchall()
    per_stream: dict[str, list[int]] = {}
    for stream, version in rows:
        per_stream.setdefault(stream, []).append(version)
    assert all(v == list(range(1, 76)) for v in per_stream.values())


async def test_a_batch_is_atomic_and_a_command_is_written_once(event_log: EventLog) -> None:
    first = await event_log.append([released(1), released(2)], command_id="req-1")
    again = await event_log.append([released(3)], command_id="req-1")
    assert [e.seq for e in again] == [e.seq for e in first] == [1, 2]
    assert event_log.last_seq == 2


async def test_an_event_that_cannot_be_encoded_fails_its_own_append_and_the_writer_goes_on(
    event_log: EventLog,
) -> None:
    """A grant whose memory does not fit the log's 64-bit integers: its append gets a clear error at
    once (it used to kill the writer thread, and every append after it waited forever); the appends
    committed with it and after it are written, with dense seqs."""
    grant = AllocationGranted(alloc_id="a" * 32, request_id="r1", pod_uid="p", namespace="ns", pod_name="p",
                              container="c", container_index=0, cores=10, memory=1 << 70,
                              device_ids=("tencent.com/vcuda-core-1",), shares=(), response=ContainerResponse())
    bad, good = await asyncio.wait_for(asyncio.gather(event_log.append([released(1), grant]),
                                                      event_log.append([released(2)]), return_exceptions=True), 10)
    assert isinstance(bad, StoreError) and "cannot be recorded" in str(bad) and "OverflowError" in str(bad)
    assert [e.seq for e in good] == [1]  # type: ignore[union-attr]
    assert [e.seq for e in await asyncio.wait_for(event_log.append([released(3)]), 10)] == [2]
    assert [e.event for e in await event_log.read_after(0)] == [released(2), released(3)]


async def test_sqlite_refuses_edits_gaps_and_time_travel(event_log: EventLog) -> None:
    await event_log.append([released(1), released(2)])
    conn = sqlite3.connect(event_log.path)
    for sql, text in [
        ("UPDATE rows SET type = 7 WHERE seq = 1", "append-only"),
        ("DELETE FROM rows WHERE seq = 2", "append-only"),
        ("UPDATE types SET name = 'x'", "append-only"),
        ("DELETE FROM types", "append-only"),
        ("INSERT INTO rows SELECT seq + 5, recorded_at, stream, version + 5, type, schema_v, randomblob(16), NULL, "
         "payload, hash FROM rows WHERE seq = 2", "max\\(seq\\) \\+ 1"),
        ("INSERT INTO rows SELECT seq + 1, recorded_at - 1, stream, version + 5, type, schema_v, randomblob(16), "
         "NULL, payload, hash FROM rows WHERE seq = 2", "backwards"),
        ("INSERT INTO rows SELECT seq + 1, recorded_at, stream, version, type, schema_v, randomblob(16), "
         "NULL, payload, hash FROM rows WHERE seq = 2", "UNIQUE"),  # one event per version of a stream
        ("UPDATE events SET type = 'x' WHERE seq = 1", "view"),  # what readers see is not a table
    ]:
        with pytest.raises(sqlite3.DatabaseError, match=text):
            conn.execute(sql)
    conn.close()


async def test_time_never_goes_backwards_even_if_the_clock_does(tmp_path: Path) -> None:
    await EventLog.open(tmp_path / "l.sqlite")  # schema
    ticks = iter([5_000, 4_000, 6_000])
    writer = LogWriter(tmp_path / "l.sqlite", clock=lambda: next(ticks))
    writer.start(asyncio.get_running_loop())
    try:
        times = [(await writer.append([released(i)]))[0].recorded_at for i in range(3)]
    finally:
        writer.stop()
    assert times == [5_000, 5_000, 6_000]


async def test_the_hash_chain_covers_every_row(event_log: EventLog) -> None:
    await event_log.append([released(i) for i in range(5)])
    conn = sqlite3.connect(event_log.path)
    prev = GENESIS_HASH
    for row in conn.execute("SELECT seq, recorded_at, stream_id, version, type, schema_v, event_id, command_id, "
                            "payload, hash FROM events ORDER BY seq"):
        prev = chain_hash(prev, row[:-1])
        assert prev == row[-1]


async def test_replay_rebuilds_and_stops_at_a_time(event_log: EventLog) -> None:
    await event_log.append([released(1)])
    cut = event_log.last_seq
    conn = open_reader(event_log.path)
    t_cut = conn.execute("SELECT recorded_at FROM events WHERE seq = ?", (cut,)).fetchone()[0]
    conn.close()
    await asyncio.sleep(0.01)
    await event_log.append([released(2), released(3)])
    seen: list[int] = []
    assert replay(event_log.path, lambda e: seen.append(e.seq)) == 3
    assert seen == [1, 2, 3]
    seen.clear()
    replay(event_log.path, lambda e: seen.append(e.seq), upto_time=t_cut)
    assert seen == [1]
    assert seq_at_time(open_reader(event_log.path), 0) == 0


async def test_state_survives_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    first = await EventLog.open(path)
    await first.append([released(1), released(2)])
    await first.close()
    second = await EventLog.open(path)
    try:
        assert second.last_seq == 2
        stored = await second.append([released(3)])
        assert stored[0].seq == 3
        assert [e.seq for e in await second.read_after(1)] == [2, 3]
        state = LedgerState()
        assert await second.replay(state.apply) == 3
    finally:
        await second.close()


async def test_a_corrupt_payload_is_reported_with_its_seq(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    event_log = await EventLog.open(path)
    await event_log.append([released(1)])
    await event_log.close()
    conn = sqlite3.connect(path)
    conn.execute("DROP TRIGGER events_dense_seq")  # a damaged file, written by something that is not us
    conn.execute("INSERT INTO rows VALUES (2, (SELECT recorded_at FROM rows WHERE seq = 1), 's', 1, "
                 "(SELECT id FROM types WHERE name = 'alloc.released'), 1, randomblob(16), NULL, x'c1c1c1', x'00')")
    conn.commit()
    conn.close()
    with pytest.raises(CorruptLog, match="seq=2"):
        replay(path, lambda e: None)


def test_reading_a_missing_log_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no event log at"):
        open_reader(tmp_path / "nothing.sqlite")


async def test_a_log_in_another_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    await (await EventLog.open(path)).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'format'")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="log format 99"):
        await EventLog.open(path)


async def test_each_commit_hands_its_new_events_over_once(event_log: EventLog) -> None:
    handed: list[int] = []
    caught_up = asyncio.Event()

    def on_events(evs: list) -> None:  # type: ignore[type-arg]
        handed.extend(e.seq for e in evs)
        if handed and handed[-1] == 5:
            caught_up.set()

    event_log.on_events(on_events)
    await event_log.append([released(0)], command_id="same")
    # Retries of one command in the same group, and new events around them.
    await asyncio.gather(*(event_log.append([released(i)], command_id="same" if i % 2 else f"c{i}")
                           for i in range(1, 9)))
    await asyncio.wait_for(caught_up.wait(), 5)  # the hand-over runs on the loop right after each commit
    assert handed == list(range(1, event_log.last_seq + 1))
    assert event_log.last_seq == 5


async def test_a_format_1_log_is_read_and_appended_in_its_own_format(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    write_format1_log(path, [released(1), released(2)])
    before = verify_log(path)
    event_log = await EventLog.open(path)
    try:
        stored = await event_log.append([released(3), released(1)])
    finally:
        await event_log.close()
    assert [(e.seq, e.version) for e in stored] == [(3, 3), (4, 4)]  # the stream continues (found by its text)
    conn = sqlite3.connect(path)
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "rows" not in tables and conn.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 4
    conn.close()
    after = verify_log(path)
    assert before.ok and after.ok and after.last_seq == 4
    assert [e.seq for e in iter_events(open_reader(path))] == [1, 2, 3, 4]
    reopened = await EventLog.open(path)
    try:  # the outbox relay's read, in format 1
        assert [(e.seq, e.stream_id, e.event) for e in await reopened.read_after(1)] == [
            (2, "pod:p", released(2)), *((e.seq, e.stream_id, e.event) for e in stored)]
    finally:
        await reopened.close()


async def test_a_format_2_row_reads_back_as_it_was_hashed(event_log: EventLog) -> None:
    uid = "0a1b2c3d-0000-4000-8000-00000000abcd"
    stored = await event_log.append([AllocationReleased(alloc_id="a", pod_uid=uid, container="c", reason="deleted"),
                                     AllocationReleased(alloc_id="b", pod_uid="not-a-uuid", container="c",
                                                        reason="deleted")])
    conn = sqlite3.connect(event_log.path)
    keys = [k for (k,) in conn.execute("SELECT stream FROM rows ORDER BY seq")]
    assert keys == [b"\x01" + bytes.fromhex(uid.replace("-", "")), "pod:not-a-uuid"]
    conn.close()
    assert [e.stream_id for e in iter_events(open_reader(event_log.path))] == [e.stream_id for e in stored]
    assert verify_log(event_log.path).ok  # the hashes of the rows as the view gives them back


async def test_the_scans_read_the_rows_as_the_view_gives_them(event_log: EventLog) -> None:
    """Replay, verify, the witness and the relay read format 2's table itself, not the view: the same rows."""
    uid = "0a1b2c3d-0000-4000-8000-00000000abcd"
    await event_log.append([released(1, uid), released(2, "not-a-uuid")])
    relayed = await event_log.read_after(0)  # the relay now knows the types of these rows
    await event_log.append([InventoryRecorded(node="n", backend="fake", gpus=()), released(3, uid)])  # a new type
    conn = sqlite3.connect(event_log.path)
    viewed = conn.execute(f"SELECT {COLUMNS}, hash FROM events ORDER BY seq").fetchall()
    conn.close()
    assert [tuple(r) for r in iter_rows(open_reader(event_log.path), f"{COLUMNS}, hash")] == viewed
    assert [tuple(r) for r in iter_rows(open_reader(event_log.path), "type, seq, stream_id")] == [
        (r[4], r[0], r[2]) for r in viewed]
    relayed += await event_log.read_after(2)
    assert [(e.seq, e.stream_id, e.event.__struct_config__.tag, e.row_hash) for e in relayed] == [
        (r[0], r[2], r[4], r[9].hex()) for r in viewed]
