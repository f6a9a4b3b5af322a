"""Which pod and container an Allocate is for (gpu-manager-reference.md 3.1), through the simulator.

The kubelet admits one pod at a time, init containers first; an app container reuses the devices of
the init containers before it, and sends them again in its own Allocate. The log records both
containers but charges the GPUs once.
"""

from __future__ import annotations

from typing import Any

from libs.config import MEMORY_BLOCK
from libs.kube.pods import RESOURCE_VCORE
from tests.builders import gpu_pod
from tests.e2e.helpers import Node


def with_init(name: str, init: tuple[str, int, int], *apps: tuple[str, int, int]) -> dict[str, Any]:
    manifest = gpu_pod(name, *apps)
    manifest["spec"]["initContainers"] = gpu_pod("x", init)["spec"]["containers"]
    return manifest


async def test_an_app_container_reusing_its_init_containers_gpu_is_charged_once(node: Node) -> None:
    pod = await node.run_pod(with_init("staged", ("setup", 50, 4), ("main", 50, 4)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    uid = pod["metadata"]["uid"]
    init_ids = set(node.sim.allocated_device_ids(uid, "setup", RESOURCE_VCORE))
    app_ids = set(node.sim.allocated_device_ids(uid, "main", RESOURCE_VCORE))
    assert init_ids == app_ids  # the kubelet handed the init container's devices on

    snap = await node.snapshot()
    by_container = {a.container: a for a in snap.allocations}
    assert by_container["setup"].init_container and not by_container["setup"].charged
    assert by_container["main"].charged
    assert by_container["main"].shares == by_container["setup"].shares  # same GPU, not a second one
    assert sum(g.cores_used for g in snap.gpus) == 50
    assert sum(g.memory_used for g in snap.gpus) == 4 * MEMORY_BLOCK
    assert not node.tap.of("alloc.corrected")  # the reuse is not mistaken for a wrong guess

    # Deleting the pod releases both records and the GPU comes back whole.
    await node.sim.delete_pod("default", "staged")
    await node.tap.wait("alloc.released", 2)
    snap = await node.snapshot()
    assert not snap.allocations and all(g.cores_used == 0 and g.memory_used == 0 for g in snap.gpus)


async def test_a_multi_container_pod_is_continued_in_kubelet_order(node: Node) -> None:
    # Two pods with containers of the same size: the second pod must not take the first pod's
    # second container, because the first pod is part-way through admission.
    first = await node.run_pod(gpu_pod("first", ("a", 20, 1), ("b", 20, 3)))
    second = await node.run_pod(gpu_pod("second", ("a", 20, 2)))
    assert first["status"]["phase"] == second["status"]["phase"] == "Running"
    snap = await node.snapshot()
    got = {(a.pod_name, a.container): (a.container_index, a.memory) for a in snap.allocations}
    assert got == {("first", "a"): (0, MEMORY_BLOCK), ("first", "b"): (1, 3 * MEMORY_BLOCK),
                   ("second", "a"): (0, 2 * MEMORY_BLOCK)}
    for a in snap.allocations:  # the memory came from the pod spec, the kubelet's IDs are the ones it holds
        held = node.sim.allocated_device_ids(a.pod_uid, a.container, RESOURCE_VCORE)
        assert sorted(a.device_ids) == sorted(held)
