"""Walkthrough: pods admitted together are settled by each other's List, so the kubelet is asked less.

The kubelet admits pods one after another (an Allocate each), then creates their sandboxes, and only
after a pod's sandbox does it ask PreStartContainer for the pod's containers. A pod-resources List is
asked at each Allocate (by the registrar, which checks the grant with it and sends it on to the
allocator); the kubelet has recorded the pod admitted before by then, so that List settles the
earlier grant, whose PreStart then needs no List of its own. The last pod's grant, which no later
List settles, is confirmed at its PreStart by the kubelet's checkpoint file (rewritten after each
container's Allocates), with no List either. The kubelet allows 100 Lists a second and 10 at once: a
burst of pods costs one each, the Allocate's.
"""

from __future__ import annotations

import asyncio

import pytest

from libs.kube.pods import RESOURCE_VCORE
from services.allocator import handlers
from tests.polling import eventually
from tests.runtime.helpers import RtNode, gpu_container, pod


def lists(node: RtNode, reason: str) -> float:
    registry = node.services["allocator"].metrics.registry
    return registry.get_sample_value("gpuledger_allocator_kubelet_lists_total", {"reason": reason}) or 0.0


def from_checkpoint(node: RtNode) -> float:
    registry = node.services["allocator"].metrics.registry
    return registry.get_sample_value("gpuledger_allocator_checkpoint_settled_total") or 0.0


async def test_the_second_pods_allocate_settles_the_first_pods_grant(
    rt_node: RtNode, monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = rt_node
    # The check a while after each grant is left out of the picture: only the Allocates' Lists and
    # the PreStarts' can settle a grant here.
    monkeypatch.setattr(handlers, "_VERIFY_AFTER", 60.0)
    before = {reason: lists(node, reason) for reason in ("allocate", "prestart", "verify")}
    confirmed = from_checkpoint(node)

    # 1. Two GPU pods at once: the kubelet admits the first, then the second, then starts both.
    await asyncio.gather(*(node.sim.create_pod(pod(name, gpu_container("cuda", cores=20, memory=1)))
                           for name in ("first", "second")))

    # 2. Both admitted, no container started yet: the second Allocate's List has settled the first
    #    pod's grant already (the kubelet had recorded it), before any PreStart.
    def allocated() -> list[object]:
        return [c for c in node.sim.calls if c.method == "Allocate" and c.resource == RESOURCE_VCORE and c.ok]

    await eventually(lambda: len(allocated()) == 2, timeout=30, interval=0.002, what="both pods admitted")
    assert not [c for c in node.sim.calls if c.method == "PreStartContainer"], "a container started already"
    state = node.services["allocator"].ledger.state
    [first] = [a.alloc_id for a in state.allocations.values() if a.pod_name == "first"]
    # The registrar sends its List on after its reply: the allocator settles with it a moment later.
    await eventually(lambda: first in node.services["allocator"].handlers.settled, timeout=5, interval=0.002,
                     what="the first grant settled by the second Allocate's List")

    for name in ("first", "second"):
        running = await node.sim.wait_for_pod(
            "default", name, lambda p: p["status"].get("phase") in ("Running", "Failed"), 60)
        assert running["status"]["phase"] == "Running", running["status"]

    # 3. One List per Allocate and no other: the first grant was settled by the second Allocate's
    #    List, the second grant at its PreStart by the kubelet's checkpoint (a PreStart asks a List
    #    only when neither has settled its grant).
    assert lists(node, "allocate") - before["allocate"] == 2
    assert lists(node, "prestart") - before["prestart"] == 0
    assert from_checkpoint(node) - confirmed == 1
    assert lists(node, "verify") == before["verify"]
    settled = node.services["allocator"].handlers.settled
    grants = {a.pod_name: a.alloc_id for a in await node.allocations()}
    assert {grants["first"], grants["second"]} <= set(settled)
