"""Walkthrough: the agent's four services are SIGKILLed while GPU containers run, and the launcher
restarts them. The running containers keep their devices and files, and a new registration from
inside a container works against the restarted vmanager."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from tests.runtime.helpers import RtNode, gpu_container, pod

pytestmark = pytest.mark.slow


async def test_services_killed_and_restarted_while_containers_run(rt_node_processes: RtNode) -> None:
    node = rt_node_processes
    share = await node.run_pod(pod("share", gpu_container("cuda", cores=40, memory=2)))
    whole = await node.run_pod(pod("whole", gpu_container("cuda", cores=100)))
    assert share["status"]["phase"] == whole["status"]["phase"] == "Running"
    assert (await node.register("share", "cuda"))[0] == 0
    # The vmanager process got containerd's socket (--container-runtime-endpoint) and named the container there.
    bound = [json.loads(line) for line in (node.launcher.log_dir / "vmanager.log").read_text().splitlines()
             if '"container bound"' in line]
    assert [b["via"] for b in bound] == ["runtime"], bound
    before = await node.read_vcuda_config("share", "cuda")
    _, devices_before = await node.sh("whole", "cuda", "ls /dev | grep nvidia")

    assert node.launcher is not None
    old = {c.name: c.proc.pid for c in node.launcher.children if c.name != "nats"}
    for pid in old.values():
        os.kill(pid, signal.SIGKILL)
    async with asyncio.timeout(60):  # the launcher brings each back
        while any(c.proc.pid == old.get(c.name) or c.proc.returncode is not None  # noqa: ASYNC110
                  for c in node.launcher.children if c.name in old):
            await asyncio.sleep(0.2)

    # The containers never noticed: same devices, same files.
    _, devices_after = await node.sh("whole", "cuda", "ls /dev | grep nvidia")
    assert devices_after == devices_before
    assert await node.read_vcuda_config("share", "cuda") == before
    # A new registration from inside works once the vmanager serves the pod's socket again.
    async with asyncio.timeout(30):
        while (result := await node.register("share", "cuda"))[0] != 0:  # noqa: ASYNC110 (a retry)
            await asyncio.sleep(0.3)
    assert result[1].strip() == "registered"
    assert await node.read_vcuda_config("share", "cuda") == before
