"""Garbage collection across a vmanager restart, with the services as separate processes."""

from __future__ import annotations

import array
import os
import signal
import uuid

import pytest

from libs.commands import PrepareReply, PrepareRequest
from libs.errors import BusError, RemoteError
from libs.vcuda.client import register_vdevice
from tests.builders import gpu_pod
from tests.e2e.helpers import Node
from tests.polling import eventually


async def _vmanager_answers(node: Node) -> bool:
    """The vmanager process is up (slow to start on a loaded machine): prepare answers, here with a 404."""
    try:
        await node.bus.request(node.bus.subjects.prepare, PrepareRequest(pod_uid=str(uuid.uuid4())),
                               PrepareReply, timeout=2)
    except RemoteError as exc:
        return exc.code == 404
    except BusError:
        pass
    return False


@pytest.mark.slow
async def test_nothing_left_when_a_pod_is_deleted_while_the_vmanager_is_down(node_processes: Node) -> None:
    node = node_processes
    assert node.launcher is not None
    vm = node.settings.vm_root
    await eventually(lambda: _vmanager_answers(node), timeout=60, interval=0.2, what="the vmanager answering")
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
        os.kill(old_pid, signal.SIGKILL)  # works on a stopped process; the launcher may reap it at once
    # The restarted vmanager replays the log and collects it (another process removes it).
    await eventually(lambda: not (vm / uid).exists(), timeout=45, interval=0.1, what=f"{vm / uid} removed")
    assert vmanager.proc.pid != old_pid
    assert os.listdir(vm) == []
