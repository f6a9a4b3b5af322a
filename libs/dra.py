"""The DRA driver's names and the ResourceClaim view it works from, shared by services and simulator.

One driver name, one pool per node (named after the node), one device per GPU (``gpu-<index>``)
with two consumable capacities: ``cores`` (0-100 of the GPU) and ``memory`` (bytes). A claim's
allocation result names (pool, device, shareID, consumedCapacity) per request; ``claim_view`` reads a
``resource.k8s.io/v1`` ResourceClaim (standard JSON, as the API server or the simulator serves it at
``claim_path``) into the few fields the node side needs. Pure: no I/O.
"""

from __future__ import annotations

import re

import msgspec

from libs.kube.pods import parse_quantity

__all__ = [
    "CAPACITY_CORES",
    "CAPACITY_MEMORY",
    "DRIVER_NAME",
    "PLUGIN_TYPE",
    "SUPPORTED_VERSIONS",
    "ClaimDevice",
    "ClaimView",
    "claim_path",
    "claim_view",
    "device_index",
    "device_name",
    "pool_name",
]

DRIVER_NAME = "gpu.gpuledger.io"
PLUGIN_TYPE = "DRAPlugin"
# Service names listed in PluginInfo.supported_versions; the kubelet picks the newest it speaks.
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
CAPACITY_CORES = "cores"
CAPACITY_MEMORY = "memory"
RESOURCE_API = "/apis/resource.k8s.io/v1"

_DEVICE = re.compile(r"gpu-(0|[1-9][0-9]{0,3})")


def pool_name(node: str) -> str:
    """The node's pool: one per node, named after it."""
    return node


def device_name(index: int) -> str:
    """The ResourceSlice device name of the GPU at this NVML index (a DNS label)."""
    return f"gpu-{index}"


def device_index(name: str) -> int:
    """The NVML index a device name stands for; ValueError for a name not ours."""
    m = _DEVICE.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not a {DRIVER_NAME} device name (gpu-<index>)")
    return int(m.group(1))


def claim_path(namespace: str, name: str = "") -> str:
    """``/apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims[/<name>]`` (list without a name)."""
    base = f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims"
    return f"{base}/{name}" if name else base


class ClaimDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One allocation result of ours: a request served by one device, maybe a share of it."""

    request: str
    pool: str
    device: str
    share_id: str = ""      # set for consumable-capacity shares
    cores: int = 100        # consumedCapacity.cores; a whole device when absent
    memory: int = 0         # consumedCapacity.memory in bytes; 0 = the whole GPU's memory


class ClaimView(msgspec.Struct, frozen=True, kw_only=True):
    uid: str
    namespace: str
    name: str
    allocated: bool
    devices: tuple[ClaimDevice, ...]    # this driver's results only
    reserved_pods: tuple[str, ...]      # pod UIDs in status.reservedFor
    reserved_names: tuple[str, ...] = ()  # their names, in the same order


def claim_view(obj: dict, driver: str = DRIVER_NAME) -> ClaimView:
    """The node-relevant part of a ResourceClaim object; ValueError when it is malformed."""
    if not isinstance(obj, dict):
        raise ValueError("a ResourceClaim must be a JSON object")
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    allocation = status.get("allocation")
    devices = []
    results = ((allocation or {}).get("devices") or {}).get("results") or []
    for res in results:
        if res.get("driver") != driver:
            continue
        consumed = res.get("consumedCapacity") or {}
        try:
            cores = int(parse_quantity(consumed[CAPACITY_CORES])) if CAPACITY_CORES in consumed else 100
            memory = int(parse_quantity(consumed[CAPACITY_MEMORY])) if CAPACITY_MEMORY in consumed else 0
        except (TypeError, ValueError) as exc:
            raise ValueError(f"claim {meta.get('name')}: bad consumedCapacity {consumed}: {exc}") from exc
        devices.append(ClaimDevice(
            request=str(res.get("request", "")), pool=str(res.get("pool", "")),
            device=str(res.get("device", "")), share_id=str(res.get("shareID") or ""),
            cores=cores, memory=memory,
        ))
    pods = [r for r in status.get("reservedFor") or [] if r.get("resource") == "pods" and r.get("uid")]
    reserved = tuple(str(r["uid"]) for r in pods)
    return ClaimView(
        uid=str(meta.get("uid", "")), namespace=str(meta.get("namespace", "")), name=str(meta.get("name", "")),
        allocated=allocation is not None, devices=tuple(devices), reserved_pods=reserved,
        reserved_names=tuple(str(r.get("name", "")) for r in pods),
    )
