"""A run that is killed: the simulator on a real containerd with one running pod and a fake /dev
node, then it waits to be killed. Used by test_cleanup.py (``python -m tests.runtime.killed_run
ROOT IMAGES``); prints ``ready <pod uid>`` once the pod runs."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from simulator.runtime import hostlock
from simulator.runtime.fakegpus import make_fake_gpus
from simulator.runtime.leftovers import Leftovers, start_reaper
from tests.runtime.helpers import start_rt_sim


async def main(root: Path, images: Path) -> None:
    hostlock.take()  # held until the kill: the kernel frees it
    lo = Leftovers(root / "devnodes.json", work="")
    lo.save()
    start_reaper(lo)
    gpus = make_fake_gpus(root, lo, count=1)
    sim = await start_rt_sim(root, images)
    created = await sim.create_pod({"metadata": {"name": "victim"}, "spec": {"containers": [
        {"name": "c", "image": "busybox", "command": ["/bin/sh", "-c", "sleep 3600"]}]}})
    await sim.wait_for_pod("default", "victim", lambda p: p["status"].get("phase") == "Running", 60)
    print("ready", created["metadata"]["uid"], gpus.node(0), flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))
