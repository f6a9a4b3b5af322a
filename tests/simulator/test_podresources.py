"""PodResources v1 over the real unix socket."""

from __future__ import annotations

import grpc
import pytest

from libs.kubelet.podresources.v1 import api_pb2 as pr
from libs.kubelet.podresources.v1 import api_pb2_grpc as pr_grpc
from simulator import NodeSimulator
from tests.builders import ctr, phase_is, pod_manifest
from tests.polling import eventually
from tests.simulator.fakeplugin import device

GPU = "example.com/gpu"


@pytest.fixture
async def lister(sim: NodeSimulator):
    assert sim.cfg.pod_resources_socket is not None
    async with grpc.aio.insecure_channel(f"unix://{sim.cfg.pod_resources_socket}") as channel:
        yield pr_grpc.PodResourcesListerStub(channel)


async def test_list_get_and_allocatable(make_plugin, sim, lister) -> None:
    plugin = await make_plugin(count=3, register=False)
    plugin.devices = [device("dev0", numa=[0]), device("dev1", numa=[1]), device("dev2"),
                      device("bad", "Unhealthy")]
    await plugin.register()
    await sim.wait_for_resource(GPU, 3, timeout=5)
    manifest = pod_manifest(
        "p", [ctr("app", {GPU: 1})],
        init=[ctr("init", {GPU: 2}), ctr("side", {GPU: 1}, sidecar=True)],
    )
    pod = await sim.create_pod(manifest)
    await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
    await sim.create_pod(pod_manifest("plain"))
    await sim.wait_for_pod("default", "plain", phase_is("Running"), timeout=5)

    listed = await lister.List(pr.ListPodResourcesRequest())
    by_name = {p.name: p for p in listed.pod_resources}
    assert set(by_name) == {"p", "plain"}
    # Sidecar first, then the app; the ordinary init container is omitted.
    assert [c.name for c in by_name["p"].containers] == ["side", "app"]
    uid = pod["metadata"]["uid"]
    for container in by_name["p"].containers:
        ids = [d.device_ids[0] for d in container.devices]
        assert all(len(d.device_ids) == 1 and d.resource_name == GPU for d in container.devices)
        assert sorted(ids) == sorted(sim.allocated_device_ids(uid, container.name, GPU))
        for d in container.devices:
            if d.device_ids[0] == "dev2":
                assert not d.HasField("topology")
            else:
                assert [n.ID for n in d.topology.nodes] == [int(d.device_ids[0][-1])]

    got = await lister.Get(pr.GetPodResourcesRequest(pod_name="p", pod_namespace="default"))
    assert got.pod_resources == by_name["p"]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await lister.Get(pr.GetPodResourcesRequest(pod_name="nope", pod_namespace="ns1"))
    assert info.value.code() == grpc.StatusCode.UNKNOWN
    assert info.value.details() == "pod nope in namespace ns1 not found"

    alloc = await lister.GetAllocatableResources(pr.AllocatableResourcesRequest())
    assert sorted(d.device_ids[0] for d in alloc.devices) == ["dev0", "dev1", "dev2"]
    assert all(len(d.device_ids) == 1 for d in alloc.devices)
    assert [c.method for c in sim.calls if c.method in ("List", "Get", "GetAllocatableResources")] == [
        "List", "Get", "Get", "GetAllocatableResources"]


async def test_list_runs_gc_and_skips_inactive_pods(make_plugin, sim, lister) -> None:
    await make_plugin(count=1)
    pod = await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 1})]))
    await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
    sim.store.update("default", "p", lambda p: p["status"].update(phase="Failed"))
    uid = pod["metadata"]["uid"]
    listed = await lister.List(pr.ListPodResourcesRequest())
    assert listed.pod_resources == []
    # Upstream quirk: the last pod that went through Allocate stays "pending admission" for GC
    # until the next pod's admission, so its devices survive this List.
    assert sim.allocated_device_ids(uid, "a", GPU)
    await sim.create_pod(pod_manifest("next"))
    await sim.wait_for_pod("default", "next", phase_is("Running"), timeout=5)
    listed = await lister.List(pr.ListPodResourcesRequest())
    assert [p.name for p in listed.pod_resources] == ["next"]
    assert sim.allocated_device_ids(uid, "a", GPU) == []


async def test_rate_limit(sim, lister) -> None:
    codes = []
    for _ in range(30):
        try:
            await lister.GetAllocatableResources(pr.AllocatableResourcesRequest())
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as err:
            codes.append(err.code())
            assert err.details() == "rejected by rate limit"
    assert codes[:10] == [grpc.StatusCode.OK] * 10
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes


async def test_list_shows_only_pods_the_kubelet_has_taken_up(make_plugin, sim, lister) -> None:
    # The kubelet adds a pod to its pod manager right before admitting it; pods queued behind it are
    # not known yet, so PodResources does not list them (the allocator's pod identity check relies on
    # this to tell pods apart).
    await make_plugin(count=2)
    async with sim.kubelet.admission_lock:
        await sim.create_pod(pod_manifest("first", [ctr("a", {GPU: 1})]))
        await sim.create_pod(pod_manifest("second", [ctr("a", {GPU: 1})]))
        # Let the admission loop take up the first pod (it then waits for the lock).
        await eventually(lambda: sim.kubelet.known, timeout=1, interval=0.01, what="the kubelet taking up a pod")
        listed = await lister.List(pr.ListPodResourcesRequest())
        assert [p.name for p in listed.pod_resources] == ["first"]
        with pytest.raises(grpc.aio.AioRpcError):
            await lister.Get(pr.GetPodResourcesRequest(pod_name="second", pod_namespace="default"))
    await sim.wait_for_pod("default", "second", phase_is("Running"), timeout=5)
    listed = await lister.List(pr.ListPodResourcesRequest())
    assert sorted(p.name for p in listed.pod_resources) == ["first", "second"]
