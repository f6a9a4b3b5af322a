"""A damaged log names what is wrong and the one command that recovers it; `gpuledger log restore` rebuilds
it from the node's JetStream stream or from a backup, and the result is the log that was lost."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

from nats.js.errors import NotFoundError

from libs.bus.client import Bus
from libs.bus.server import NatsServer
from services.allocator import app as allocator_app
from tests.builders import settings_for
from tests.polling import eventually

FIXTURE = Path(__file__).parent.parent / "fixtures" / "ledger-v1.sqlite"


def gpuledger(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuledger", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def damage(path: Path) -> None:
    conn = sqlite3.connect(path)  # every committed page in the main file first (no WAL copy to fall back on)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    with path.open("r+b") as f:  # the SQLite header and the first pages: "file is not a database"
        f.write(b"\x00garbage" * 512)


def assert_points_to_restore(run: subprocess.CompletedProcess[str], state: Path) -> None:
    assert run.returncode == 1
    assert "is not a readable gpuledger event log" in run.stderr and "SQLite:" in run.stderr, run.stderr
    assert f"gpuledger log restore --state-dir {state}" in run.stderr
    assert "audit verify" not in run.stderr  # no circular advice


async def test_a_damaged_log_is_restored_from_the_nodes_stream(nats_server: NatsServer, short_dir: Path) -> None:
    settings = settings_for(short_dir, nats_server.url)
    state, path = Path(settings.state_dir), settings.log_path
    state.mkdir(parents=True)
    shutil.copy(FIXTURE, path)
    async with allocator_app.service(settings):  # publishes the whole log to the node's stream
        bus = await Bus.connect(nats_server.url, name="test", node=settings.node_name)
        try:
            async def published() -> bool:
                try:
                    info = await bus.js.stream_info(bus.subjects.stream)
                except NotFoundError:  # not created yet
                    return False
                return info.state.last_seq >= 7  # the fixture's 6 and the fake GPUs' inventory
            await eventually(published, timeout=20, interval=0.1, what="the log published")
        finally:
            await bus.close()
    before = gpuledger("events", "--json", "--state-dir", str(state)).stdout
    assert len(before.splitlines()) == 7

    damage(path)
    assert_points_to_restore(gpuledger("events", "--state-dir", str(state)), state)
    assert_points_to_restore(gpuledger("audit", "verify", "--state-dir", str(state)), state)

    both = gpuledger("log", "restore", "--state-dir", str(state), "--from", str(FIXTURE), "--nats-url", "nats://x:1")
    assert both.returncode == 2 and "not both" in both.stderr
    wrong = gpuledger("log", "restore", "--state-dir", str(state), "--nats-url", nats_server.url, "--node-name", "x")
    assert wrong.returncode == 1 and f"{settings.node_name!r}" in wrong.stderr and "'x'" in wrong.stderr

    run = gpuledger("log", "restore", "--state-dir", str(state), "--nats-url", nats_server.url,
                    "--node-name", settings.node_name)
    assert run.returncode == 0, run.stderr
    assert "restored 7 events (seq 1..7)" in run.stdout
    if "snapshot" in run.stdout:  # the allocator left a fold snapshot recording the hash at its seq
        assert "matches" in run.stdout, run.stdout
    assert gpuledger("events", "--json", "--state-dir", str(state)).stdout == before  # ids, times, data
    assert gpuledger("audit", "verify", "--state-dir", str(state)).returncode == 0
    assert list(state.glob("ledger.sqlite.damaged-*")), "the damaged file is kept"


def test_a_truncated_log_is_restored_from_a_backup(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    path = state / "ledger.sqlite"
    shutil.copy(FIXTURE, path)
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size // 3)
    run = gpuledger("replay", "--state-dir", str(state))
    assert run.returncode == 1 and "gpuledger log restore" in run.stderr, run.stderr

    broken = tmp_path / "broken.sqlite"
    shutil.copy(path, broken)
    refused = gpuledger("log", "restore", "--state-dir", str(state), "--from", str(broken))
    assert refused.returncode == 1 and "broken.sqlite" in refused.stderr

    run = gpuledger("log", "restore", "--state-dir", str(state), "--from", str(FIXTURE))
    assert run.returncode == 0, run.stderr
    assert "restored 6 events (seq 1..6) from the backup" in run.stdout
    assert gpuledger("audit", "verify", "--state-dir", str(state)).returncode == 0
    expected = gpuledger("events", "--json", "--state-dir", str(FIXTURE.parent / "nothing"))
    assert expected.returncode == 1
    assert len(gpuledger("events", "--json", "--state-dir", str(state)).stdout.splitlines()) == 6
