"""The tests' throw-away PostgreSQL server dies with the process that started it, however that process
ends: a benchmark or test run killed by a timeout must not leave a postmaster running."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from pathlib import Path

from tests.polling import eventually

REPO = Path(__file__).resolve().parents[2]

# Starts the server, prints its temp dir and the postmaster's pid, then waits to be killed.
_HOLDER = """
import asyncio, sys
from pathlib import Path
from tests.fleet.helpers import PostgresServer

async def main() -> None:
    server = PostgresServer(Path(sys.argv[1]))
    await server.start()
    print(server.root, server._proc.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _shared_memory_id(data: Path) -> int | None:
    """The System V segment a running postmaster records in its pid file (line 7: key, then id); a
    postmaster that is killed leaves it behind, so the test removes it."""
    try:
        return int((data / "postmaster.pid").read_text().splitlines()[6].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _processes_under(root: Path) -> list[int]:
    """Processes whose command line names ``root`` (the postmaster and its children name its data dir)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if str(root).encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return [pid for pid in found if _running(pid)]


async def test_the_server_dies_with_a_killed_parent(postgres_bin: Path) -> None:
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLDER, str(postgres_bin), cwd=REPO, stdout=asyncio.subprocess.PIPE)
    root: Path | None = None
    segment: int | None = None
    try:
        assert holder.stdout is not None
        line = (await asyncio.wait_for(holder.stdout.readline(), 60)).decode().split()
        assert len(line) == 2, f"the holder did not start a server: {line!r}"
        root, postmaster = Path(line[0]), int(line[1])
        assert _running(postmaster)
        segment = await _recorded_segment(root / "data")
        assert segment is not None, "no shared memory segment in postmaster.pid (removed after the kill)"
        assert postmaster in _processes_under(root)

        holder.kill()  # no cleanup of its own runs
        await holder.wait()
        await eventually(lambda: not _processes_under(root), timeout=15, interval=0.1,
                         what="the postmaster and its children gone after their parent's SIGKILL")
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()
        if root is not None:
            for pid in _processes_under(root):  # only when the assertion above failed
                os.kill(pid, signal.SIGKILL)
            if segment is not None:
                ipcrm = await asyncio.create_subprocess_exec(
                    "ipcrm", "-m", str(segment), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
                await ipcrm.wait()
            shutil.rmtree(root, ignore_errors=True)


async def _recorded_segment(data: Path) -> int | None:
    """The postmaster writes its segment's line once it is ready; a few tries while it is not yet."""
    for _ in range(50):
        if (segment := _shared_memory_id(data)) is not None:
            return segment
        await asyncio.sleep(0.1)
    return None
