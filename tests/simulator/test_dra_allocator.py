"""The simulator's structured-parameters allocator, with CEL selectors evaluated by cel-python, on the
slices our driver publishes (libs/dra_objects.py) for fake topologies."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.dra import DRIVER_NAME
from libs.dra_objects import device_class, node_slice
from libs.events.schema import InventoryRecorded
from libs.gpu.fake import FakeBackend
from simulator.dra.allocator import AllocationFailed, allocate
from simulator.dra.cel import CelError, device_activation, matches

PROFILES = Path(__file__).resolve().parents[2] / "libs" / "gpu" / "profiles"
NODE = "n1"
GiB = 2**30


def inventory(profile: str) -> InventoryRecorded:
    found = FakeBackend(PROFILES / f"{profile}.yaml").inventory()
    return InventoryRecorded(node=NODE, backend="fake", driver_version=found.driver_version, gpus=found.gpus,
                             links=found.links)


def slices(profile: str = "dgx-a100-8gpu", *, unhealthy: dict[str, str] | None = None) -> list[dict]:
    inv = inventory(profile)
    return [node_slice(inv, inv.gpus, 1, unhealthy=unhealthy)]


CLASSES = {DRIVER_NAME: device_class()}


def claim(*requests: dict, constraints: list | None = None) -> dict:
    spec: dict = {"devices": {"requests": list(requests)}}
    if constraints:
        spec["devices"]["constraints"] = constraints
    return {"metadata": {"name": "c", "namespace": "default", "uid": "u"}, "spec": spec}


def req(name: str = "gpu", *, count: int = 1, capacity: dict | None = None, selectors: list[str] = (),
        **extra) -> dict:
    exactly: dict = {"deviceClassName": DRIVER_NAME, "count": count, **extra}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return {"name": name, "exactly": exactly}


def as_allocated(allocation: dict) -> dict:
    return {"status": {"allocation": allocation}}


def test_share_rounds_memory_up_to_256mib_steps_and_gets_a_share_id() -> None:
    got = allocate(claim(req(capacity={"cores": "30", "memory": "1000Mi"})), CLASSES, slices(), [], NODE)
    (result,) = got["devices"]["results"]
    assert result["device"] == "gpu-0" and result["driver"] == DRIVER_NAME and result["pool"] == NODE
    assert result["consumedCapacity"] == {"cores": "30", "memory": "1Gi"}  # 1000 MiB -> 4 x 256 MiB
    assert result["shareID"]
    assert got["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [NODE]


def test_a_share_without_memory_takes_the_whole_memory_by_default() -> None:
    allocated: list[dict] = []
    devices = []
    for _ in range(4):
        got = allocate(claim(req(capacity={"cores": "40"})), CLASSES, slices("pcie-4gpu"), allocated, NODE)
        allocated.append(as_allocated(got))
        devices.append(got["devices"]["results"][0]["device"])
    # Cores would fit twice per GPU, but memory's default is the whole GPU: one such share per GPU.
    assert devices == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    with pytest.raises(AllocationFailed, match="cannot allocate all claims"):
        allocate(claim(req(capacity={"cores": "40"})), CLASSES, slices("pcie-4gpu"), allocated, NODE)


def test_consumable_accounting_never_overcommits_cores_or_memory() -> None:
    allocated: list[dict] = []
    for _ in range(40):
        try:
            got = allocate(claim(req(capacity={"cores": "35", "memory": "10Gi"})), CLASSES, slices(), allocated, NODE)
        except AllocationFailed:
            break
        allocated.append(as_allocated(got))
    per_device: dict[str, list[int]] = {}
    for a in allocated:
        r = a["status"]["allocation"]["devices"]["results"][0]
        per_device.setdefault(r["device"], []).append(int(r["consumedCapacity"]["cores"]))
    assert len(allocated) == 16  # 8 GPUs x two 35-core shares (a third would be 105)
    assert all(sum(v) <= 100 for v in per_device.values())


def test_whole_gpu_claim_takes_all_capacity_and_excludes_shares() -> None:
    whole = allocate(claim(req()), CLASSES, slices("pcie-4gpu"), [], NODE)
    r = whole["devices"]["results"][0]
    assert r["consumedCapacity"]["cores"] == "100"
    # Asking for more than the policy's max is not a match on any device.
    with pytest.raises(AllocationFailed, match="cannot allocate"):
        allocate(claim(req(capacity={"cores": "101"})), CLASSES, slices("pcie-4gpu"), [], NODE)
    got = allocate(claim(req(capacity={"cores": "1"})), CLASSES, slices("pcie-4gpu"), [as_allocated(whole)], NODE)
    assert got["devices"]["results"][0]["device"] != r["device"]


def test_two_nvlink_gpus_through_match_attribute() -> None:
    two = claim(req(count=2), constraints=[{"matchAttribute": f"{DRIVER_NAME}/nvlinkDomain"}])
    got = allocate(two, CLASSES, slices("dgx-a100-8gpu"), [], NODE)
    assert [r["device"] for r in got["devices"]["results"]] == ["gpu-0", "gpu-1"]
    # A PCIe box has no NVLink: the attribute is empty there, and the constraint cannot be met.
    no_nvlink = claim(req(count=2, selectors=[f'device.attributes["{DRIVER_NAME}"].nvlinkDomain != ""']),
                      constraints=[{"matchAttribute": f"{DRIVER_NAME}/nvlinkDomain"}])
    with pytest.raises(AllocationFailed):
        allocate(no_nvlink, CLASSES, slices("pcie-4gpu"), [], NODE)


def test_cel_selectors_on_attributes_and_capacity() -> None:
    sel = [f'device.attributes["{DRIVER_NAME}"].index >= 6',
           f'device.capacity["{DRIVER_NAME}"].memory.compareTo(quantity("40Gi")) >= 0']
    got = allocate(claim(req(selectors=sel)), CLASSES, slices(), [], NODE)
    assert got["devices"]["results"][0]["device"] == "gpu-6"
    with pytest.raises(AllocationFailed, match="invalid CEL"):
        allocate(claim(req(selectors=["device.driver =="])), CLASSES, slices(), [], NODE)
    with pytest.raises(CelError):
        matches("42", device_activation(DRIVER_NAME, {"name": "gpu-0"}))


def test_a_tainted_gpu_is_skipped_unless_tolerated() -> None:
    inv = inventory("pcie-4gpu")
    tainted = slices("pcie-4gpu", unhealthy={inv.gpus[0].uuid: "xid-79"})
    assert tainted[0]["spec"]["devices"][0]["taints"][0]["effect"] == "NoSchedule"
    got = allocate(claim(req()), CLASSES, tainted, [], NODE)
    assert got["devices"]["results"][0]["device"] == "gpu-1"
    tolerant = req(tolerations=[{"key": f"{DRIVER_NAME}/unhealthy", "operator": "Exists"}])
    assert allocate(claim(tolerant), CLASSES, tainted, [], NODE)["devices"]["results"][0]["device"] == "gpu-0"


def test_unknown_class_and_other_nodes_slices() -> None:
    bad = {"name": "x", "exactly": {"deviceClassName": "nope"}}
    with pytest.raises(AllocationFailed, match="device class 'nope' does not exist"):
        allocate(claim(bad), CLASSES, slices(), [], NODE)
    with pytest.raises(AllocationFailed):
        allocate(claim(req()), CLASSES, slices(), [], "another-node")
