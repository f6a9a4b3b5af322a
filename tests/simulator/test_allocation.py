"""Admission: Allocate per (container, resource), reuse pool, failures, PreStart, GC, run options."""

from __future__ import annotations

import asyncio
import itertools

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as dp
from simulator import NodeSimulator, SimConfig
from tests.builders import ctr, phase_is, pod_manifest
from tests.simulator.fakeplugin import FakePlugin, device

GPU = "example.com/gpu"


def allocate_ids(plugin: FakePlugin) -> list[list[str]]:
    return [list(r.request.container_requests[0].devices_ids) for r in plugin.calls("Allocate")]


async def test_one_allocate_per_container_and_resource(make_plugin, sim: NodeSimulator) -> None:
    plugin = await make_plugin(count=4)
    pod = await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 1}), ctr("b", {GPU: 2})]))
    assert pod["metadata"]["uid"] and pod["spec"]["nodeName"] == "sim-node"
    assert pod["status"]["phase"] == "Pending" and pod["metadata"]["resourceVersion"]
    running = await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
    allocs = plugin.calls("Allocate")
    assert len(allocs) == 2
    assert all(len(r.request.container_requests) == 1 for r in allocs)
    assert sorted(len(ids) for ids in allocate_ids(plugin)) == [1, 2]
    uid = pod["metadata"]["uid"]
    a, b = sim.allocated_device_ids(uid, "a", GPU), sim.allocated_device_ids(uid, "b", GPU)
    assert len(a) == 1 and len(b) == 2 and not set(a) & set(b)
    statuses = {s["name"]: s for s in running["status"]["containerStatuses"]}
    assert set(statuses) == {"a", "b"}
    for st in statuses.values():
        assert st["ready"] is True and "running" in st["state"]
        assert st["containerID"].startswith("containerd://") and len(st["containerID"]) == 13 + 64
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in running["status"]["conditions"])
    assert sim.allocatable(GPU) == 4  # allocatable is the healthy count, not the free count
    # Kubelet records: exactly one ContainerAllocateRequest per call.
    recorded = [c for c in sim.calls if c.method == "Allocate"]
    assert [len(c.request["container_requests"]) for c in recorded] == [1, 1]
    assert all(c.ok for c in recorded)


async def test_pods_without_devices_run(sim) -> None:
    await sim.create_pod(pod_manifest("plain"))
    pod = await sim.wait_for_pod("default", "plain", phase_is("Running"), timeout=5)
    assert pod["status"]["containerStatuses"][0]["ready"] is True
    assert sim.container_run_options("default", "plain", "main") == {
        "envs": {}, "mounts": [], "devices": [], "annotations": {}, "cdi_devices": []}


async def test_prestart_gets_recorded_ids(make_plugin, sim) -> None:
    plugin = await make_plugin(count=4, pre_start_required=True)
    pod = await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 2}), ctr("b")]))
    await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
    prestarts = plugin.calls("PreStartContainer")
    assert len(prestarts) == 1  # container b has no device
    ids = sim.allocated_device_ids(pod["metadata"]["uid"], "a", GPU)
    assert sorted(prestarts[0].request.devices_ids) == sorted(ids)
    # Allocate (admission) happens before PreStart (container start).
    assert plugin.calls("Allocate")[-1].at < prestarts[0].at
    prestart_call = next(c for c in sim.calls if c.method == "PreStartContainer")
    assert sorted(prestart_call.request["devices_ids"]) == sorted(ids)


async def test_prestart_failure_leaves_container_waiting(make_plugin, sim) -> None:
    plugin = await make_plugin(count=2, pre_start_required=True)
    plugin.prestart_error = "PreStartContainer check failed, no such pod"
    await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 1})]))

    def waiting(pod):
        sts = (pod.get("status") or {}).get("containerStatuses") or []
        return bool(sts) and sts[0]["state"].get("waiting", {}).get("reason") == "CreateContainerConfigError"

    pod = await sim.wait_for_pod("default", "p", waiting, timeout=5)
    assert pod["status"]["phase"] == "Pending"
    message = pod["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
    assert message == (
        "device plugin PreStartContainer rpc failed with err: rpc error: code = FailedPrecondition "
        "desc = PreStartContainer check failed, no such pod"
    )


async def test_a_failed_container_start_is_tried_again_with_the_same_devices(make_plugin, sim) -> None:
    plugin = await make_plugin(count=2, pre_start_required=True)
    plugin.prestart_error = "allocator did not answer"
    pod = await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 1})]))

    def waiting(p):
        sts = (p.get("status") or {}).get("containerStatuses") or []
        return bool(sts) and sts[0]["state"].get("waiting", {}).get("reason") == "CreateContainerConfigError"

    await sim.wait_for_pod("default", "p", waiting, timeout=5)
    plugin.prestart_error = None  # the plugin recovers; the kubelet's next try succeeds
    await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=10)
    prestarts = plugin.calls("PreStartContainer")
    assert len(prestarts) >= 2
    assert len(plugin.calls("Allocate")) == 1  # admission is not repeated: the same devices are kept
    ids = sorted(sim.allocated_device_ids(pod["metadata"]["uid"], "a", GPU))
    assert all(sorted(c.request.devices_ids) == ids for c in prestarts)


async def test_init_container_reuse_pool(make_plugin, sim) -> None:
    plugin = await make_plugin(count=4)
    manifest = pod_manifest(
        "p",
        [ctr("app", {GPU: 1})],
        init=[ctr("init1", {GPU: 1}), ctr("init2", {GPU: 2})],
    )
    pod = await sim.create_pod(manifest)
    running = await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
    uid = pod["metadata"]["uid"]
    init1 = set(sim.allocated_device_ids(uid, "init1", GPU))
    init2 = set(sim.allocated_device_ids(uid, "init2", GPU))
    app = set(sim.allocated_device_ids(uid, "app", GPU))
    assert init1 <= init2 and app <= init2
    assert len(init1) == 1 and len(init2) == 2 and len(app) == 1
    # The same device went to Allocate twice: once for an init container, once for the app.
    sent = allocate_ids(plugin)
    assert len(sent) == 3
    assert set(sent[2]) <= set(sent[1])
    inits = running["status"]["initContainerStatuses"]
    assert [s["name"] for s in inits] == ["init1", "init2"]
    assert all(s["state"]["terminated"]["exitCode"] == 0 for s in inits)


async def test_sidecar_and_apps_get_dedicated_devices(make_plugin, sim) -> None:
    await make_plugin(count=4)
    manifest = pod_manifest(
        "p", [ctr("app1", {GPU: 1}), ctr("app2", {GPU: 1})],
        init=[ctr("init", {GPU: 2}), ctr("side", {GPU: 1}, sidecar=True)],
    )
    pod = await sim.create_pod(manifest)
    await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
    uid = pod["metadata"]["uid"]
    init = set(sim.allocated_device_ids(uid, "init", GPU))
    side = set(sim.allocated_device_ids(uid, "side", GPU))
    app1 = set(sim.allocated_device_ids(uid, "app1", GPU))
    app2 = set(sim.allocated_device_ids(uid, "app2", GPU))
    # The sidecar takes from the pool and keeps its device, the first app takes the rest of the
    # pool, the second needs a fresh one: nobody shares with anybody but the init container.
    assert side | app1 == init
    assert len(side | app1 | app2) == 3 and not app2 & init


async def test_insufficient_devices_rejects_pod(make_plugin, sim) -> None:
    plugin = await make_plugin(count=2)
    await sim.create_pod(pod_manifest("big", [ctr("a", {GPU: 3})]))
    pod = await sim.wait_for_pod("default", "big", phase_is("Failed"), timeout=5)
    assert pod["status"]["reason"] == "UnexpectedAdmissionError"
    assert pod["status"]["message"] == (
        "Pod was rejected: Allocate failed due to requested number of devices unavailable for "
        "example.com/gpu. Requested: 3, Available: 2, which is unexpected"
    )
    assert plugin.calls("Allocate") == []


async def test_unregistered_resource_rejects_pod(sim) -> None:
    # Not a device-plugin resource at all: the kubelet ignores it (no device manager involvement).
    await sim.create_pod(pod_manifest("p", [ctr("a", {"other.com/thing": 1})]))
    await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)


async def test_no_healthy_devices_fails_even_zero_quantity(make_plugin, sim) -> None:
    plugin = await make_plugin(count=1)
    plugin.set_health("dev0", "Unhealthy")
    await sim.wait_for_resource(GPU, 0, timeout=5)
    await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 0})]))
    pod = await sim.wait_for_pod("default", "p", phase_is("Failed"), timeout=5)
    expected = "no healthy devices present; cannot allocate unhealthy devices example.com/gpu"
    assert expected in pod["status"]["message"]


async def test_plugin_allocate_error_fails_pod_and_rolls_back(make_plugin, sim) -> None:
    plugin = await make_plugin(count=2)
    plugin.allocate_error = "boom"
    await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 2})]))
    pod = await sim.wait_for_pod("default", "p", phase_is("Failed"), timeout=5)
    assert pod["status"]["message"] == (
        "Pod was rejected: Allocate failed due to rpc error: code = Unknown desc = boom, which is unexpected"
    )
    # Rolled back: the next pod gets both devices without any GC.
    plugin.allocate_error = None
    await sim.create_pod(pod_manifest("q", [ctr("a", {GPU: 2})]))
    await sim.wait_for_pod("default", "q", phase_is("Running"), timeout=5)


async def test_empty_allocate_response_fails_pod(make_plugin, sim) -> None:
    plugin = await make_plugin(count=2)
    plugin.allocate_empty = True
    await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 1})]))
    pod = await sim.wait_for_pod("default", "p", phase_is("Failed"), timeout=5)
    assert "no containers return in allocation response" in pod["status"]["message"]


async def test_later_container_failure_stops_admission(make_plugin, sim) -> None:
    plugin = await make_plugin(count=2)
    await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 1}), ctr("b", {GPU: 5}), ctr("c", {GPU: 1})]))
    await sim.wait_for_pod("default", "p", phase_is("Failed"), timeout=5)
    assert len(plugin.calls("Allocate")) == 1  # a only; c never tried


async def test_allocate_watchdog(make_plugin, sim_config, plugin_dir) -> None:
    sim_config.allocate_timeout = 0.3
    async with NodeSimulator(sim_config) as sim:
        plugin = FakePlugin(sim_config.device_plugin_dir, count=1)
        await plugin.start()
        try:
            await plugin.register()
            await sim.wait_for_resource(GPU, 1, timeout=5)
            plugin.allocate_delay = 5
            await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 1})]))
            pod = await sim.wait_for_pod("default", "p", phase_is("Failed"), timeout=5)
            assert "Allocate did not return within 0.3s" in pod["status"]["message"]
        finally:
            await plugin.stop()


async def test_gc_reclaims_deleted_pod_only_at_next_allocation(make_plugin, sim) -> None:
    await make_plugin(count=2)
    first = await sim.create_pod(pod_manifest("p1", [ctr("a", {GPU: 2})]))
    await sim.wait_for_pod("default", "p1", phase_is("Running"), timeout=5)
    await sim.delete_pod("default", "p1")
    assert sim.get_pod("default", "p1") is None
    uid = first["metadata"]["uid"]
    # Nothing reclaims on a timer: the allocation is still on record.
    await asyncio.sleep(0.1)
    assert sim.allocated_device_ids(uid, "a", GPU)
    await sim.create_pod(pod_manifest("p2", [ctr("a", {GPU: 2})]))
    await sim.wait_for_pod("default", "p2", phase_is("Running"), timeout=5)
    assert sim.allocated_device_ids(uid, "a", GPU) == []


async def test_finished_pod_releases_devices(make_plugin, sim) -> None:
    await make_plugin(count=1)
    await sim.create_pod(pod_manifest("p1", [ctr("a", {GPU: 1})]))
    await sim.wait_for_pod("default", "p1", phase_is("Running"), timeout=5)
    await sim.create_pod(pod_manifest("p2", [ctr("a", {GPU: 1})]))
    await sim.wait_for_pod("default", "p2", phase_is("Failed"), timeout=5)
    # A Succeeded pod is no longer active: its device goes at the next allocation.
    done = await sim.set_pod_phase("default", "p1", "Succeeded")
    state = done["status"]["containerStatuses"][0]["state"]
    assert state["terminated"]["exitCode"] == 0 and done["status"]["phase"] == "Succeeded"
    await sim.create_pod(pod_manifest("p3", [ctr("a", {GPU: 1})]))
    await sim.wait_for_pod("default", "p3", phase_is("Running"), timeout=5)


async def test_admission_is_serial_in_creation_order(make_plugin, sim) -> None:
    plugin = await make_plugin(count=8)
    plugin.allocate_delay = 0.05
    for i in range(4):
        await sim.create_pod(pod_manifest(f"p{i}", [ctr("a", {GPU: 1}), ctr("b", {GPU: 1})]))
    for i in range(4):
        await sim.wait_for_pod("default", f"p{i}", phase_is("Running"), timeout=5)
    calls = [c for c in sim.calls if c.method == "Allocate"]
    assert len(calls) == 8
    for earlier, later in itertools.pairwise(calls):
        assert earlier.end is not None and earlier.end <= later.start  # never overlapping
    uids = [sim.get_pod("default", f"p{i}")["metadata"]["uid"] for i in range(4)]
    order = []
    for call in calls:
        ids = call.request["container_requests"][0]["devices_ids"]
        owner = next(u for u in uids if ids == sim.allocated_device_ids(u, "a", GPU)
                     or ids == sim.allocated_device_ids(u, "b", GPU))
        order.append(uids.index(owner))
    assert order == sorted(order)


async def test_preferred_allocation_arguments(make_plugin, sim) -> None:
    plugin = await make_plugin(count=4, get_preferred_allocation_available=True)
    plugin.preferred = lambda req: sorted(req.available_deviceIDs)[-int(req.allocation_size):]
    manifest = pod_manifest("p", [ctr("app", {GPU: 3})], init=[ctr("init", {GPU: 1})])
    pod = await sim.create_pod(manifest)
    await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
    prefs = plugin.calls("GetPreferredAllocation")
    assert len(prefs) == 2
    first = prefs[0].request.container_requests[0]
    assert sorted(first.available_deviceIDs) == ["dev0", "dev1", "dev2", "dev3"]
    assert list(first.must_include_deviceIDs) == [] and first.allocation_size == 1
    uid = pod["metadata"]["uid"]
    init = sim.allocated_device_ids(uid, "init", GPU)
    assert init == ["dev3"]  # the plugin's preference was used
    second = prefs[1].request.container_requests[0]
    # available = free + reused, must_include = reused, size = the container's whole request.
    assert sorted(second.available_deviceIDs) == ["dev0", "dev1", "dev2", "dev3"]
    assert list(second.must_include_deviceIDs) == ["dev3"] and second.allocation_size == 3
    app = sim.allocated_device_ids(uid, "app", GPU)
    assert sorted(app) == ["dev1", "dev2", "dev3"]


async def test_run_options_merge_first_wins(make_plugin, sim) -> None:
    def response(tag: str):
        def build(ids: list[str]) -> dp.ContainerAllocateResponse:
            return dp.ContainerAllocateResponse(
                envs={"SHARED": tag, f"ONLY_{tag}": "1"},
                mounts=[dp.Mount(container_path="/shared", host_path=f"/host/{tag}", read_only=True)],
                devices=[
                    dp.DeviceSpec(container_path=f"/dev/{tag}", host_path=f"/dev/{tag}", permissions="rwm")
                ],
                annotations={"shared": tag},
                cdi_devices=[dp.CDIDevice(name="vendor.com/class=common"),
                             dp.CDIDevice(name=f"vendor.com/class={tag}")],
            )
        return build

    a = await make_plugin("a.com/x", count=1)
    b = await make_plugin("b.com/x", count=1)
    a.allocate_response, b.allocate_response = response("a"), response("b")
    await sim.create_pod(pod_manifest("p", [ctr("c", {"a.com/x": 1, "b.com/x": 1})]))
    await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
    opts = sim.container_run_options("default", "p", "c")
    winner = opts["envs"]["SHARED"]
    assert winner in ("a", "b")
    assert opts["envs"]["ONLY_a"] == opts["envs"]["ONLY_b"] == "1"
    assert opts["mounts"] == [
        {"container_path": "/shared", "host_path": f"/host/{winner}", "read_only": True}
    ]
    assert opts["annotations"] == {"shared": winner}
    assert len(opts["devices"]) == 2
    assert sorted(opts["cdi_devices"]) == [
        "vendor.com/class=a", "vendor.com/class=b", "vendor.com/class=common"
    ]


async def test_seed_makes_device_choice_reproducible(plugin_dir) -> None:
    chosen = []
    for run in range(2):
        cfg = SimConfig(device_plugin_dir=plugin_dir / f"dp{run}", seed=42, write_checkpoint=False)
        async with NodeSimulator(cfg) as sim:
            plugin = FakePlugin(cfg.device_plugin_dir, count=8)
            await plugin.start()
            try:
                await plugin.register()
                await sim.wait_for_resource(GPU, 8, timeout=5)
                pod = await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 3}), ctr("b", {GPU: 2})]))
                await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
                uid = pod["metadata"]["uid"]
                chosen.append(
                    (sim.allocated_device_ids(uid, "a", GPU), sim.allocated_device_ids(uid, "b", GPU))
                )
            finally:
                await plugin.stop()
    assert chosen[0] == chosen[1]


async def test_numa_hint_prefers_aligned_devices(plugin_dir) -> None:
    cfg = SimConfig(device_plugin_dir=plugin_dir / "dp", seed=3, numa_hint=lambda pod, c: {1})
    async with NodeSimulator(cfg) as sim:
        plugin = FakePlugin(cfg.device_plugin_dir)
        plugin.devices = [device("n0a", numa=[0]), device("n0b", numa=[0]), device("n1a", numa=[1]),
                          device("n1b", numa=[1]), device("none")]
        await plugin.start()
        try:
            await plugin.register()
            await sim.wait_for_resource(GPU, 5, timeout=5)
            pod = await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 3})]))
            await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
            ids = sim.allocated_device_ids(pod["metadata"]["uid"], "a", GPU)
            assert {"n1a", "n1b"} <= set(ids) and "none" not in ids
        finally:
            await plugin.stop()
