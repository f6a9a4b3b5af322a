"""A grant the kubelet's record has settled needs no pod-resources List at its PreStart or its release.

Shortly after a grant's reply the allocator checks it against the kubelet's record: the kubelet records
a container's device IDs as soon as its Allocate returns, and they never move to another container
while the pod lives. A grant the record shows under its own pod and container with exactly its device
IDs is settled, so a later PreStartContainer (each container start, restarts included) and the pod's
release skip the List the kubelet rate-limits (100 a second, 10 at once). The record is read first
from the kubelet's checkpoint file, which the simulated kubelet writes as a real one does: a grant it
confirms costs no List at all. Counted by the allocator's ``gpuledger_allocator_kubelet_lists_total{reason}``
and ``gpuledger_allocator_checkpoint_settled_total``.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from libs.commands import ReleaseRequest
from libs.kubelet.checkpoint import CHECKPOINT_FILE
from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from libs.ledger.state import Allocation
from tests.builders import gpu_pod
from tests.e2e.helpers import Node
from tests.polling import eventually


def lists(node: Node, reason: str) -> float:
    registry = node.services["allocator"].metrics.registry
    return registry.get_sample_value("gpuledger_allocator_kubelet_lists_total", {"reason": reason}) or 0.0


def from_checkpoint(node: Node) -> float:
    registry = node.services["allocator"].metrics.registry
    return registry.get_sample_value("gpuledger_allocator_checkpoint_settled_total") or 0.0


async def prestart(node: Node, device_ids: list[str]) -> None:
    """PreStartContainer on the registrar's vcore socket, as the kubelet calls it at a container (re)start."""
    socket = f"unix://{node.settings.device_plugin_dir}/vcore.sock"
    async with grpc.aio.insecure_channel(socket) as channel:
        await pb_grpc.DevicePluginStub(channel).PreStartContainer(
            pb.PreStartContainerRequest(devices_ids=device_ids), timeout=10)


async def test_a_settled_grant_skips_the_list_at_prestart_and_at_release(node: Node) -> None:
    pod = await node.run_pod(gpu_pod("settled", ("c", 20, 1)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    [grant] = [a for a in (await node.snapshot()).allocations if a.pod_name == "settled"]
    handlers = node.services["allocator"].handlers
    assert lists(node, "allocate") == 1
    await eventually(lambda: grant.alloc_id in handlers.settled, timeout=5, interval=0.02,
                     what="the grant checked against the kubelet's record")
    # The kubelet's checkpoint confirmed it: no List of the allocator's own.
    assert from_checkpoint(node) == 1
    assert lists(node, "verify") == lists(node, "prestart") == 0
    before = {r: lists(node, r) for r in ("prestart", "release", "verify")}

    await prestart(node, list(grant.device_ids))  # the container restarts: the kubelet asks again
    assert lists(node, "prestart") == before["prestart"]

    await node.sim.delete_pod("default", "settled")
    await eventually(lambda: not [a for a in node.services["allocator"].ledger.state.allocations.values()
                                  if a.pod_name == "settled"], timeout=10, interval=0.02, what="the release")
    assert lists(node, "release") == before["release"]


async def _settled(node: Node, name: str) -> Allocation:
    """The grant of a new running pod, once settled, with no check of it still on its way."""
    pod = await node.run_pod(gpu_pod(name, ("c", 20, 1)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    [grant] = [a for a in (await node.snapshot()).allocations if a.pod_name == name]
    handlers = node.services["allocator"].handlers
    await eventually(lambda: grant.alloc_id in handlers.settled, timeout=5, interval=0.02, what="settled")
    # A check shortly after the grant may still be on its way: it would settle the grant again after
    # a caller forgets it.
    await eventually(lambda: handlers._verifying is None or handlers._verifying.done(), timeout=5, interval=0.02,
                     what="no check on the way")
    return grant


async def _settled_then_forgotten(node: Node, name: str) -> Allocation:
    grant = await _settled(node, name)
    node.services["allocator"].handlers.settled.clear()  # as after a restart of the allocator: nothing settled
    return grant


async def test_a_grant_the_checkpoint_shows_is_settled_at_prestart_without_a_list(node: Node) -> None:
    grant = await _settled_then_forgotten(node, "recorded")
    before, confirmed = lists(node, "prestart"), from_checkpoint(node)
    await prestart(node, list(grant.device_ids))
    assert lists(node, "prestart") == before
    assert from_checkpoint(node) == confirmed + 1
    assert grant.alloc_id in node.services["allocator"].handlers.settled


async def test_a_grant_no_readable_record_shows_is_listed_at_prestart(node: Node) -> None:
    """Without the kubelet's word on the grant (nothing settled in memory, and a checkpoint file in a
    layout this cannot read, as a future kubelet's might be), PreStart asks the List."""
    grant = await _settled_then_forgotten(node, "unsettled")
    checkpoint = Path(node.settings.device_plugin_dir) / CHECKPOINT_FILE
    assert checkpoint.is_file()
    checkpoint.write_bytes(b'{"Data": {"PodDeviceEntries": "a layout of the future"}}')
    before, confirmed = lists(node, "prestart"), from_checkpoint(node)
    await prestart(node, list(grant.device_ids))
    assert lists(node, "prestart") == before + 1
    assert from_checkpoint(node) == confirmed
    assert grant.alloc_id in node.services["allocator"].handlers.settled  # that List settled it again


async def test_a_forwarded_list_that_can_settle_nothing_is_not_read(node: Node) -> None:
    """The registrar sends the allocator the List it asked at each Allocate. It was answered before the
    kubelet recorded that Allocate's devices, so it can only settle earlier grants: when all of them are
    settled already (the kubelet's checkpoint settles each 20 ms after it), reading it would cost the
    allocator a parse that grows with the node's pods, for nothing."""
    handlers = node.services["allocator"].handlers
    await _settled(node, "first")
    read, received = handlers.forwarded.read, lists(node, "allocate")
    pod = await node.run_pod(gpu_pod("second", ("c", 20, 1)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    [grant] = [a for a in (await node.snapshot()).allocations if a.pod_name == "second"]
    await eventually(lambda: grant.alloc_id in handlers.settled, timeout=5, interval=0.02, what="settled")
    assert lists(node, "allocate") == received + 1  # the registrar's List came...
    assert handlers.forwarded.read == read  # ...and was not read


async def test_a_forwarded_list_settles_an_earlier_grant_not_settled_yet(node: Node) -> None:
    handlers = node.services["allocator"].handlers
    first = await _settled_then_forgotten(node, "first")  # not settled in memory, as after a restart
    read = handlers.forwarded.read
    pod = await node.run_pod(gpu_pod("second", ("c", 20, 1)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    assert handlers.forwarded.read == read + 1
    assert first.alloc_id in handlers.settled  # by the second pod's List: nothing else looks at the first


async def test_a_grant_the_checkpoint_shows_is_released_without_a_list(node: Node) -> None:
    """Released while the kubelet's checkpoint still records the pod (here: released at once, the pod
    still running), after the allocator forgot what it had settled: the file settles it, no List."""
    grant = await _settled_then_forgotten(node, "leaving")
    before, confirmed = lists(node, "release"), from_checkpoint(node)
    reply = await node.services["allocator"].handlers.release(ReleaseRequest(pod_uid=grant.pod_uid, reason="test"))
    assert reply.released == [grant.alloc_id]
    assert lists(node, "release") == before
    assert from_checkpoint(node) == confirmed + 1


async def test_a_grant_no_readable_record_shows_is_listed_at_release(node: Node) -> None:
    grant = await _settled_then_forgotten(node, "leaving")
    (Path(node.settings.device_plugin_dir) / CHECKPOINT_FILE).write_bytes(b'{"Data": {"PodDeviceEntries": "?"}}')
    before = lists(node, "release")
    reply = await node.services["allocator"].handlers.release(ReleaseRequest(pod_uid=grant.pod_uid, reason="test"))
    assert reply.released == [grant.alloc_id]
    assert lists(node, "release") == before + 1
