"""The ``resource.k8s.io/v1`` objects the DRA driver publishes: its node's ResourceSlice and DeviceClass.

One device per DRA-mode GPU (``gpu-<index>``, in the node's pool), shareable through consumable
capacity (KEP-5075): ``allowMultipleAllocations`` and two capacities with request policies,

* ``cores``: 100, requests 1..100 in steps of 1, default 100 (a request that names no cores gets
  the whole GPU's compute);
* ``memory``: the GPU's bytes, requests in 256 MiB steps (what ``tencent.com/vcuda-memory`` counts
  in), default the whole memory.

So a claim that asks for no capacity is a whole GPU, and one asking ``cores: 30, memory: 4Gi`` is a
share; the scheduler does the accounting and the ledger enforces it on the node.

Attributes (driver domain): ``uuid``, ``index``, ``model``, ``memory`` (bytes), ``driverVersion``,
``pciBusID``, ``nvlinkPeers`` (the indexes this GPU has NVLinks to, comma-separated) and
``nvlinkDomain`` (the NVLink-connected set it belongs to, so a ``matchAttribute`` constraint on it
keeps several GPUs of one claim on one NVLink fabric), plus the standard
``resource.kubernetes.io/pcieRoot`` shared by GPUs behind the same PCIe root (PIX/PXB links).
An unhealthy GPU carries the taint ``gpu.gpuledger.io/unhealthy`` with effect ``NoSchedule``
(KEP-5055): new claims avoid it, running ones are not evicted (the watchdog decides about those).
Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from libs.config import MEMORY_BLOCK
from libs.dra import CAPACITY_CORES, CAPACITY_MEMORY, DRIVER_NAME, device_name, pool_name
from libs.events.schema import GpuInfo, InventoryRecorded
from libs.gpu.topology import nvlink_count

__all__ = [
    "API_VERSION",
    "UNHEALTHY_TAINT",
    "device_class",
    "gpu_device",
    "node_slice",
    "slice_name",
]

API_VERSION = "resource.k8s.io/v1"
UNHEALTHY_TAINT = f"{DRIVER_NAME}/unhealthy"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
_SAME_ROOT = ("PIX", "PXB")


def _components(size: int, linked: Any) -> list[int]:
    """For each GPU position the smallest position of its connected set under ``linked(i, j)``."""
    root = list(range(size))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for i in range(size):
        for j in range(i + 1, size):
            if linked(i, j):
                a, b = find(i), find(j)
                root[max(a, b)] = min(a, b)
    return [find(i) for i in range(size)]


def _pcie_root(gpu: GpuInfo) -> str:
    domain, _, rest = gpu.pci_bus_id.partition(":")
    bus = rest.partition(":")[0]
    return f"pci{domain[-4:].lower()}:{bus.lower()}" if domain and bus else ""


def gpu_device(inventory: InventoryRecorded, position: int, *, unhealthy: str | None = None,
               taint_time: str = "") -> dict[str, Any]:
    """The slice device of the inventory's GPU at ``position``; ``unhealthy``: the reason, when it is."""
    gpus = inventory.gpus
    gpu = gpus[position]
    links = inventory.links
    token = (lambda i, j: links[i][j]) if links else (lambda i, j: "")
    peers = [gpus[j].index for j in range(len(gpus)) if j != position and nvlink_count(token(position, j))]
    nv_sets = _components(len(gpus), lambda i, j: nvlink_count(token(i, j)) > 0)
    pcie_sets = _components(len(gpus), lambda i, j: token(i, j) in _SAME_ROOT)
    attributes: dict[str, Any] = {
        "uuid": {"string": gpu.uuid},
        "index": {"int": gpu.index},
        "model": {"string": gpu.name},
        "memory": {"int": gpu.memory},
        "driverVersion": {"string": inventory.driver_version},
        "pciBusID": {"string": gpu.pci_bus_id},
        "nvlinkPeers": {"string": ",".join(str(p) for p in peers)},
        "nvlinkDomain": {"string": f"nvl-{gpus[nv_sets[position]].index}" if peers else ""},
    }
    root = _pcie_root(gpus[pcie_sets[position]])
    if root:
        attributes[PCIE_ROOT] = {"string": root}
    device: dict[str, Any] = {
        "name": device_name(gpu.index),
        "attributes": attributes,
        "capacity": {
            CAPACITY_CORES: {"value": "100", "requestPolicy": {
                "default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}},
            CAPACITY_MEMORY: {"value": str(gpu.memory), "requestPolicy": {
                "default": str(gpu.memory),
                "validRange": {"min": str(MEMORY_BLOCK), "max": str(gpu.memory), "step": str(MEMORY_BLOCK)}}},
        },
        "allowMultipleAllocations": True,
    }
    if unhealthy is not None:
        taint = {"key": UNHEALTHY_TAINT, "value": unhealthy[:63] or "unhealthy", "effect": "NoSchedule"}
        if taint_time:
            taint["timeAdded"] = taint_time
        device["taints"] = [taint]
    return device


def slice_name(node: str) -> str:
    return f"{node}-{DRIVER_NAME}"


def node_slice(inventory: InventoryRecorded, dra_gpus: tuple[GpuInfo, ...], generation: int, *,
               unhealthy: dict[str, str] | None = None, taint_time: str = "") -> dict[str, Any]:
    """The node's one ResourceSlice: a device for each DRA-mode GPU (``unhealthy``: uuid -> reason)."""
    unhealthy = unhealthy or {}
    chosen = {g.uuid for g in dra_gpus}
    devices = [gpu_device(inventory, pos, unhealthy=unhealthy.get(g.uuid), taint_time=taint_time)
               for pos, g in enumerate(inventory.gpus) if g.uuid in chosen]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(inventory.node),
                     "labels": {"app.kubernetes.io/name": "gpuledger", "gpuledger.io/node": inventory.node}},
        "spec": {
            "driver": DRIVER_NAME,
            "nodeName": inventory.node,
            "pool": {"name": pool_name(inventory.node), "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def device_class(name: str = DRIVER_NAME) -> dict[str, Any]:
    """The DeviceClass selecting every device of our driver."""
    return {
        "apiVersion": API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER_NAME}"'}}]},
    }
