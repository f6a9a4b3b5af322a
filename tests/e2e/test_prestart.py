"""PreStartContainer through the real registrar socket (gpu-manager-reference.md 3.9).

The kubelet calls it with a container's vcore device IDs right before the container starts. The
grant holding them is checked (and corrected from pod-resources when the guess was wrong), the pod's
vcuda.sock is served, and the pod is annotated ``gpu-assigned=true``. Failures carry gpu-manager's
"PreStartContainer check failed" text, which its tooling (ShouldDelete) looks for. The registrar
asks the allocator's check and the vmanager's socket at once (services/registrar/prestart.py).
"""

from __future__ import annotations

import os
import shutil

import grpc
import pytest

from libs.commands import PrepareRequest, PreStartReply, PreStartRequest
from libs.errors import RemoteError
from libs.kube.pods import RESOURCE_VCORE
from tests.builders import gpu_pod
from tests.e2e.helpers import Node, prepares_seen, prestart


async def test_prestart_of_a_started_container_checks_and_serves_again(node: Node) -> None:
    pod = await node.run_pod(gpu_pod("again", ("main", 40, 3)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    uid = pod["metadata"]["uid"]
    ids = node.sim.allocated_device_ids(uid, "main", RESOURCE_VCORE)
    # A container restart: the kubelet calls PreStartContainer again with the same IDs.
    await prestart(node, ids)
    assert (node.settings.vm_root / uid / "vcuda.sock").is_socket()
    done = await node.sim.wait_for_pod(
        "default", "again",
        lambda p: p["metadata"].get("annotations", {}).get("tencent.com/gpu-assigned") == "true", 15)
    assert done["status"]["phase"] == "Running"


async def test_the_vmanager_is_asked_once_by_the_grants_devices(node: Node) -> None:
    # While the allocator checks the grant, the vmanager serves the socket of the pod that holds the
    # devices in its log: one request, naming no pod, when the check agrees with it.
    pod = await node.run_pod(gpu_pod("asked", ("main", 20, 1)))
    uid = pod["metadata"]["uid"]
    ids = node.sim.allocated_device_ids(uid, "main", RESOURCE_VCORE)
    async with prepares_seen(node) as seen:
        await prestart(node, ids)
    assert seen == [PrepareRequest(device_ids=ids)]
    assert (node.settings.vm_root / uid / "vcuda.sock").is_socket()


async def test_a_socket_the_vmanager_cannot_serve_fails_with_gpu_managers_text(node: Node) -> None:
    pod = await node.run_pod(gpu_pod("unserved", ("main", 20, 1)))
    uid = pod["metadata"]["uid"]
    ids = node.sim.allocated_device_ids(uid, "main", RESOURCE_VCORE)
    pod_dir = node.settings.vm_root / uid
    # Someone put a symlink where the pod's directory was: the vmanager refuses to serve through it.
    shutil.rmtree(pod_dir)
    (node.settings.vm_root / "elsewhere").mkdir()
    os.symlink(node.settings.vm_root / "elsewhere", pod_dir)
    async with prepares_seen(node) as seen:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await prestart(node, ids)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details().startswith(f"failed to setup VCuda for pod {uid}: ")
    assert "is a symlink" in err.value.details()
    # Asked by the devices, then once more for the pod the check confirmed.
    assert [(r.pod_uid, r.device_ids) for r in seen] == [("", ids), (uid, [])]
    assert seen[1].alloc_seq > 0


async def test_devices_nobody_holds_fail_with_gpu_managers_text(node: Node) -> None:
    pod = await node.run_pod(gpu_pod("holder", ("main", 10, 1)))
    held = set(node.sim.allocated_device_ids(pod["metadata"]["uid"], "main", RESOURCE_VCORE))
    free = [f"tencent.com/vcuda-core-{i}" for i in range(400) if f"tencent.com/vcuda-core-{i}" not in held][:10]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await prestart(node, free)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details().startswith(
        "PreStartContainer check failed, failed to get pod from deviceplugin checkpoint")
    snap = await node.snapshot()
    assert [a.pod_name for a in snap.allocations] == ["holder"]  # nothing else was touched


async def test_a_check_asked_ahead_for_devices_nobody_holds_does_not_ask_the_kubelet(node: Node) -> None:
    # The registrar asks each grant's PreStart ahead of the kubelet (services/registrar/prestart.py);
    # when the grant is gone by then (its pod deleted at once), the kubelet's List would say nothing new.
    await node.run_pod(gpu_pod("holder", ("main", 10, 1)))
    free = [f"tencent.com/vcuda-core-{i}" for i in range(390, 400)]
    registry = node.services["allocator"].metrics.registry

    def lists() -> float:
        return registry.get_sample_value("gpuledger_allocator_kubelet_lists_total", {"reason": "prestart"}) or 0.0

    before = lists()
    for ahead in (True, False):
        with pytest.raises(RemoteError) as err:
            await node.bus.request(node.bus.subjects.prestart, PreStartRequest(
                request_id=f"r-{ahead}", resource=RESOURCE_VCORE, device_ids=free, ahead=ahead), PreStartReply,
                timeout=10)
        assert err.value.code == 404 and "no allocation holds these 10" in err.value.message
        assert lists() == before + (0 if ahead else 1)  # the kubelet's call itself still asks the kubelet


async def test_without_pod_resources_the_guess_stands(node: Node) -> None:
    # An older kubelet, or a node where the pod-resources socket is not mounted: pods still start.
    assert node.sim.pod_resources is not None
    await node.sim.pod_resources.stop()
    pod = await node.run_pod(gpu_pod("plain", ("main", 50, 2)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    snap = await node.snapshot()
    assert [(a.pod_name, a.memory, a.corrected_seq) for a in snap.allocations] == [("plain", 2 << 28, 0)]


async def test_a_failed_check_frees_the_gpus_and_fails_the_pod(node: Node) -> None:
    # gpu-manager's ALLOCATE_FAIL. No real request makes the check fail here (the grant is found by
    # the kubelet's exact device IDs and built from the same spec), so the action is driven directly.
    pod = await node.run_pod(gpu_pod("doomed", ("main", 30, 2)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    allocator = node.services["allocator"].handlers
    [alloc] = (await node.snapshot()).allocations
    await allocator.fail_pod(alloc, "PreStartContainer check failed, for the test")
    failed = await node.sim.wait_for_pod("default", "doomed", lambda p: p["status"].get("phase") == "Failed", 10)
    assert failed["status"]["reason"] == "PreStartContainerCheckErr"
    assert failed["status"]["message"] == "PreStartContainer check failed, for the test"
    snap = await node.snapshot()
    assert not snap.allocations and all(g.cores_used == 0 for g in snap.gpus)
    [released] = await node.tap.wait("alloc.released", 1)
    assert released.data["reason"] == "prestart-check-failed"
