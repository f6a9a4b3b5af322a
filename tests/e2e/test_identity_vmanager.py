"""The vmanager follows ``alloc.corrected`` (pod identity from the kubelet's pod-resources API).

With pod-resources unavailable while pods are admitted, the allocator guesses each grant's pod as
gpu-manager does (tests/e2e/test_identity.py); once pod-resources answers again, its check moves
the grants. The vmanager, following the log, then serves the pod that really holds a grant, rewrites
a vcuda.config already written with the guessed limits, and removes the directory of a pod left
holding nothing, without waiting for any reconciliation. (A guessed grant carries the limits of the
pod it is guessed for, so a vcuda.config rarely changes; tests/vmanager/test_realign.py covers the
rewrite and the removal of one written for a container that no longer holds a grant.) Corrections
here come from the allocator's periodic check (``verify_identity``), which asks the vmanager for
nothing: what happens to the pod directories is the vmanager's own reaction to the events.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from libs.config import MEMORY_BLOCK
from libs.vcuda.client import register_vdevice
from libs.vcuda.config import decode
from tests.builders import gpu_pod
from tests.e2e.helpers import Node, opposite_order, watchdog_sees
from tests.polling import eventually


async def _register(node: Node, pod: dict[str, Any]) -> Path:
    """The pod's container "main" registers through its pod's vcuda.sock, as the CUDA library does."""
    uid = pod["metadata"]["uid"]
    vm_dir = node.settings.vm_root / uid
    cid = str(pod["status"]["containerStatuses"][0]["containerID"]).split("://", 1)[1]
    node.enter_container(uid, cid)
    await register_vdevice(str(vm_dir / "vcuda.sock"), pod_uid=uid, container_name="main", timeout=5)
    return vm_dir / "main" / "vcuda.config"


async def test_a_swap_keeps_both_pods_served_and_their_vcuda_config_right(node: Node) -> None:
    assert node.sim.pod_resources is not None
    await node.sim.pod_resources.stop()
    uid, want = await opposite_order(node)
    configs, inodes, written = {}, {}, {}
    for name in ("pod-a", "pod-b"):
        pod = node.sim.get_pod("default", name)
        assert pod is not None
        configs[name] = await _register(node, pod)
        inodes[name] = os.stat(configs[name].parent.parent).st_ino
        written[name] = configs[name].read_bytes()
        # A guessed grant carries the limits of the pod it is guessed for, so the file is right already.
        assert decode(written[name]).gpu_memory == want[name]

    await node.sim.pod_resources.start()
    await node.services["allocator"].handlers.verify_identity(reason="reconcile")
    await node.tap.wait("alloc.corrected", 2, timeout=10)
    # The swap empties the first pod for an instant, between the two events: its directory (mounted in
    # its containers) must not be removed and recreated, and both pods stay served.
    await asyncio.sleep(3 * node.services["vmanager"].tracker.settle)
    await node.services["vmanager"].tracker.follower.wait_for(node.tap.records[-1].seq, 10)
    sockets = node.services["vmanager"].sockets
    for name in ("pod-a", "pod-b"):
        vm_dir = node.settings.vm_root / uid[name]
        assert os.stat(vm_dir).st_ino == inodes[name]
        assert (vm_dir / "vcuda.sock").is_socket() and uid[name] in sockets.servers
        assert configs[name].read_bytes() == written[name]
        cfg = decode(written[name])
        assert (cfg.pod_uid, cfg.container_name, cfg.utilization) == (uid[name], "main", 60)
    assert {(a.pod_name, a.memory) for a in (await node.snapshot()).allocations} == {
        ("pod-a", 4 * MEMORY_BLOCK), ("pod-b", 8 * MEMORY_BLOCK)}


async def test_a_pod_left_without_grants_loses_its_directory_and_the_real_holder_is_served(node: Node) -> None:
    assert node.sim.pod_resources is not None
    await node.sim.pod_resources.stop()
    kubelet = node.sim.kubelet
    # Pod A is bound here, Pending, with the earlier predicate time, but the kubelet has not taken it
    # up yet; pod B, asking for the same cores, is admitted: the allocator's guess gives B's devices to A.
    take_up = kubelet.pod_created
    kubelet.pod_created = lambda _pod: None  # type: ignore[method-assign]
    try:
        created_a = await node.sim.create_pod(
            gpu_pod("pod-a", ("main", 60, 4), annotations={"tencent.com/predicate-time": "1000"}))
    finally:
        kubelet.pod_created = take_up  # type: ignore[method-assign]
    await watchdog_sees(node, {"pod-a"})
    pod_b = await node.run_pod(gpu_pod("pod-b", ("main", 60, 8), annotations={"tencent.com/predicate-time": "2000"}))
    assert pod_b["status"]["phase"] == "Running", pod_b["status"]
    uid_a, uid_b = created_a["metadata"]["uid"], pod_b["metadata"]["uid"]
    snap = await node.snapshot()
    assert [a.pod_uid for a in snap.allocations] == [uid_a]  # the wrong guess
    dir_a, dir_b = node.settings.vm_root / uid_a, node.settings.vm_root / uid_b
    sockets = node.services["vmanager"].sockets
    assert (dir_a / "vcuda.sock").is_socket() and not dir_b.exists()

    await node.sim.pod_resources.start()
    await node.services["allocator"].handlers.verify_identity(reason="reconcile")
    corrected = await node.tap.wait("alloc.corrected", 1, timeout=10)
    assert (corrected[0].data["previous_pod_uid"], corrected[0].data["pod_uid"]) == (uid_a, uid_b)
    # Promptly (the vmanager reconciles only at its start): B is served, A's directory is gone.
    # Files on disk, no event to wait on.
    await eventually(lambda: (dir_b / "vcuda.sock").is_socket() and uid_b in sockets.servers, timeout=10,
                     interval=0.05, what="pod B served")
    await eventually(lambda: not dir_a.exists() and uid_a not in sockets.servers, timeout=10, interval=0.05,
                     what="pod A's directory removed")
    cfg = await _register(node, pod_b)
    assert decode(cfg.read_bytes()).gpu_memory == 8 * MEMORY_BLOCK

    # The kubelet takes pod A up at last: with pod-resources back its grant is right from the start.
    # The annotations the allocator wrote for A's wrong guess were withdrawn when the grant moved (else
    # they would read as an extender's choice of B's GPU, which has no room, and fail A's admission).
    await asyncio.wait_for(node.services["allocator"].handlers.annotations.queue.join(), 15)
    annotations = (node.sim.get_pod("default", "pod-a") or {})["metadata"].get("annotations", {})
    assert "tencent.com/gpu-assigned" not in annotations and "tencent.com/predicate-gpu-idx-0" not in annotations
    node.sim.kubelet.pod_created(created_a)
    pod_a = await node.sim.wait_for_pod(
        "default", "pod-a", lambda p: p["status"].get("phase") in ("Running", "Failed"), 20)
    assert pod_a["status"]["phase"] == "Running", pod_a["status"]
    assert (dir_a / "vcuda.sock").is_socket()
    assert {(a.pod_uid, a.memory) for a in (await node.snapshot()).allocations} == {
        (uid_a, 4 * MEMORY_BLOCK), (uid_b, 8 * MEMORY_BLOCK)}
