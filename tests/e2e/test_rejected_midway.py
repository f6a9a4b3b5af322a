"""A pod the kubelet rejected part-way through admission, while our view of it is stale.

Issue 13 (the chaos test, seed 2): pod P's first container was granted, its second Allocate failed,
so the kubelet rejected P and went on to admit Q. The watchdog was away (here: frozen), so the
allocator still saw P Pending and part-way through admission, and matched Q's request to P's next
container. Q then ran on devices recorded under P, and P's release took them: Q's PreStartContainer
found "no allocation holds these 20 tencent.com/vcuda-core devices". (Here, as in other runs of that
test, Q is refused instead: placed with P's container's memory, or, asking for another count, as a
mismatch.) The allocator now asks the kubelet's pod-resources whether it is still
admitting such a pod before matching to it.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from libs.commands import PodsReply, PodsRequest
from libs.kube.pods import RESOURCE_VCORE
from tests.builders import gpu_pod
from tests.e2e.helpers import Node

pytestmark = pytest.mark.slow


async def _watchdog_sees(node: Node, names: set[str], timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while True:
            reply = await node.bus.request(node.bus.subjects.pods, PodsRequest(phase="Pending"), PodsReply, timeout=5)
            if names <= {p.metadata.name for p in reply.pods}:
                return
            await asyncio.sleep(0.05)


async def test_a_pod_rejected_midway_does_not_take_the_next_pods_request(node_processes: Node) -> None:
    node = node_processes
    assert node.launcher is not None
    watchdog = next(c for c in node.launcher.children if c.name == "watchdog")
    async with node.sim.kubelet.admission_lock:  # both pods known before the kubelet admits either
        # P's second container asks for more memory than any GPU has (100 blocks of 256 MiB,
        # 16 GiB GPUs): the allocator refuses it, so the kubelet rejects P after granting "a".
        p = await node.sim.create_pod(gpu_pod("p", ("a", 20, 1), ("b", 20, 100)))
        q = await node.sim.create_pod(gpu_pod("q", ("c", 20, 2)))
        await _watchdog_sees(node, {"p", "q"})
        await asyncio.sleep(0.5)  # the watchdog's notifications reach the allocator's pod cache
        os.kill(watchdog.proc.pid, signal.SIGSTOP)  # P's rejection will not reach the allocator
    try:
        p_uid, q_uid = p["metadata"]["uid"], q["metadata"]["uid"]
        rejected = await node.sim.wait_for_pod("default", "p", lambda x: x["status"].get("phase") == "Failed", 20)
        assert "is larger than" in rejected["status"]["message"], rejected["status"]
        async with asyncio.timeout(20):  # the kubelet admitted Q: it holds devices for Q's container
            while not (q_ids := node.sim.allocated_device_ids(q_uid, "c", RESOURCE_VCORE)):
                assert node.sim.get_pod("default", "q")["status"].get("phase") != "Failed"  # type: ignore[index]
                await asyncio.sleep(0.05)
        # The ledger recorded Q's devices for Q itself, at once, not for the rejected P.
        snap = await node.snapshot()
        holding = [(a.pod_uid, a.container) for a in snap.allocations if set(a.device_ids) == set(q_ids)]
        assert holding == [(q_uid, "c")], (holding, p_uid)
    finally:
        os.kill(watchdog.proc.pid, signal.SIGCONT)
    # Once the watchdog is back: P's grant is released, Q runs on a grant the ledger holds.
    pod = await node.sim.wait_for_pod("default", "q", lambda x: x["status"].get("phase") in ("Running", "Failed"), 30)
    assert pod["status"]["phase"] == "Running", pod["status"]
    async with asyncio.timeout(15):
        snap = await node.snapshot()
        while p_uid in {a.pod_uid for a in snap.allocations}:
            await asyncio.sleep(0.1)
            snap = await node.snapshot()
    assert [(a.pod_uid, a.container) for a in snap.allocations if set(a.device_ids) == set(q_ids)] == [(q_uid, "c")]
