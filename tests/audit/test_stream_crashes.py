"""Kill the allocator and the broker mid-stream: every committed event reaches the stream once, and
followers (a library follower and `gpuledger events --follow --nats-url`) see each one exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import sys
from typing import Any

import pytest

from libs.bus import LogFollower, NatsServer
from tests.builders import NODE, gpu_pod
from tests.e2e.helpers import Node, snapshot_when_back
from tests.polling import eventually

pytestmark = pytest.mark.slow

# One reconciliation period of the watchdog process (Settings.allocation_check_period) plus slack for a
# loaded machine.
RECONCILE_WAIT = 75.0


def start_failed(pod: dict) -> bool:
    """A container that could not start yet: its PreStartContainer met the dead allocator. The simulated
    kubelet tries again with backoff; a failed first start is already an outcome of the crash."""
    return any((c.get("state") or {}).get("waiting", {}).get("reason") == "CreateContainerConfigError"
               for c in pod["status"].get("containerStatuses") or [])


async def settled(node: Node, manifest: dict, timeout: float) -> dict:
    """Create a pod and wait until its admission has an outcome: Running, Failed, or a failed start.

    Which one depends on when the allocator dies (during Allocate, between Allocate and
    PreStartContainer, or after): all three are valid here."""
    created = await node.sim.create_pod(manifest)
    ns, name = created["metadata"]["namespace"], created["metadata"]["name"]
    return await node.sim.wait_for_pod(
        ns, name, lambda p: p["status"].get("phase") in ("Running", "Failed") or start_failed(p), timeout)


async def run_until_running(node: Node, name: str, attempts: int = 5) -> None:
    """Services reconnect after the broker restart; a pod admitted too early fails, so try a few."""
    for i in range(attempts):
        pod = await node.run_pod(gpu_pod(f"{name}-{i}", ("c", 20, 1)), timeout=40)
        if pod["status"]["phase"] == "Running":
            return
        await asyncio.sleep(1)
    raise AssertionError(f"no pod ran after {attempts} attempts")


async def released(node: Node, pod_name: str, timeout: float = 30) -> None:
    """Until the allocator's state no longer holds the pod (its release is committed)."""

    async def gone() -> bool:
        return not any(a.pod_name == pod_name for a in (await node.snapshot()).allocations)

    await eventually(gone, timeout=timeout, interval=0.2, what=f"{pod_name} released")


def log_rows(node: Node) -> list[tuple[int, str]]:
    conn = sqlite3.connect(f"file:{node.settings.log_path}?mode=ro", uri=True)
    try:
        return [(seq, eid.hex()) for seq, eid in conn.execute("SELECT seq, event_id FROM events ORDER BY seq")]
    finally:
        conn.close()


def event_types(node: Node) -> list[str]:
    conn = sqlite3.connect(f"file:{node.settings.log_path}?mode=ro", uri=True)
    try:
        return [t for (t,) in conn.execute("SELECT type FROM events ORDER BY seq")]
    finally:
        conn.close()


async def test_allocator_and_broker_killed_mid_stream(node_processes: Node, nats_server: NatsServer) -> None:
    node = node_processes
    assert node.launcher is not None
    seen: list[int] = []
    follower = LogFollower(node.bus, lambda e: seen.append(e.seq))
    follow_task = asyncio.create_task(follower.run())
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpuledger", "events", "--follow", "--json", "--nats-url", nats_server.url,
        "--node-name", NODE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        stdin=asyncio.subprocess.DEVNULL)
    try:
        for i in range(3):
            pod = await node.run_pod(gpu_pod(f"before-{i}", ("c", 20, 1)))
            assert pod["status"]["phase"] == "Running", pod["status"]

        # The allocator dies while a pod is being admitted and released pods are being recorded.
        allocator = next(c for c in node.launcher.children if c.name == "allocator")
        admitting = asyncio.create_task(settled(node, gpu_pod("during", ("c", 20, 1)), timeout=40))
        await node.sim.delete_pod("default", "before-0")
        await asyncio.sleep(0.05)
        os.kill(allocator.proc.pid, signal.SIGKILL)
        await admitting  # Running, Failed or stuck at container start: either way the log says which
        await snapshot_when_back(node, timeout=40)

        # The broker dies right after more events were committed.
        await node.sim.delete_pod("default", "before-1")
        await nats_server.kill()
        await asyncio.sleep(1.0)
        await nats_server.start()  # same port, same JetStream store
        await snapshot_when_back(node, timeout=40)
        await run_until_running(node, "after")
        await node.sim.delete_pod("default", "before-2")
        await released(node, "before-2")
        # A release request that met the dead allocator or broker fails; the watchdog then leaves it to
        # its reconciliation, every allocation_check_period (30 s by default, what these processes run
        # with). So before-0 and before-1 may be released well after before-2: wait for them too.
        for name in ("before-0", "before-1"):
            await released(node, name, timeout=RECONCILE_WAIT)

        rows = log_rows(node)
        last = rows[-1][0]
        assert event_types(node).count("alloc.released") >= 3

        async def stream_caught_up() -> Any:
            info = await node.bus.js.stream_info(node.bus.subjects.stream)
            return info if info.state.last_seq >= last and log_rows(node)[-1][0] == info.state.last_seq else None

        info = await eventually(stream_caught_up, timeout=30, interval=0.2, what="the stream holding every row")
        rows = log_rows(node)
        last = rows[-1][0]
        assert info is not None and (info.state.messages, info.state.last_seq) == (last, last)
        stream = []
        for seq in range(1, last + 1):
            msg = await node.bus.js.get_msg(node.bus.subjects.stream, seq)
            stream.append((msg.seq, (msg.headers or {})["Gpuledger-Event-Id"]))
        assert stream == rows  # every committed event, once, in commit order, under its own seq

        await follower.wait_for(last, timeout=30)
        assert seen == list(range(1, last + 1))
        assert cli.stdout is not None
        printed = [json.loads(await asyncio.wait_for(cli.stdout.readline(), 30))["seq"] for _ in range(last)]
        assert printed == list(range(1, last + 1))
    finally:
        follow_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follow_task
        if cli.returncode is None:
            cli.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(cli.wait(), 10)
            except TimeoutError:
                cli.kill()
                await cli.wait()
