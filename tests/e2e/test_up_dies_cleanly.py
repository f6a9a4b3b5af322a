"""``gpuledger up`` dies cleanly (issue 13, item 7): a SIGKILL of ``up`` takes every child with it, the
broker included; SIGHUP (a closed terminal) stops it like Ctrl-C, without "unexpected EOF" noise; a
new ``up`` on the same state dir clears what an earlier one left, and refuses while that one runs.

Real processes: ``python -m gpuledger up`` with its embedded nats-server and fake GPUs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from gpuledger.launcher import BROKER, SERVICES, STATUS_FILE
from tests.processes import start, stop, wait_line

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def children_of(state: Path, timeout: float = 60) -> dict[str, int]:
    """The five children's pids, once ``up`` recorded all of them."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            recorded = json.loads((state / STATUS_FILE).read_text())["children"]
            pids = {name: c["pid"] for name, c in recorded.items()}
            if set(pids) == {BROKER, *SERVICES}:
                return pids
        except (OSError, ValueError, KeyError):
            pass
        assert time.monotonic() < deadline, f"up did not record its children within {timeout}s"
        await asyncio.sleep(0.2)


async def all_gone(pids: list[int], timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:  # noqa: ASYNC110 (other processes)
        await asyncio.sleep(0.1)
    return left


async def test_sigkill_of_up_takes_every_child_with_it(short_dir: Path, procs) -> None:
    state = short_dir / "state"
    proc = await start(["up", "--gpus", "fake"], state)
    procs.append(proc)
    pids = await children_of(state)
    assert all(alive(p) for p in pids.values())
    proc.kill()
    await proc.wait()
    assert await all_gone(list(pids.values())) == [], f"children outlived a SIGKILLed up: {pids}"


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
async def test_sighup_stops_up_like_ctrl_c_without_noise(short_dir: Path, procs, sig: int) -> None:
    state = short_dir / "state"
    proc = await start(["up", "--gpus", "fake"], state)
    procs.append(proc)
    await wait_line(proc, "agent running")
    pids = await children_of(state)
    assert proc.stdout is not None
    drain = asyncio.create_task(proc.stdout.read())
    proc.send_signal(sig)
    rc = await asyncio.wait_for(proc.wait(), 30)
    out = (await asyncio.wait_for(drain, 5)).decode(errors="replace")
    assert rc == 0, out[-3000:]
    assert await all_gone(list(pids.values())) == []
    assert "unexpected EOF" not in out, out[-3000:]
    assert "all stopped" in out
    assert not (state / STATUS_FILE).exists()


async def test_a_new_up_clears_stale_children_and_refuses_while_the_old_one_runs(
        short_dir: Path, procs) -> None:
    state = short_dir / "state"
    state.mkdir(parents=True)
    # What a killed up would leave where the parent-death signal could not act: a recorded child
    # still running (its own session), and the dead up's pid.
    stale = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(120)", start_new_session=True)
    dead = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await dead.wait()
    cmdline = [a.decode() for a in Path(f"/proc/{stale.pid}/cmdline").read_bytes().split(b"\0") if a]
    (state / STATUS_FILE).write_text(json.dumps(
        {"pid": dead.pid, "children": {"allocator": {"pid": stale.pid, "cmdline": cmdline}}}))
    try:
        first = await start(["up", "--gpus", "fake"], state)
        procs.append(first)
        await asyncio.wait_for(stale.wait(), 30)  # cleared
        lines = await wait_line(first, "agent running")
        assert any("clearing a child of an earlier gpuledger up" in line for line in lines)
        await children_of(state)

        second = await start(["up", "--gpus", "fake"], state)
        procs.append(second)
        assert second.stdout is not None
        out = (await asyncio.wait_for(second.stdout.read(), 60)).decode()
        assert await second.wait() == 1
        assert f"another gpuledger up (pid {first.pid}) runs on state dir" in out
        assert first.returncode is None  # the first one is untouched
        rc, _took = await stop(first, signal.SIGTERM)
        assert rc == 0
    finally:
        if stale.returncode is None:
            stale.kill()
            await stale.wait()
