"""A run that is killed: the simulator on a real containerd with one running pod and a fake /dev
node, then it waits to be killed. Used by test_cleanup.py (``python -m tests.runtime.killed_run
ROOT IMAGES``); prints ``ready <pod uid>`` once the pod runs."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from simulator.runtime.fakegpus import fake_gpus_on_host
from tests.runtime.helpers import start_rt_sim


async def main(root: Path, images: Path) -> None:
    # Killed inside the block: its reaper removes the node, the kernel frees the host's lock.
    with fake_gpus_on_host(root, count=1) as gpus:
        sim = await start_rt_sim(root, images)
        created = await sim.create_pod({"metadata": {"name": "victim"}, "spec": {"containers": [
            {"name": "c", "image": "busybox", "command": ["/bin/sh", "-c", "sleep 3600"]}]}})
        await sim.wait_for_pod("default", "victim", lambda p: p["status"].get("phase") == "Running", 60)
        print("ready", created["metadata"]["uid"], gpus.node(0), flush=True)
        await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))
