"""Every event the allocation log can hold: one msgspec Struct per type, one tagged union.

Rules (they keep old logs readable, see eventlog-and-bus.md section 4.6):
- the tag (``type``) is a stable ``<domain>.<verb>`` name, never a Python path; it is also the NATS
  subject suffix the event is published under;
- ``SCHEMA`` is the payload version of that type; a breaking change bumps it and registers an
  upcaster in ``codec.py``; new fields only with defaults; never change a field's type;
- events are frozen and hold no reference cycles (``gc=False`` makes replay ~5x faster).
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

__all__ = [
    "EVENT_TYPES",
    "AllocationCorrected",
    "AllocationGranted",
    "AllocationImported",
    "AllocationRefused",
    "AllocationReleased",
    "AnyEvent",
    "ClaimPrepared",
    "ClaimUnprepared",
    "ContainerResponse",
    "DeviceNode",
    "Event",
    "GpuHealthChanged",
    "GpuInfo",
    "GpuModeChanged",
    "GpuShare",
    "InventoryRecorded",
    "MountSpec",
]


class GpuInfo(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    index: int              # NVML index
    minor: int              # /dev/nvidia<minor>
    uuid: str
    pci_bus_id: str = ""
    memory: int             # total bytes
    name: str = ""


class GpuShare(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """The part of one GPU an allocation holds."""

    index: int
    uuid: str
    minor: int
    cores: int   # 0..100 of this GPU
    memory: int  # bytes of this GPU


class DeviceNode(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    container_path: str
    host_path: str
    permissions: str = "rwm"


class MountSpec(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    container_path: str
    host_path: str
    read_only: bool = True


class ContainerResponse(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """What the kubelet hands to the runtime for one container (ContainerAllocateResponse)."""

    envs: dict[str, str] = {}
    mounts: tuple[MountSpec, ...] = ()
    devices: tuple[DeviceNode, ...] = ()
    annotations: dict[str, str] = {}


class Event(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag_field="type"):
    SCHEMA: ClassVar[int] = 1

    def stream(self) -> str:
        """The aggregate this event belongs to; events of one stream get versions 1, 2, 3..."""
        raise NotImplementedError


class InventoryRecorded(Event, tag="inventory.recorded", kw_only=True):
    """The node's GPUs as the allocator saw them at start (recorded again only when they change)."""

    node: str
    backend: str                       # nvml | fake
    driver_version: str = ""
    gpus: tuple[GpuInfo, ...]
    # links[i][j]: nvidia-smi topo tokens between GPU i and j: X, PIX, PXB, PHB, NODE, SYS, NV<n>
    links: tuple[tuple[str, ...], ...] = ()

    def stream(self) -> str:
        return "inventory"


class AllocationGranted(Event, tag="alloc.granted", kw_only=True):
    """A container was given GPU shares; recorded before the kubelet is answered.

    The log stores it compact (``libs.store.compact``, body version 2 in the ``schema_v`` column: no
    response, device IDs as runs); every reader, and the JSON record (still schema 1: its fields did not
    change), gets these fields, the response reproduced byte for byte."""

    alloc_id: str
    request_id: str
    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    container_index: int            # index within spec.containers (or spec.initContainers)
    init_container: bool = False
    cores: int                      # tencent.com/vcuda-core units (100 = one GPU)
    memory: int                     # bytes (tencent.com/vcuda-memory blocks x 256 MiB)
    device_ids: tuple[str, ...]     # the kubelet's vcore device IDs for this container
    shares: tuple[GpuShare, ...]
    core_limit: int | None = None   # tencent.com/vcuda-core-limit at grant time (soft limit)
    response: ContainerResponse

    def stream(self) -> str:
        return f"pod:{self.pod_uid}"


class AllocationImported(AllocationGranted, tag="alloc.imported", kw_only=True):
    """A grant taken over from gpu-manager's checkpoint by ``gpuledger import-checkpoint``.

    It is an ``AllocationGranted`` (every fold that handles grants handles it), whose fields the
    checkpoint does not hold are empty: ``namespace``/``pod_name`` (only the pod UID is known),
    ``device_ids`` (unless the kubelet's own checkpoint was given too), ``container_index`` = -1.
    ``response`` is the one gpu-manager would have returned; ``request_id`` is
    ``import:<pod uid>/<container>``.
    """

    source: str                     # the checkpoint file it came from

    def stream(self) -> str:
        return f"pod:{self.pod_uid}"


class AllocationReleased(Event, tag="alloc.released", kw_only=True):
    """A container's shares went back to the free pool."""

    alloc_id: str
    pod_uid: str
    container: str
    reason: str                     # deleted | succeeded | failed | reconcile | ...

    def stream(self) -> str:
        return f"pod:{self.pod_uid}"


class AllocationRefused(Event, tag="alloc.refused", kw_only=True):
    """An Allocate was answered with an error; kept so an operator can see why a pod failed."""

    request_id: str
    resource: str
    device_count: int
    reason: str
    pod_uid: str = ""
    namespace: str = ""
    pod_name: str = ""
    container: str = ""

    def stream(self) -> str:
        return f"pod:{self.pod_uid}" if self.pod_uid else "refusals"


# GPU health.
class GpuHealthChanged(Event, tag="gpu.health", kw_only=True):
    """A GPU became unhealthy (a critical XID or ECC event, a failing NVML query) or recovered.

    Only transitions are recorded: a second critical event on an already unhealthy GPU is logged by the
    allocator but not appended. Placement skips unhealthy GPUs; the registrar advertises their
    device IDs as Unhealthy.
    """

    index: int
    uuid: str
    healthy: bool
    reason: str                     # xid | ecc-double-bit | ecc-single-bit | query-failed | recovered | ...
    xid: int = 0                    # the XID code, when reason is "xid"
    detail: str = ""

    def stream(self) -> str:
        return f"gpu:{self.uuid}"


class AllocationCorrected(Event, tag="alloc.corrected", kw_only=True):
    """The kubelet's pod-resources API showed that a grant's device IDs belong to another pod or
    container than the allocator guessed at Allocate: the grant now belongs to that container, with
    its limits. The kubelet device IDs and the cores stay; memory, shares and response follow the
    real owner. Stored compact, as ``AllocationGranted``."""

    alloc_id: str
    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    container_index: int
    init_container: bool = False
    memory: int                     # bytes, from the real owner's spec
    shares: tuple[GpuShare, ...]
    core_limit: int | None = None
    response: ContainerResponse
    previous_pod_uid: str
    previous_container: str
    reason: str = "pod-resources"   # where the truth came from: pod-resources at prestart | reconcile

    def stream(self) -> str:
        return f"pod:{self.pod_uid}"


# DRA claims: a prepared claim IS a grant (every fold, view, audit and metric that handles grants handles
# it), with the claim's identity on top; an unprepare IS a release. Their own tags give them their own
# NATS subjects (claim.prepared / claim.unprepared) and make them stand out in ``events``/``history``.
class ClaimPrepared(AllocationGranted, tag="claim.prepared", kw_only=True):
    """A DRA ResourceClaim was prepared on this node (NodePrepareResources); recorded before the kubelet
    is answered. ``alloc_id`` is ``claim:<claim uid>``; ``pod_uid`` the first pod the claim is reserved
    for (whose vcuda.sock serves it); ``container`` is empty (every container referencing the claim
    gets it); ``device_ids`` are empty (no kubelet vcore IDs); ``cores``/``memory`` the consumed
    capacity summed over the claim's GPUs."""

    claim_uid: str
    claim_namespace: str
    claim_name: str
    share_ids: tuple[str, ...] = ()          # the allocation result's shareIDs, one per device
    request_names: tuple[str, ...] = ()      # the claim's request names, one per device
    reserved_pods: tuple[str, ...] = ()      # pod UIDs in status.reservedFor at prepare time
    cdi_device_ids: tuple[str, ...] = ()     # what the kubelet was told to hand the runtime

    def stream(self) -> str:
        return f"claim:{self.claim_uid}"


class ClaimUnprepared(AllocationReleased, tag="claim.unprepared", kw_only=True):
    """A prepared claim was unprepared (NodeUnprepareResources), or released by the watchdog because its
    ResourceClaim is gone or no longer reserved for a live pod (``reason``). A later prepare of the same
    claim for no new pod is stale and refused."""

    claim_uid: str
    reserved_pods: tuple[str, ...] = ()      # the pods it was reserved for when prepared

    def stream(self) -> str:
        return f"claim:{self.claim_uid}"


class GpuModeChanged(Event, tag="gpu.mode", kw_only=True):
    """Which kubelet API serves a GPU: the device plugin (tencent.com/vcuda-core) or the DRA driver.
    Changed only while the GPU is idle, so a GPU's shares are always accounted under one mode."""

    index: int
    uuid: str
    mode: str                       # device-plugin | dra
    reason: str = "setting"         # setting | command

    def stream(self) -> str:
        return f"gpu:{self.uuid}"


AnyEvent = (
    InventoryRecorded | AllocationGranted | AllocationReleased | AllocationRefused | AllocationImported
    | AllocationCorrected | GpuHealthChanged | ClaimPrepared | ClaimUnprepared | GpuModeChanged
)

EVENT_TYPES: dict[str, type[Event]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (InventoryRecorded, AllocationGranted, AllocationReleased, AllocationRefused, AllocationImported,
                AllocationCorrected, GpuHealthChanged, ClaimPrepared, ClaimUnprepared, GpuModeChanged)
}
