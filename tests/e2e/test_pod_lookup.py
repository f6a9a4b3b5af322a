"""How an Allocate finds its pod, and the watchdog's answer for one pod by name.

The kubelet admits a pod as soon as it is bound to the node, often before the pod's watch event has
gone through the watchdog to the allocator's copy of the node's pods. The kubelet's pod-resources
List, asked at the Allocate's receipt, already names the pod (the kubelet takes a pod up before
admitting it): when the notification is still not in a few milliseconds on, the allocator fetches
that one pod by name (one GET through the watchdog) instead of waiting, then listing every pod.
"""

from __future__ import annotations

import pytest

from libs.commands import PodsReply, PodsRequest
from libs.config import MEMORY_BLOCK
from libs.errors import RemoteError
from tests.builders import gpu_pod
from tests.e2e.helpers import Node


def found(node: Node, via: str) -> float:
    registry = node.services["allocator"].metrics.registry
    return registry.get_sample_value("gpuledger_allocate_pod_found_total", {"via": via}) or 0.0


async def test_a_pod_known_to_the_allocator_is_matched_from_its_notifications(node: Node) -> None:
    first = await node.run_pod(gpu_pod("first", ("main", 10, 1)))
    assert first["status"]["phase"] == "Running", first["status"]
    assert found(node, "notification") + found(node, "fetched") == 1
    assert found(node, "listed") == 0  # never the slow way: the short wait, then lists


async def test_a_pod_whose_notification_is_late_is_fetched_by_name(node: Node) -> None:
    # The watchdog's watch is cut: it resumes after its back-off (0.2 s), so the pod's notification
    # comes long after the kubelet has asked for its devices.
    node.sim.store.drop_watches()
    pod = await node.run_pod(gpu_pod("late", ("main", 20, 2)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    assert (found(node, "fetched"), found(node, "listed")) == (1, 0)
    [alloc] = (await node.snapshot()).allocations
    assert (alloc.pod_name, alloc.container, alloc.cores, alloc.memory) == ("late", "main", 20, 2 * MEMORY_BLOCK)
    assert alloc.pod_uid == pod["metadata"]["uid"]


async def test_the_watchdog_answers_one_pod_by_name_bound_to_its_node_only(node: Node) -> None:
    await node.run_pod(gpu_pod("named", ("main", 10, 1)))
    elsewhere = gpu_pod("elsewhere", ("main", 10, 1))
    elsewhere["spec"]["nodeName"] = "another-node"
    await node.sim.create_pod(elsewhere)

    async def ask(**query: object) -> list[str]:
        reply = await node.bus.request(node.bus.subjects.pods, PodsRequest(**query), PodsReply, timeout=5)
        return [p.metadata.name for p in reply.pods]

    for fresh in (False, True):
        assert await ask(namespace="default", name="named", fresh=fresh) == ["named"]
        assert await ask(namespace="default", name="elsewhere", fresh=fresh) == []
        assert await ask(namespace="default", name="absent", fresh=fresh) == []
        assert await ask(namespace="other", name="named", fresh=fresh) == []
    with pytest.raises(RemoteError) as refused:
        await ask(name="named", fresh=True)
    assert refused.value.code == 400
    assert "namespace and its name" in refused.value.message
