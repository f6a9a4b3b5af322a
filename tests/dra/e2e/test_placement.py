"""Where claims land: a whole GPU, two NVLink-connected GPUs (DGX A100 profile) or none on a PCIe node,
and claims beside device-plugin pods on one node, each GPU in one mode, never overcommitted."""

from __future__ import annotations

from collections import defaultdict

from libs.dra import DRIVER_NAME
from libs.ledger.state import CLAIM_PREFIX
from tests.builders import gpu_pod
from tests.dra.e2e.helpers import DraNode, claim_pod


async def test_whole_gpu_claim_and_no_nvlink_pair_on_a_pcie_node(dra_node: DraNode) -> None:
    node = dra_node
    pod = await node.run_pod(claim_pod("whole", "gpu-whole"))
    assert pod["status"]["phase"] == "Running", pod["status"]
    claim_uid = node.claim_of("whole")["metadata"]["uid"]
    grant = (await node.claim_grants())[claim_uid]
    (share,) = grant.shares
    device = {d["name"]: d for d in node.sim.dra_objects.slices.list()[0]["spec"]["devices"]}[f"gpu-{share.index}"]
    assert (share.index in (0, 1), share.cores, share.memory) == (True, 100, int(device["capacity"]["memory"]["value"]))
    opts = node.sim.container_run_options("default", "whole", "main")
    assert opts["envs"]["NVIDIA_VISIBLE_DEVICES"] == share.uuid

    # The PCIe profile has no NVLink: the pair's selector matches no device, so the pod is never bound.
    created = await node.sim.create_pod(claim_pod("pair", "gpu-nvlink-pair"))
    assert not created["spec"].get("nodeName")
    (cond,) = created["status"]["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("PodScheduled", "False", "Unschedulable")
    assert node.prepared_uids() == [claim_uid]


async def test_two_nvlink_gpus_in_one_claim(dgx_node: DraNode) -> None:
    node = dgx_node
    pod = await node.run_pod(claim_pod("pair", "gpu-nvlink-pair"))
    assert pod["status"]["phase"] == "Running", pod["status"]
    claim = node.claim_of("pair")
    results = claim["status"]["allocation"]["devices"]["results"]
    assert [r["driver"] for r in results] == [DRIVER_NAME] * 2
    slice_devices = {d["name"]: d for d in node.sim.dra_objects.slices.list()[0]["spec"]["devices"]}
    first, second = (slice_devices[r["device"]]["attributes"] for r in results)
    assert first["nvlinkDomain"] == second["nvlinkDomain"] != {"string": ""}
    assert str(second["index"]["int"]) in first["nvlinkPeers"]["string"].split(",")

    grant = (await node.claim_grants())[claim["metadata"]["uid"]]
    assert sorted((s.index, s.cores) for s in grant.shares) == sorted(
        (int(r["device"].removeprefix("gpu-")), 100) for r in results)
    opts = node.sim.container_run_options("default", "pair", "main")
    assert sorted(opts["envs"]["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(s.uuid for s in grant.shares)
    nodes = {d["container_path"] for d in opts["devices"]}
    assert {f"/dev/nvidia{s.minor}" for s in grant.shares} <= nodes


async def test_claims_and_device_plugin_pods_on_one_node_never_overcommit(dra_node: DraNode) -> None:
    node = dra_node
    node.sim.dra_objects.templates.create({"metadata": {"name": "big", "namespace": "default"}, "spec": {"spec": {
        "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER_NAME, "capacity": {
            "requests": {"cores": "60", "memory": "1Gi"}}}}]}}}})
    for name in ("c1", "c2"):
        pod = await node.run_pod(claim_pod(name, "big"))
        assert pod["status"]["phase"] == "Running", pod["status"]
    for name in ("d1", "d2"):
        pod = await node.run_pod(gpu_pod(name, ("main", 100, 0)))
        assert pod["status"]["phase"] == "Running", pod["status"]

    # Full in both modes: a third claim is not schedulable (60 + 60 > 100 on each DRA GPU), a third
    # device-plugin pod is rejected (the device plugin advertises GPUs 2 and 3 only).
    third = await node.sim.create_pod(claim_pod("c3", "big"))
    assert third["status"]["conditions"][0]["reason"] == "Unschedulable"
    rejected = await node.run_pod(gpu_pod("d3", ("main", 100, 0)))
    assert rejected["status"]["phase"] == "Failed", rejected["status"]

    snap = await node.snapshot()
    cores: dict[int, int] = defaultdict(int)
    modes: dict[int, set[str]] = defaultdict(set)
    for alloc in snap.allocations:
        for share in alloc.shares:
            cores[share.index] += share.cores
            modes[share.index].add("dra" if alloc.alloc_id.startswith(CLAIM_PREFIX) else "device-plugin")
    assert all(c <= 100 for c in cores.values()), cores
    assert dict(modes) == {0: {"dra"}, 1: {"dra"}, 2: {"device-plugin"}, 3: {"device-plugin"}}
    assert len(set(node.prepared_uids())) == 2
