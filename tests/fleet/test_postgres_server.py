"""The tests' throw-away PostgreSQL server dies with the process that started it, however that process
ends: a benchmark or test run killed by a timeout must not leave a postmaster running, nor its temp
dir, nor the System V shared memory a killed postmaster leaves."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from libs.lifeline import process_alive
from tests.fleet.pg_cleaner import clean, shared_memory_id
from tests.polling import eventually
from tests.processes import processes_mentioning

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


def _shared_memory_ids() -> set[int]:
    """The System V shared memory segments that exist now."""
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return {int(line.split()[1]) for line in lines if line.strip()}


async def test_the_server_dies_with_a_killed_parent(postgres_bin: Path) -> None:
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLDER, str(postgres_bin), cwd=REPO, stdout=asyncio.subprocess.PIPE)
    root: Path | None = None
    postmaster = 0
    segment: int | None = None
    try:
        assert holder.stdout is not None
        line = (await asyncio.wait_for(holder.stdout.readline(), 60)).decode().split()
        assert len(line) == 2, f"the holder did not start a server: {line!r}"
        root, postmaster = Path(line[0]), int(line[1])
        assert process_alive(postmaster)
        # written once the postmaster is ready
        await eventually(lambda: shared_memory_id(root / "data") is not None, timeout=5, interval=0.1,
                         what="the shared memory segment in postmaster.pid (removed after the kill)")
        segment = shared_memory_id(root / "data")
        assert any(p.startswith(f"{postmaster}:") for p in processes_mentioning(str(root)))

        holder.kill()  # no cleanup of its own runs
        await holder.wait()
        await eventually(lambda: not processes_mentioning(str(root)), timeout=15, interval=0.1,
                         what="the postmaster and its children gone after their parent's SIGKILL")
        await eventually(lambda: not root.exists() and segment not in _shared_memory_ids(), timeout=15,
                         interval=0.1, what="the server's temp dir and shared memory removed by its cleaner")
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()
        if root is not None:  # only when an assertion above failed
            if process_alive(postmaster):  # its children follow
                os.kill(postmaster, signal.SIGKILL)
            await asyncio.to_thread(clean, root)  # the segment and the dir, as the cleaner would

