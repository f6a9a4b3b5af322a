"""Pods with spec.resourceClaims in the simulator: claims made from templates, allocated from the node's
slices (consumable capacity), reserved for the pod, the pod bound; an unschedulable pod waits and is
scheduled once capacity comes back."""

from __future__ import annotations

from pathlib import Path

from libs.dra import DRIVER_NAME
from libs.dra_objects import device_class, node_slice
from libs.events.schema import InventoryRecorded
from libs.gpu.fake import FakeBackend
from tests.builders import phase_is
from tests.polling import eventually

PROFILE = Path(__file__).resolve().parents[2] / "libs" / "gpu" / "profiles" / "pcie-4gpu.yaml"


def share_template(name: str, cores: str) -> dict:
    return {"metadata": {"name": name, "namespace": "default"}, "spec": {"spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": DRIVER_NAME, "capacity": {"requests": {
            "cores": cores, "memory": "1Gi"}}}}]}}}}


def claim_pod(name: str, template: str) -> dict:
    return {"metadata": {"name": name, "namespace": "default"}, "spec": {
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        "containers": [{"name": "main", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}]}}


async def test_claims_from_templates_share_gpus_without_overcommit(sim) -> None:
    found = FakeBackend(PROFILE).inventory()
    inv = InventoryRecorded(node=sim.cfg.node_name, backend="fake", gpus=found.gpus[:1], links=())
    objects = sim.dra_objects
    objects.classes.create(device_class())
    objects.slices.create(node_slice(inv, inv.gpus, 1))
    objects.templates.create(share_template("big", "60"))

    first = await sim.create_pod(claim_pod("p1", "big"))
    assert first["spec"]["nodeName"] == sim.cfg.node_name
    await sim.wait_for_pod("default", "p1", phase_is("Running"), timeout=5)
    (claim,) = objects.claims.list()
    assert claim["metadata"]["name"].startswith("p1-gpu-")
    result = claim["status"]["allocation"]["devices"]["results"][0]
    assert result["device"] == "gpu-0" and result["consumedCapacity"]["cores"] == "60" and result["shareID"]
    assert claim["status"]["reservedFor"] == [{"resource": "pods", "name": "p1", "uid": first["metadata"]["uid"]}]
    pod = sim.get_pod("default", "p1")
    assert pod["status"]["resourceClaimStatuses"] == [{"name": "gpu", "resourceClaimName": claim["metadata"]["name"]}]

    # 60 + 60 > 100 cores on the only GPU: the second pod stays Pending, Unschedulable, unbound.
    second = await sim.create_pod(claim_pod("p2", "big"))
    assert not second["spec"].get("nodeName")
    cond = second["status"]["conditions"][0]
    assert (cond["type"], cond["status"], cond["reason"]) == ("PodScheduled", "False", "Unschedulable")

    await sim.delete_pod("default", "p1")
    await eventually(lambda: len(objects.claims.list()) == 1, timeout=5, interval=0.05,
                     what="p1's claim deleted with its reservation")
    await sim.wait_for_pod("default", "p2", phase_is("Running"), timeout=5)
    (left,) = objects.claims.list()
    assert left["metadata"]["name"].startswith("p2-gpu-")
