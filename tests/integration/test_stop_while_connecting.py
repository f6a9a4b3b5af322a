"""A service (and `gpuledger up`) whose NATS is not there yet keeps trying, starts when the broker
comes up, and stops on SIGTERM/SIGINT at any point, also while it is still connecting.

Real processes (`python -m gpuledger ...`) and a real nats-server from the wheel.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from libs.bus import NatsServer

pytestmark = pytest.mark.slow

# Generous: the machine may be loaded. The promptness itself (~2 s) is shown by the measured time
# in the assertion message, not asserted tightly.
STOP_TIMEOUT = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start(args: list[str], state: Path) -> asyncio.subprocess.Process:
    env = {**os.environ, "GPULEDGER_LOG_FORMAT": "json", "GPULEDGER_STATE_DIR": str(state),
           "GPULEDGER_NODE_NAME": "node-a"}
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


@pytest.fixture
async def procs():
    started: list[asyncio.subprocess.Process] = []
    yield started
    for p in started:
        if p.returncode is None:
            p.kill()
            await p.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_service_stops_while_nats_is_unreachable(short_dir: Path, procs, sig: int) -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    proc = await start(["run", "allocator", "--nats-url", url, "--gpus", "fake"], short_dir / "state")
    procs.append(proc)
    # Two failed attempts logged: it is inside the retry loop, not just starting.
    await wait_line(proc, "nats error")
    await wait_line(proc, "nats error")
    rc, took = await stop(proc, sig)
    assert rc == 0, f"exit code {rc} after {took:.2f}s"


async def test_service_started_before_the_broker_starts_when_it_comes_up(short_dir: Path, procs) -> None:
    port = free_port()
    proc = await start(["run", "allocator", "--nats-url", f"nats://127.0.0.1:{port}", "--gpus", "fake"],
                       short_dir / "state")
    procs.append(proc)
    await wait_line(proc, "nats error")
    server = NatsServer(short_dir / "nats", port=port)
    await server.start()
    try:
        await wait_line(proc, "service started")
        rc, took = await stop(proc, signal.SIGTERM)
        assert rc == 0, f"exit code {rc} after {took:.2f}s"
    finally:
        await server.stop()


async def test_up_stops_while_nats_is_unreachable(short_dir: Path, procs) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    proc = await start(["up", "--nats-url", url, "--gpus", "fake"], short_dir / "state")
    procs.append(proc)
    await wait_line(proc, "nats error")  # a child is retrying (children share up's stdout)
    rc, took = await stop(proc, signal.SIGTERM)
    assert rc == 0, f"exit code {rc} after {took:.2f}s"
