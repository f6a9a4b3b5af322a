"""Agent commands run as their own processes (`python -m gpuledger ...`): start one, read its output
until a line, stop it with a signal within a bound; and the processes still running that name a path
(what a test must not leave behind)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from pathlib import Path

import pytest

__all__ = ["STOP_TIMEOUT", "free_port", "processes_mentioning", "start", "stop", "wait_line"]

# Generous: the machine may be loaded. The promptness itself (~2 s) is shown by the measured time
# in the assertion message, not asserted tightly.
STOP_TIMEOUT = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def processes_mentioning(text: str) -> list[str]:
    """``"pid: command line"`` of every other process whose command line holds ``text`` (a zombie's is
    empty: it is not counted)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if text in cmd and int(pid) != os.getpid():
                found.append(f"{pid}: {cmd[:160]}")
    return found


async def start(args: list[str], state: Path) -> asyncio.subprocess.Process:
    # Metrics off: fixed ports would collide with any other agent on the machine; these tests are about
    # starting and stopping.
    env = {**os.environ, "GPULEDGER_METRICS_PORT": "0", "GPULEDGER_LOG_FORMAT": "json",
           "GPULEDGER_STATE_DIR": str(state), "GPULEDGER_NODE_NAME": "node-a"}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpuledger", *args, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)


async def wait_line(proc: asyncio.subprocess.Process, needle: str, timeout: float = 60) -> list[str]:
    """Read output lines until one contains ``needle``; returns the lines read."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} in output within {timeout}s: {lines[-20:]}"
        raw = await asyncio.wait_for(proc.stdout.readline(), left)
        assert raw, f"process ended (rc={await proc.wait()}) before {needle!r}: {lines[-20:]}"
        lines.append(raw.decode(errors="replace").rstrip())
        if needle in lines[-1]:
            return lines


async def stop(proc: asyncio.subprocess.Process, sig: int) -> tuple[int, float]:
    """Send ``sig``; the exit code and how long the exit took. Kills (and fails) past STOP_TIMEOUT."""
    assert proc.stdout is not None
    drain = asyncio.create_task(proc.stdout.read())  # keep the pipe empty while it stops
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        rc = await asyncio.wait_for(proc.wait(), STOP_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"did not stop within {STOP_TIMEOUT}s of signal {sig}")
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(drain, 5)
    return rc, time.monotonic() - t0
