"""Disk faults: a full state dir fails Allocate with a clear "no space" error and leaves nothing torn; a
read-only state dir and a second allocator on the same log are refused at start with one line each.

The full and read-only cases mount a small tmpfs, which needs root (CI and the dev machines are root).
Without root they are skipped, unless GPULEDGER_REQUIRE_ROOT_TESTS=1, which makes that a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.errors import NoSpace, StartRefused
from libs.events.schema import AllocationReleased
from libs.store import EventLog
from libs.store.log import writer_lock
from libs.store.verify import verify_log
from tests.builders import gpu_pod, settings_for
from tests.e2e.helpers import start_in_process
from tests.root import cannot, require_root


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` for the block; always unmounted after."""
    require_root("mounting a tmpfs")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        cannot(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(directory: Path) -> Path:
    """Take every free byte of the file system holding ``directory``; the filler file."""
    filler = directory / "filler"
    block = b"\0" * 65536
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        with contextlib.suppress(OSError):  # the last few bytes, smaller than a block
            while True:
                f.write(b"\0" * 512)
    return filler


def ev(i: int) -> AllocationReleased:
    return AllocationReleased(alloc_id=f"a{i}" * 40, pod_uid=f"p{i}", container="c", reason="deleted " * 50)


def rows(path: Path) -> int:
    return verify_log(path).events


@pytest.mark.parametrize("inline", [False, True], ids=["writer-thread", "inline"])
async def test_a_full_disk_fails_the_append_whole_and_the_next_one_works(short_dir: Path, inline: bool) -> None:
    with tmpfs(short_dir / "state", "1m") as state:
        path = state / "ledger.sqlite"
        event_log = await EventLog.open(path, inline=inline)
        try:
            for i in range(5):
                await event_log.append([ev(i)])
            filler = fill(state)
            with pytest.raises(NoSpace, match="no space left on the device"):
                for i in range(5, 400):  # the WAL may still have room for a few: write until it has none
                    await event_log.append([ev(i), ev(i + 1000)])
            before = event_log.last_seq
            report = verify_log(path)
            assert report.ok, report.problem
            assert report.events == before  # nothing torn: every committed request whole, nothing else
            filler.unlink()
            stored = await event_log.append([ev(9999)])
            assert stored[0].seq == before + 1
        finally:
            await event_log.close()
        report = verify_log(path)
        assert report.ok and report.last_seq == before + 1, report


async def test_a_full_state_dir_fails_allocate_and_heals_with_space(nats_server, short_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """Through the simulated kubelet: refused "no space" while full, admitted when space is back, and
    `gpuledger audit verify` passes."""
    with tmpfs(short_dir / "state", "1m") as state:
        settings = settings_for(short_dir, nats_server.url)
        async with contextlib.AsyncExitStack() as stack:
            node = await start_in_process(stack, short_dir, nats_server.url, settings)
            pod = await node.run_pod(gpu_pod("before", ("c", 20, 1)))
            assert pod["status"]["phase"] == "Running", pod["status"]
            filler = fill(state)
            failed = None
            for i in range(20):  # the WAL may hold one more grant: the disk is full when it does not
                pod = await node.run_pod(gpu_pod(f"full-{i}", ("c", 5, 1)))
                if pod["status"]["phase"] == "Failed":
                    failed = pod
                    break
            assert failed is not None, "every Allocate succeeded on a full disk"
            assert "no space left on the device" in failed["status"]["message"], failed["status"]
            filler.unlink()
            pod = await node.run_pod(gpu_pod("after", ("c", 20, 1)))
            assert pod["status"]["phase"] == "Running", pod["status"]
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "gpuledger", "audit", "verify", "--state-dir", str(state)],
            capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "intact" in done.stdout, done.stdout + done.stderr


def run_allocator(state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuledger", "run", "allocator", "--state-dir", str(state), "--gpus", "fake",
         "--node-name", "n1", "--nats-url", "nats://127.0.0.1:1", "--log-format", "console"],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


async def test_a_read_only_state_dir_is_refused_at_start(short_dir: Path) -> None:
    with tmpfs(short_dir / "state", "4m") as state:
        event_log = await EventLog.open(state / "ledger.sqlite")
        await event_log.append([ev(1)])
        await event_log.close()
        await asyncio.to_thread(subprocess.run, ["mount", "-o", "remount,ro", str(state)], check=True, timeout=30)
        with pytest.raises(StartRefused, match="read-only"):
            await EventLog.open(state / "ledger.sqlite")
        done = await asyncio.to_thread(run_allocator, state)
        assert done.returncode == 2
        line = one_line(done)
        assert "refused to start" in line and f"the state dir {state} is read-only" in line, line


async def test_a_second_allocator_on_the_same_log_is_refused_at_start(short_dir: Path) -> None:
    state = short_dir / "state"
    event_log = await EventLog.open(state / "ledger.sqlite")
    try:
        with pytest.raises(StartRefused, match="another process is writing"):
            writer_lock(state / "ledger.sqlite")
        done = await asyncio.to_thread(run_allocator, state)
        assert done.returncode == 2
        line = one_line(done)
        assert "refused to start" in line and "another process is writing" in line, line
    finally:
        await event_log.close()
    assert rows(state / "ledger.sqlite") == 0
