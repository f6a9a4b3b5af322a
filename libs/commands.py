"""Request/reply messages between the services (the payloads of the ``<service>.<verb>`` subjects).

    registrar  --allocator.allocate-->  allocator   (kubelet Allocate for vcore)
    registrar  ==allocator.kubelet-list==> allocator (the kubelet's List the registrar asked at an Allocate)
    registrar  --allocator.prestart-->  allocator   --vmanager.prepare--> vmanager
    registrar  --allocator.inventory--> allocator   (what to advertise in ListAndWatch)
    watchdog   --allocator.release-->   allocator   (a pod is gone)
    allocator  --watchdog.pods-->       watchdog    (pending pods, for matching an Allocate to a pod)
    vmanager   --watchdog.pods-->       watchdog    (container id -> name)
    anyone     --allocator.state-->     allocator   (the folded state, for checks and tools)
    anyone     --allocator.archive-->   allocator   (move older events into archive segments)
    registrar  --allocator.claim-prepare-->   allocator  (DRA NodePrepareResources, one claim)
    registrar  --allocator.claim-unprepare--> allocator  (DRA NodeUnprepareResources; the watchdog's reconcile)
    anyone     --allocator.gpu-mode-->  allocator   (move idle GPUs between device plugin and DRA)
    watchdog   ==pod.<verb>==>          anyone      (pod lifecycle notifications, PodChanged)
"""

from __future__ import annotations

import msgspec

from libs.dra import ClaimView
from libs.events.schema import ContainerResponse, InventoryRecorded
from libs.kube.pods import Pod
from libs.kubelet.admission import AdmissionCheck
from libs.ledger.state import LedgerSnapshot, PreparedClaim

__all__ = [
    "AllocateReply",
    "AllocateRequest",
    "ArchiveReply",
    "ArchiveRequest",
    "ClaimDeviceResult",
    "ClaimPrepareReply",
    "ClaimPrepareRequest",
    "ClaimUnprepareReply",
    "ClaimUnprepareRequest",
    "GpuModeReply",
    "GpuModeRequest",
    "InventoryReply",
    "InventoryRequest",
    "KubeletListing",
    "PodChanged",
    "PodsReply",
    "PodsRequest",
    "PreStartReply",
    "PreStartRequest",
    "PrepareReply",
    "PrepareRequest",
    "ReleaseReply",
    "ReleaseRequest",
    "StateReply",
    "StateRequest",
    "WatchdogReady",
]


class AllocateRequest(msgspec.Struct, kw_only=True):
    request_id: str
    resource: str
    device_ids: list[str]
    deadline: float = 0.0  # unix seconds; past it the allocator must not commit (the kubelet gave up)
    # The registrar asked the kubelet's pod-resources List as the request came in and checks a grant
    # against it (AllocateReply.check): the allocator need not ask the kubelet itself to check one.
    check_admission: bool = False
    # A second request after the registrar's check failed: release this request's grant ``withdraw``
    # (the kubelet is not admitting its pod) and look on, with ``listing`` (the kubelet's List, as sent).
    withdraw: str = ""
    listing: bytes = b""


class AllocateReply(msgspec.Struct, kw_only=True):
    alloc_id: str
    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    response: ContainerResponse
    # Recorded before any List was read (``check_admission``): the registrar answers the kubelet only
    # once its List shows this pod being admitted, and otherwise asks again with ``withdraw``.
    check: AdmissionCheck | None = None


class KubeletListing(msgspec.Struct, kw_only=True):
    """The kubelet's List the registrar asked as an Allocate came in, sent on to the allocator as soon as
    it is answered (``allocator.kubelet-list``, core NATS): the allocator uses it when it needs the List
    itself, and settles earlier grants with it, as with a List of its own (when one is unsettled: else
    it drops it unread)."""

    request_id: str
    listing: bytes = b""  # the ListPodResourcesResponse as the kubelet sent it
    error: str = ""  # the List failed (then ``listing`` is empty)


class PreStartRequest(msgspec.Struct, kw_only=True):
    request_id: str
    resource: str
    device_ids: list[str]
    # Asked by the registrar ahead of the kubelet's call (services/registrar/prestart.py): when no
    # grant holds the devices (the pod went away meanwhile), say so without asking the kubelet.
    ahead: bool = False


class PreStartReply(msgspec.Struct, kw_only=True):
    """The allocator's check; the registrar asks the vmanager for the pod's vcuda.sock meanwhile
    (services/registrar/prestart.py) and fills ``vcuda_socket`` in."""

    alloc_id: str
    pod_uid: str
    container: str
    vcuda_socket: str = ""
    seq: int = 0  # the log as the check saw it: a vmanager that has folded this far serves the pod


class ReleaseRequest(msgspec.Struct, kw_only=True):
    pod_uid: str
    reason: str
    request_id: str = ""


class ReleaseReply(msgspec.Struct, kw_only=True):
    released: list[str]  # alloc ids; empty when the pod held nothing


class InventoryRequest(msgspec.Struct):
    pass


class InventoryReply(msgspec.Struct, kw_only=True):
    inventory: InventoryRecorded
    share_mode: bool
    dra_gpus: list[int] = []   # indexes served by the DRA driver: never advertised to the device plugin


class ClaimPrepareRequest(msgspec.Struct, kw_only=True):
    """One claim of a NodePrepareResources, as read from the API server by the registrar."""

    claim: ClaimView
    deadline: float = 0.0      # unix seconds; past it the allocator must not commit


class ClaimDeviceResult(msgspec.Struct, kw_only=True):
    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]
    share_id: str = ""


class ClaimPrepareReply(msgspec.Struct, kw_only=True):
    claim_uid: str
    pod_uid: str
    devices: list[ClaimDeviceResult]
    response: ContainerResponse  # what the CDI spec carries
    seq: int                     # the claim.prepared event (an earlier one when already prepared)
    already: bool = False        # idempotent repeat: nothing new recorded


class ClaimUnprepareRequest(msgspec.Struct, kw_only=True):
    claim_uid: str
    reason: str = "unprepared"   # unprepared | reconcile: claim gone | reconcile: not reserved ...


class ClaimUnprepareReply(msgspec.Struct, kw_only=True):
    released: bool               # False: it was not prepared (an idempotent repeat)


class GpuModeRequest(msgspec.Struct, kw_only=True):
    gpus: list[str]              # indexes or UUIDs
    mode: str                    # dra | device-plugin


class GpuModeReply(msgspec.Struct, kw_only=True):
    changed: list[int]           # indexes whose mode changed (the others already were)


class ArchiveRequest(msgspec.Struct, kw_only=True):
    """Archive the events recorded before ``before`` (unix ns) and/or all but the newest ``keep_events``
    (both given: the fewer); 0 = that bound is not given, and one of them must be."""

    before: int = 0
    keep_events: int = 0


class ArchiveReply(msgspec.Struct, kw_only=True):
    archived: int            # events moved into the new segment (0: nothing to archive)
    file: str = ""           # the new segment's file name, in <state-dir>/ledger.archive/
    first_seq: int = 0
    last_seq: int = 0
    live_first_seq: int = 0  # the live log now starts here
    note: str = ""           # why fewer events than asked were archived


class StateRequest(msgspec.Struct):
    pass


class StateReply(msgspec.Struct, kw_only=True):
    snapshot: LedgerSnapshot
    claims: list[PreparedClaim] = []  # the prepared DRA claims' ResourceClaims (the watchdog reconciles them)


class PodsRequest(msgspec.Struct, kw_only=True):
    uid: str = ""          # one pod by uid; empty: every pod on the node
    phase: str = ""        # filter by status.phase
    fresh: bool = False    # list from the API server instead of the watch cache
    # One pod by namespace and name (both given): with ``fresh``, one GET from the API server (not a
    # LIST of the node's pods); the pod is answered only while it is bound to this node.
    namespace: str = ""
    name: str = ""


class PodsReply(msgspec.Struct, kw_only=True):
    pods: list[Pod]


class PrepareRequest(msgspec.Struct, kw_only=True):
    pod_uid: str = ""
    alloc_seq: int = 0  # the grant's seq: the vmanager waits until it has folded at least this far
    # Instead of ``pod_uid``: a grant's vcore device IDs, as PreStartContainer names them. The pod is
    # the one that holds them in the log the vmanager has folded so far (no wait: 404 when none does).
    device_ids: list[str] = []


class PrepareReply(msgspec.Struct, kw_only=True):
    directory: str
    socket: str
    pod_uid: str = ""  # the pod served


class PodChanged(msgspec.Struct, kw_only=True):
    """Published by the watchdog on ``gpuledger.<node>.pod.<added|updated|deleted>`` (core NATS)."""

    kind: str  # ADDED | MODIFIED | DELETED
    pod: Pod


class WatchdogReady(msgspec.Struct, kw_only=True):
    """Published by the watchdog on ``gpuledger.<node>.watchdog.ready`` (core NATS) when it answers
    ``watchdog.pods`` again: at its start and each time its broker connection comes back."""

    cause: str  # start | reconnect
