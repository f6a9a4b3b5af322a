"""The cleaner of a throw-away PostgreSQL server's temp dir (``PostgresServer`` in tests/fleet/helpers.py):
``python -m tests.fleet.pg_cleaner DIR``, started with the dir and ended with
``simulator.runtime.leftovers.stop_reaper`` after a clean stop.

It waits for end of file on its stdin: "done" (the server was stopped and its dir removed) or nothing
(its parent died, however it died, SIGKILL included). In the second case, once the postmaster named
in the pid file is gone (killed by its parent-death signal), it removes the System V segment a
killed postmaster leaves, and the dir.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from libs.lifeline import process_alive


def _pid_file(data: Path) -> list[str]:
    try:
        return (data / "postmaster.pid").read_text().splitlines()
    except OSError:
        return []


def shared_memory_id(data: Path) -> int | None:
    """The System V segment a running postmaster records in its pid file (line 7: key, then id)."""
    try:
        return int(_pid_file(data)[6].split()[1])
    except (IndexError, ValueError):
        return None


def clean(root: Path, *, wait: float = 10.0) -> None:
    lines = _pid_file(root / "data")
    if lines and lines[0].isdigit():
        deadline = time.monotonic() + wait
        while process_alive(int(lines[0])) and time.monotonic() < deadline:
            time.sleep(0.05)
        if (segment := shared_memory_id(root / "data")) is not None:
            subprocess.run(["ipcrm", "-m", str(segment)], capture_output=True, timeout=10)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.stdin.buffer.read() != b"done":  # blocks until the parent closes the pipe or dies
        clean(Path(sys.argv[1]))
