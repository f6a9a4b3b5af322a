"""Garbage collection across a vmanager restart, with the services as separate processes."""

from __future__ import annotations

import array
import asyncio
import os
import signal
import uuid
from pathlib import Path

import pytest

from libs.commands import PrepareReply, PrepareRequest
from libs.errors import BusError, RemoteError
from libs.vcuda.client import register_vdevice
from tests.e2e.conftest import Node, gpu_pod


async def _vmanager_answers(node: Node, timeout: float = 60) -> None:
    """The vmanager process is up (slow to start on a loaded machine): prepare answers, here with a 404."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                await node.bus.request(node.bus.subjects.prepare, PrepareRequest(pod_uid=str(uuid.uuid4())),
                                       PrepareReply, timeout=2)
            except RemoteError as exc:
                if exc.code == 404:
                    return
            except BusError:
                pass
            await asyncio.sleep(0.2)


async def _gone(path: Path, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while path.exists():  # noqa: ASYNC110 (another process removes it)
            await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_nothing_left_when_a_pod_is_deleted_while_the_vmanager_is_down(node_processes: Node) -> None:
    node = node_processes
    assert node.launcher is not None
    vm = node.settings.vm_root
    await _vmanager_answers(node)
    pod = await node.run_pod(gpu_pod("job", ("c", 50, 2)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    uid = pod["metadata"]["uid"]
    cid = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    pids = node.enter_container(uid, cid)
    await register_vdevice(str(vm / uid / "vcuda.sock"), pod_uid=uid, container_id=cid, timeout=10)
    assert list(array.array("i", (vm / uid / cid / "pids.config").read_bytes())) == pids

    vmanager = next(c for c in node.launcher.children if c.name == "vmanager")
    assert vmanager.proc is not None
    old_pid = vmanager.proc.pid
    os.kill(old_pid, signal.SIGSTOP)  # frozen: it cannot see the release
    try:
        await node.sim.delete_pod("default", "job")
        await node.tap.wait("alloc.released", 1, timeout=20)
        assert (vm / uid / cid / "vcuda.config").exists()  # nobody collected it yet
    finally:
        os.kill(old_pid, signal.SIGKILL)
        os.kill(old_pid, signal.SIGCONT)
    await _gone(vm / uid, timeout=45)  # the restarted vmanager replays the log and collects it
    assert vmanager.proc.pid != old_pid
    assert os.listdir(vm) == []
