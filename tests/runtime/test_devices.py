"""Walkthrough: whole-GPU containers see exactly their /dev/nvidiaN nodes, and the device cgroup
refuses any other GPU (EPERM), not merely hides it; a device node missing on the host fails
CreateContainer, reported as the kubelet reports it."""

from __future__ import annotations

import os

from simulator.runtime.fakegpus import NVIDIA_MAJOR
from tests.runtime.helpers import RtNode, gpu_container, pod


async def _nvidia_nodes(node: RtNode, pod_name: str) -> list[str]:
    code, out = await node.sh(pod_name, "cuda", "ls /dev | grep '^nvidia' | sort")
    assert code == 0, out
    return out.split()


async def _open_minor(node: RtNode, pod_name: str, minor: int) -> str:
    """mknod a node for 195:minor inside the container and open it: the device cgroup decides."""
    _, out = await node.sh(pod_name, "cuda", f"mknod /tmp/gpu c {NVIDIA_MAJOR} {minor} && "
                                                f"cat /tmp/gpu; rm -f /tmp/gpu")
    return out


async def test_whole_gpu_containers_see_exactly_their_devices(rt_node: RtNode) -> None:
    node = rt_node
    minors = node.gpus.minors
    one = await node.run_pod(pod("one-gpu", gpu_container("cuda", cores=100)))
    two = await node.run_pod(pod("two-gpus", gpu_container("cuda", cores=200)))
    assert one["status"]["phase"] == two["status"]["phase"] == "Running", (one["status"], two["status"])

    # The response's device nodes, and nothing else, are in each container.
    opts_one = node.sim.container_run_options("default", "one-gpu", "cuda")
    opts_two = node.sim.container_run_options("default", "two-gpus", "cuda")
    gpus_one = sorted(d["container_path"] for d in opts_one["devices"] if d["container_path"][11:].isdigit())
    gpus_two = sorted(d["container_path"] for d in opts_two["devices"] if d["container_path"][11:].isdigit())
    assert len(gpus_one) == 1 and len(gpus_two) == 2 and not set(gpus_one) & set(gpus_two)
    for name, gpus in (("one-gpu", gpus_one), ("two-gpus", gpus_two)):
        assert await _nvidia_nodes(node, name) == sorted([*(g[5:] for g in gpus), "nvidia-uvm", "nvidiactl"])
        _, out = await node.sh(name, "cuda", f"stat -c '%t %T %a' {gpus[0]}")
        assert out.split()[0] == "c3" and out.split()[2] == "666", out  # major 195, mode from the host node

    # Its own GPU opens as far as a fake GPU can: the device cgroup lets it through to the kernel, which
    # finds no device (ENXIO; ENODEV where an NVIDIA driver owns major 195 but has no GPU at this minor).
    # Another is refused by the device cgroup (EPERM).
    own = int(gpus_one[0][11:])
    other = next(m for m in minors if f"/dev/nvidia{m}" not in gpus_one)
    assert _let_through(await _open_minor(node, "one-gpu", own))
    assert "Operation not permitted" in await _open_minor(node, "one-gpu", other)
    for minor in minors:
        verdict = await _open_minor(node, "two-gpus", minor)
        if f"/dev/nvidia{minor}" in gpus_two:
            assert _let_through(verdict), (minor, verdict)
        else:
            assert "Operation not permitted" in verdict, (minor, verdict)


def _let_through(verdict: str) -> bool:
    return "No such device or address" in verdict or verdict.rstrip().endswith("No such device")


async def test_a_missing_device_node_fails_create_container(rt_node: RtNode) -> None:
    node = rt_node
    missing = node.gpus.node(3)
    os.unlink(missing)  # the fixture's cleanup tolerates it; the kubelet must surface the runtime's error
    created = await node.sim.create_pod(pod("all-gpus", gpu_container("cuda", cores=400)))
    failed = await node.sim.wait_for_pod(
        "default", "all-gpus",
        lambda p: any((s.get("state") or {}).get("waiting", {}).get("reason") == "CreateContainerError"
                      for s in p["status"].get("containerStatuses") or []), 30)
    waiting = failed["status"]["containerStatuses"][0]["state"]["waiting"]
    assert missing in waiting["message"] and "no such file or directory" in waiting["message"], waiting
    assert failed["status"]["phase"] == "Pending"
    await node.sim.delete_pod("default", created["metadata"]["name"])
