"""The commands a user runs: the demo from the README, then reading its log back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import Node

pytestmark = pytest.mark.slow


def gpuledger(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuledger", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_up_demo_then_events_and_replay(short_dir: Path) -> None:
    run = gpuledger("up", "--demo-exit", "--state-dir", str(short_dir / "s"), timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Demo complete." in run.stdout
    assert "removed: True" in run.stdout

    demo = short_dir / "s" / "demo"
    lines = gpuledger("events", "--json", "--state-dir", str(demo)).stdout.splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["type"] for r in records] == ["inventory.recorded", "alloc.granted", "alloc.granted",
                                            "alloc.released", "alloc.released", "alloc.granted"]
    assert [r["seq"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert {"seq", "time", "type", "data"} <= set(records[0])

    now = json.loads(gpuledger("replay", "--json", "--state-dir", str(demo)).stdout)
    assert [(a["pod_name"], a["container"]) for a in now["allocations"]] == [("demo-next", "notebook")]
    then = json.loads(gpuledger("replay", "--json", "--seq", "3", "--state-dir", str(demo)).stdout)
    assert [a["container"] for a in then["allocations"]] == ["trainer", "evaluator"]
    at = gpuledger("replay", "--at", records[3]["time"], "--state-dir", str(demo))
    assert "state at seq 4" in at.stdout and "evaluator" in at.stdout and "trainer" not in at.stdout

    table = gpuledger("events", "--state-dir", str(demo)).stdout
    assert "alloc.released" in table and "reason=deleted" in table


def test_reading_a_missing_log_is_a_clear_error(short_dir: Path) -> None:
    run = gpuledger("events", "--state-dir", str(short_dir / "nothing"))
    assert run.returncode == 1
    assert "no event log at" in run.stderr
    run = gpuledger("replay", "--at", "yesterday", "--state-dir", str(short_dir / "nothing"))
    assert run.returncode == 1 and "not a time" in run.stderr


async def test_every_service_stops_cleanly_on_sigterm(node_processes: Node) -> None:
    assert node_processes.launcher is not None
    await node_processes.launcher.stop()
    codes = {c.name: c.proc.returncode for c in node_processes.launcher.children if c.proc}
    assert codes == {"allocator": 0, "watchdog": 0, "vmanager": 0, "registrar": 0}


async def test_events_follow_prints_new_events_as_they_commit(short_dir: Path) -> None:
    import asyncio

    from libs.events.schema import AllocationReleased
    from libs.store import EventLog

    state = short_dir / "state"
    event_log = await EventLog.open(state / "ledger.sqlite")
    proc = None
    try:
        await event_log.append([AllocationReleased(alloc_id="a1", pod_uid="p", container="c", reason="deleted")])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpuledger", "events", "--follow", "--json", "--state-dir", str(state),
            stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
        assert proc.stdout is not None
        first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 10))
        assert (first["seq"], first["data"]["alloc_id"]) == (1, "a1")
        await event_log.append([AllocationReleased(alloc_id="a2", pod_uid="p", container="c", reason="deleted")])
        second = json.loads(await asyncio.wait_for(proc.stdout.readline(), 5))
        assert (second["seq"], second["data"]["alloc_id"]) == (2, "a2")
    finally:
        if proc is not None and proc.returncode is None:
            proc.terminate()
            await proc.wait()
        await event_log.close()
