"""A service (and `gpuledger up`) whose NATS is not there yet keeps trying, starts when the broker
comes up, and stops on SIGTERM/SIGINT at any point, also while it is still connecting.

Real processes (`python -m gpuledger ...`) and a real nats-server from the wheel.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from libs.bus import NatsServer
from tests.processes import free_port, start, stop, wait_line

pytestmark = pytest.mark.slow

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
