"""Tamper evidence: an edited, deleted or reordered row is found and its seq named; crashes lose nothing committed."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from libs.errors import StoreError
from libs.ledger.snapshot import load_state, save_snapshot
from libs.store import EventLog, replay
from libs.store.verify import verify_log
from tests.builders import released_event


async def write(path: Path, count: int) -> None:
    event_log = await EventLog.open(path)
    try:
        for i in range(count):
            await event_log.append([released_event(i)])
    finally:
        await event_log.close()


@pytest.fixture
async def log_path(tmp_path: Path) -> Path:
    path = tmp_path / "state" / "ledger.sqlite"
    await write(path, 20)
    return path


def tamper(path: Path, *sql: str) -> None:
    """Change the file the way an attacker with sqlite3 would: without our triggers."""
    conn = sqlite3.connect(path, isolation_level=None)
    for trigger in ("events_no_update", "events_no_delete", "events_dense_seq", "events_time_forward"):
        conn.execute(f"DROP TRIGGER IF EXISTS {trigger}")
    for statement in sql:
        conn.execute(statement)
    conn.close()


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def gpuledger(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuledger", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def test_an_intact_log_verifies(log_path: Path) -> None:
    report = verify_log(log_path)
    assert (report.ok, report.events, report.last_seq, report.first_bad_seq) == (True, 20, 20, None)


def test_an_edited_row_is_found(log_path: Path) -> None:
    tamper(log_path, "UPDATE rows SET payload = (SELECT payload FROM events WHERE seq = 8) WHERE seq = 7")
    report = verify_log(log_path)
    assert (report.ok, report.first_bad_seq, report.last_seq) == (False, 7, 6)
    assert "edited" in report.problem


def test_an_edited_time_is_found(log_path: Path) -> None:
    tamper(log_path, "UPDATE rows SET recorded_at = recorded_at + 1 WHERE seq = 12")
    assert verify_log(log_path).first_bad_seq == 12


def test_a_deleted_row_is_found(log_path: Path) -> None:
    tamper(log_path, "DELETE FROM rows WHERE seq = 5")
    report = verify_log(log_path)
    assert (report.ok, report.first_bad_seq) == (False, 5)
    assert "seq 5 is missing" in report.problem


def test_a_deleted_row_with_the_rest_renumbered_is_found(log_path: Path) -> None:
    tamper(log_path, "DELETE FROM rows WHERE seq = 5", "UPDATE rows SET seq = seq - 1 WHERE seq > 5")
    report = verify_log(log_path)
    assert (report.ok, report.first_bad_seq) == (False, 5)


def test_reordered_rows_are_found(log_path: Path) -> None:
    cols = "stream, version, type, schema_v, event_id, command_id, payload, hash"
    tamper(log_path,
           f"CREATE TEMP TABLE t AS SELECT seq, {cols} FROM rows WHERE seq IN (9, 10)",
           "UPDATE rows SET event_id = randomblob(16) WHERE seq IN (9, 10)",  # free the unique keys
           "UPDATE rows SET version = version + 1000 WHERE seq IN (9, 10)",
           *(f"UPDATE rows SET ({cols}) = (SELECT {cols} FROM t WHERE t.seq = {other}) WHERE seq = {seq}"
             for seq, other in ((9, 10), (10, 9))))
    report = verify_log(log_path)
    assert (report.ok, report.first_bad_seq) == (False, 9)


def test_rows_cut_off_the_end_are_found_against_the_snapshot(log_path: Path) -> None:
    save_snapshot(log_path, load_state(log_path).state)
    tamper(log_path, "DELETE FROM rows WHERE seq > 17")
    run = gpuledger("audit", "verify", "--state-dir", str(log_path.parent))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "NOT INTACT at seq 18" in run.stdout and "cut off the end" in run.stdout


def test_the_cli_reports_ok_and_the_first_bad_seq(log_path: Path) -> None:
    run = gpuledger("audit", "verify", "--state-dir", str(log_path.parent))
    assert run.returncode == 0 and "intact. 20 events" in run.stdout
    tamper(log_path, "UPDATE rows SET command_id = 'forged' WHERE seq = 3")
    run = gpuledger("audit", "verify", "--state-dir", str(log_path.parent))
    assert run.returncode == 1
    assert "NOT INTACT at seq 3" in run.stdout and "intact up to seq 2" in run.stdout


# --- crashes ---------------------------------------------------------------------------------------

async def crash_copy(tmp_path: Path, count: int) -> tuple[Path, Path]:
    """The files as a power cut would leave them: the log open, its last commits still in the WAL."""
    live = tmp_path / "live" / "ledger.sqlite"
    event_log = await EventLog.open(live)
    try:
        for i in range(count):
            await event_log.append([released_event(i)])
        crashed = tmp_path / "crashed" / "ledger.sqlite"
        crashed.parent.mkdir()
        shutil.copyfile(live, crashed)
        shutil.copyfile(f"{live}-wal", f"{crashed}-wal")
    finally:
        await event_log.close()
    assert Path(f"{crashed}-wal").stat().st_size > 0
    return live, crashed


async def test_a_torn_last_commit_in_the_wal_loses_only_that_commit(tmp_path: Path) -> None:
    _, crashed = await crash_copy(tmp_path, 10)
    wal = Path(f"{crashed}-wal")
    os.truncate(wal, wal.stat().st_size - 1000)  # the last frame was half written when the power went
    report = verify_log(crashed)
    assert report.ok and report.last_seq == 9, report
    assert any("-wal holds" in n for n in report.notes)
    event_log = await EventLog.open(crashed)  # the writer starts on it and carries on after seq 9
    try:
        assert event_log.last_seq == 9
        assert (await event_log.append([released_event(99)]))[0].seq == 10
    finally:
        await event_log.close()
    assert verify_log(crashed).ok


async def test_garbage_after_the_last_commit_loses_nothing(tmp_path: Path) -> None:
    _, crashed = await crash_copy(tmp_path, 10)
    append(Path(f"{crashed}-wal"), b"\xde\xad\xbe\xef" * 2000)
    report = verify_log(crashed)
    assert report.ok and report.last_seq == 10, report
    seen: list[int] = []
    replay(crashed, lambda e: seen.append(e.seq))
    assert seen == list(range(1, 11))


async def test_garbage_appended_to_the_main_file_is_reported_and_ignored(log_path: Path) -> None:
    append(log_path, b"\x00garbage" * 300)
    report = verify_log(log_path)
    assert report.ok and report.last_seq == 20
    assert any("bytes after the last page" in n for n in report.notes)
    await write(log_path, 1)  # and the writer carries on
    assert verify_log(log_path).last_seq == 21


def test_a_corrupt_main_file_is_a_clear_error_naming_it(log_path: Path) -> None:
    with open(log_path, "r+b") as f:
        f.write(b"this is not sqlite" * 6)  # the header
    for args in (["events"], ["replay"], ["audit", "verify"], ["history", "--pod", "p1"]):
        run = gpuledger(*args, "--state-dir", str(log_path.parent))
        assert run.returncode == 1, args
        assert f"{log_path} is not a readable gpuledger event log" in run.stderr, (args, run.stderr)
        assert "Traceback" not in run.stderr


async def test_the_allocator_refuses_a_corrupt_file_with_a_clear_error(log_path: Path) -> None:
    overwrite(log_path, 0, b"\xff" * 100)
    with pytest.raises(StoreError, match="not a readable gpuledger event log"):
        await EventLog.open(log_path)


def test_a_damaged_page_is_reported_by_verify(log_path: Path) -> None:
    page_size = 4096
    conn = sqlite3.connect(log_path)
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'rows'").fetchone()[0]
    conn.close()
    with open(log_path, "r+b") as f:
        f.seek(page_size * (root - 1) + 10)  # the page holding the rows (20 events fit in one)
        f.write(b"\xff" * 3000)
    report = verify_log(log_path)
    assert not report.ok
    assert "damaged" in report.problem or "cannot read" in report.problem
