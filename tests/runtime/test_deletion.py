"""Walkthrough: GPU pods deleted while their containers run. The kubelet stops and removes the
containers and the sandbox, the pod cgroups go, the shares are recycled, and the vmanager removes
the pod's vcuda.sock directory (no mount of it is left busy)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.runtime.helpers import RtNode, gpu_container, pod, pod_cgroup_dirs


def _named_for_removal(node: RtNode, uid: str) -> bool:
    """The pod's cgroup parent is in the run's record of what it made outside its temp dir."""
    return any(parent.endswith(f"/pod{uid}") for parent in node.sim.runtime.containerd.leftovers.cgroup_parents)


async def _deleted_cleanly(node: RtNode, name: str, uid: str) -> None:
    sandbox = node.sim.runtime.pods.sandbox_id(uid)
    assert sandbox
    assert _named_for_removal(node, uid)
    await node.sim.delete_pod("default", name)
    assert node.sim.get_pod("default", name) is None
    assert await node.client.list_containers(sandbox) == []  # stopped and removed
    assert all(s.id != sandbox for s in await node.client.list_pod_sandboxes())
    assert pod_cgroup_dirs(uid) == []
    # and no longer named among what the run must remove at its end (a long run's record stays short)
    assert not _named_for_removal(node, uid)
    await node.wait_no_allocations()
    pod_dir = Path(node.settings.vm_root) / uid
    async with asyncio.timeout(20):
        while pod_dir.exists():  # noqa: ASYNC110 (removed by the vmanager: poll it)
            await asyncio.sleep(0.1)
    assert str(pod_dir) not in Path("/proc/self/mountinfo").read_text()


async def test_two_container_pod_deleted_while_running(rt_node: RtNode) -> None:
    node = rt_node
    running = await node.run_pod(pod("pair", gpu_container("a", cores=30, memory=2),
                                     gpu_container("b", cores=100)))
    assert running["status"]["phase"] == "Running", running["status"]
    assert len(await node.allocations()) == 2
    code, out = await node.register("pair", "a")
    assert code == 0, out
    await _deleted_cleanly(node, "pair", running["metadata"]["uid"])

    # The shares are back: a pod asking for every GPU fits.
    again = await node.run_pod(pod("all", gpu_container("cuda", cores=400)))
    assert again["status"]["phase"] == "Running", again["status"]


async def test_pod_with_an_init_container_deleted_while_running(rt_node: RtNode) -> None:
    node = rt_node
    manifest = pod("with-init", gpu_container("app", cores=20, memory=1),
                   init=(gpu_container("warmup", cores=20, memory=1, command="ls /etc/vcuda/vcuda.sock"),))
    running = await node.run_pod(manifest)
    assert running["status"]["phase"] == "Running", running["status"]
    init = running["status"]["initContainerStatuses"][0]["state"]["terminated"]
    assert (init["exitCode"], init["reason"]) == (0, "Completed")  # it really ran, and saw its socket
    code, out = await node.register("with-init", "app")
    assert code == 0, out
    await _deleted_cleanly(node, "with-init", running["metadata"]["uid"])
