"""Nothing a real-runtime run makes outside its temp dir survives it, even when the process running
it is SIGKILLed mid-run: no containerd, shim or pause process, no mount, no pod cgroup, no fake
/dev/nvidia* node (the reaper started with the run removes them)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from simulator.runtime import Containerd, hostlock
from simulator.runtime.leftovers import RUN_CONTAINERD
from tests.processes import processes_mentioning
from tests.runtime.helpers import mounts_under, pod_cgroup_dirs

REPO = Path(__file__).resolve().parents[2]


async def test_a_killed_run_leaves_nothing_behind(runtime_images: Path, short_dir: Path) -> None:
    had_run_containerd = RUN_CONTAINERD.exists()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.runtime.killed_run", str(short_dir), str(runtime_images),
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            while not (line := (await proc.stdout.readline()).decode()).startswith("ready"):
                assert line, "the run exited before its pod was running"
        _, uid, node = line.split()
        # While it runs, all of it is there: processes, the rootfs mount, the pod cgroup, the node.
        assert any("containerd-shim" in p for p in processes_mentioning(str(short_dir / "rt")))
        assert mounts_under(str(short_dir / "rt"))
        assert pod_cgroup_dirs(uid)
        assert os.path.exists(node)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()

    deadline = time.monotonic() + 30
    while True:
        left = processes_mentioning(str(short_dir / "rt")) + mounts_under(str(short_dir)) + pod_cgroup_dirs(uid)
        left += [node] if os.path.lexists(node) else []
        left += [str(RUN_CONTAINERD)] if RUN_CONTAINERD.exists() and not had_run_containerd else []
        if not left or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert left == []


def test_a_start_that_fails_lets_go_of_the_host(runtime_images: Path, short_dir: Path) -> None:
    """containerd's start fails early (its work dir cannot be made): nothing runs, and the host's
    real-runtime lock (simulator/runtime/hostlock.py) is free for the next run."""
    work = short_dir / "work"
    work.write_text("a file where the work dir should be")
    with pytest.raises(OSError):
        Containerd(work).start()
    assert hostlock.holder_pid() is None
