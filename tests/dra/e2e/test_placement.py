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


def _predicated(name: str, cores: int, idx: str) -> dict:
    """A share pod as the scheduler extender (gpu-admission) leaves it: its GPU number for container 0."""
    return gpu_pod(name, ("main", cores, 2), annotations={
        "tencent.com/predicate-time": "1700000000000000000", "tencent.com/gpu-assigned": "false",
        "tencent.com/predicate-gpu-idx-0": idx})


async def test_the_scheduler_extender_numbers_only_device_plugin_gpus(dra_node: DraNode) -> None:
    # gpu-admission sees 200 vcuda-core (GPUs 2 and 3; 0 and 1 are DRA's) and numbers them 0 and 1:
    # its GPU 0 is GPU 2, its GPU 1 is GPU 3, and a DRA GPU is never the one it offers.
    node = dra_node
    for name, idx, index in (("x0", "0", 2), ("x1", "1", 3)):
        pod = await node.run_pod(_predicated(name, 30, idx))
        assert pod["status"]["phase"] == "Running", pod["status"]
        (alloc,) = [a for a in (await node.snapshot()).allocations if a.pod_name == name]
        assert [s.index for s in alloc.shares] == [index]
        annotated = await node.sim.wait_for_pod("default", name, lambda p: p["metadata"]["annotations"].get(
            "tencent.com/gpu-assigned") == "true", 15)
        assert annotated["metadata"]["annotations"]["tencent.com/predicate-gpu-idx-0"] == idx  # its numbering

    # A number beyond the device-plugin GPUs names no GPU of the extender's: refused, saying why.
    pod = await node.run_pod(_predicated("x2", 30, "2"))
    assert pod["status"]["phase"] == "Failed", pod["status"]
    assert "the extender numbers its 2 device-plugin GPU(s) 0..1" in pod["status"]["message"]
