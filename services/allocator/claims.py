"""DRA claims on the allocator's ledger: prepare = a grant, unprepare = a release, like an Allocate.

The registrar reads the ResourceClaim (the scheduler's allocation result: device, shareID, consumed
capacity; the pods in reservedFor) and sends it here; the decision runs under the ledger's lock
against the same folded state the device plugin's Allocate uses, and the ``claim.prepared`` event is
durable before the reply. Refused, with the reason: a claim not allocated by our driver or not
reserved for a pod, a device that is not ours or whose GPU the device plugin serves, a stale prepare
(the claim was unprepared and no new pod reserved it since), and any result that would overcommit a
GPU (cores over 100 or memory over the GPU's, counting device-plugin grants and other claims).
Both calls are idempotent: a prepared claim is answered from the state, an absent one unprepares
to nothing.
"""

from __future__ import annotations

import time

from libs.bus import Bus
from libs.cdi import device_id
from libs.commands import (
    ClaimDeviceResult,
    ClaimPrepareReply,
    ClaimPrepareRequest,
    ClaimUnprepareReply,
    ClaimUnprepareRequest,
    GpuModeReply,
    GpuModeRequest,
)
from libs.config import Settings
from libs.dra import ClaimView, device_index, pool_name
from libs.errors import ServiceError
from libs.events.schema import ClaimPrepared, ClaimUnprepared, Event, GpuModeChanged, GpuShare
from libs.ledger.state import MODE_DEVICE_PLUGIN, MODE_DRA, Allocation, LedgerState, claim_alloc_id
from libs.logger import get_logger
from libs.placement.recorded import ResponseSettings, reproduce
from services.allocator.ledger import Ledger

__all__ = ["ClaimHandlers", "apply_mode_setting", "parse_gpu_list"]

_logger = get_logger("allocator")
MODES = (MODE_DEVICE_PLUGIN, MODE_DRA)


def parse_gpu_list(spec: str, state: LedgerState) -> list[int]:
    """``dra_gpus``: "" (none), "all", or indexes / UUIDs, comma-separated -> NVML indexes."""
    spec = spec.strip()
    if not spec:
        return []
    if spec == "all":
        return sorted(state.gpus)
    return sorted({_gpu_index(item.strip(), state) for item in spec.split(",") if item.strip()})


def _gpu_index(item: str, state: LedgerState) -> int:
    for gpu in state.gpus.values():
        if item == gpu.uuid or (item.isdigit() and int(item) == gpu.index):
            return gpu.index
    raise ServiceError(400, f"no GPU {item!r} on this node (give NVML indexes or UUIDs)")


def _mode_events(state: LedgerState, indexes: list[int], mode: str, reason: str) -> list[Event]:
    """The gpu.mode events that move these GPUs to ``mode``; refused when one of them is busy."""
    if mode not in MODES:
        raise ServiceError(400, f"mode {mode!r} is neither of {', '.join(MODES)}")
    events: list[Event] = []
    busy = []
    for index in indexes:
        gpu = state.gpus[index]
        if gpu.mode == mode:
            continue
        if not gpu.idle:
            busy.append(f"GPU{index} holds {len(gpu.alloc_ids)} allocation(s) under {gpu.mode}")
            continue
        events.append(GpuModeChanged(index=index, uuid=gpu.uuid, mode=mode, reason=reason))
    if busy:
        raise ServiceError(409, "a busy GPU cannot change mode (drain it first): " + "; ".join(busy))
    return events


async def apply_mode_setting(ledger: Ledger, spec: str) -> None:
    """At start: make the ledger's GPU modes what ``dra_gpus`` says. A busy GPU keeps its mode (an
    error in the log, not a failed start: its pods keep running and the change waits for a restart)."""
    state = ledger.state
    wanted = set(parse_gpu_list(spec, state))
    for index in sorted(state.gpus):
        mode = MODE_DRA if index in wanted else MODE_DEVICE_PLUGIN
        try:
            await ledger.record(lambda s, i=index, m=mode: _mode_events(s, [i], m, "setting"))
        except ServiceError as exc:
            _logger.error("GPU mode not changed", gpu=index, wanted=mode, error=exc.message)


class ClaimHandlers:
    def __init__(self, settings: Settings, ledger: Ledger, bus: Bus, *, responses: ResponseSettings) -> None:
        self.settings = settings
        self.ledger = ledger
        self.bus = bus
        self.responses = responses  # what the node's grants are built with: a claim gets the same form

    @property
    def state(self) -> LedgerState:
        return self.ledger.state

    async def serve(self) -> None:
        s = self.bus.subjects
        await self.bus.serve(s.claim_prepare, ClaimPrepareRequest, self.prepare)
        await self.bus.serve(s.claim_unprepare, ClaimUnprepareRequest, self.unprepare)
        await self.bus.serve(s.gpu_mode, GpuModeRequest, self.gpu_mode)

    # --- NodePrepareResources, one claim ---
    async def prepare(self, req: ClaimPrepareRequest) -> ClaimPrepareReply:
        claim = req.claim
        alloc_id = claim_alloc_id(claim.uid)
        seen: dict[str, int] = {}

        def decide(state: LedgerState) -> list[Event]:
            held = state.allocations.get(alloc_id)
            if held is not None:
                seen["seq"] = held.granted_seq
                return []  # prepared already: the same answer again
            event = self._grant(state, claim)
            if req.deadline and time.time() > req.deadline:
                raise ServiceError(504, "the kubelet's deadline passed before the claim could be recorded")
            return [event]

        stored = await self.ledger.record(decide, command_id=f"claim:{claim.uid}")
        alloc = self.state.allocations[alloc_id]
        if stored:
            _logger.info("claim prepared", claim=f"{claim.namespace}/{claim.name}", claim_uid=claim.uid,
                         pod_uid=alloc.pod_uid, cores=alloc.cores, memory=alloc.memory,
                         gpus=[s.index for s in alloc.shares], seq=stored[0].seq)
        return self._reply(claim, alloc, seq=stored[0].seq if stored else seen["seq"], already=not stored)

    def _grant(self, state: LedgerState, claim: ClaimView) -> ClaimPrepared:
        name = f"{claim.namespace}/{claim.name}"
        if not claim.allocated or not claim.devices:
            raise ServiceError(409, f"claim {name} has no allocation result for this driver")
        if not claim.reserved_pods:
            raise ServiceError(409, f"claim {name} is not reserved for any pod")
        if state.stale_prepare(claim.uid, claim.reserved_pods):
            raise ServiceError(409, (
                f"stale prepare refused: claim {name} (uid {claim.uid}) was already unprepared and is "
                "reserved for no new pod since"))
        node_pool = pool_name(self.settings.node_name)
        per_gpu: dict[int, list[int]] = {}
        for dev in claim.devices:
            if dev.pool != node_pool:
                raise ServiceError(409, f"claim {name}: device {dev.pool}/{dev.device} is in another pool than "
                                        f"this node's ({node_pool})")
            try:
                index = device_index(dev.device)
            except ValueError as exc:
                raise ServiceError(409, f"claim {name}: {exc}") from None
            gpu = state.gpus.get(index)
            if gpu is None:
                raise ServiceError(409, f"claim {name}: no GPU {index} on this node")
            if gpu.mode != MODE_DRA:
                raise ServiceError(409, f"claim {name}: GPU{index} is served by the device plugin, not by DRA")
            if not gpu.healthy:
                raise ServiceError(409, f"claim {name}: GPU{index} is unhealthy ({gpu.health_reason})")
            if not 1 <= dev.cores <= 100:
                raise ServiceError(400, f"claim {name}: {dev.cores} cores of GPU{index} is outside 1-100")
            memory = dev.memory or gpu.memory_total
            wanted = per_gpu.setdefault(index, [0, 0])
            wanted[0] += dev.cores
            wanted[1] += memory
        shares = []
        for index, (cores, memory) in sorted(per_gpu.items()):
            gpu = state.gpus[index]
            if gpu.cores_used + cores > 100 or gpu.memory_used + memory > gpu.memory_total:
                raise ServiceError(409, (
                    f"claim {name} would overcommit GPU{index}: {cores} cores + {gpu.cores_used} held of 100, "
                    f"{memory} bytes + {gpu.memory_used} held of {gpu.memory_total} "
                    f"({len(gpu.alloc_ids)} grant(s), device-plugin and DRA)"))
            shares.append(GpuShare(index=index, uuid=gpu.uuid, minor=gpu.minor, cores=cores, memory=memory))
        cores = sum(s.cores for s in shares)
        memory = sum(s.memory for s in shares)
        pod_uid = claim.reserved_pods[0]
        # The vcuda directory is the claim's own (<vm_root>/<claim uid>), not a pod's: the CDI spec is
        # per claim, so every pod sharing the claim mounts it, and its gate admits each of them.
        # The node's response settings, as for a grant: its delivery form and its --extra-config devices.
        response = reproduce(
            self.responses, shares=tuple(shares), cores=min(cores, 100) if len(shares) == 1 else 100 * len(shares),
            memory=memory, pod_uid=claim.uid, container=claim.name,
        )
        return ClaimPrepared(
            alloc_id=claim_alloc_id(claim.uid), request_id=f"dra:{claim.uid}", pod_uid=pod_uid,
            namespace=claim.namespace, pod_name=claim.reserved_names[0] if claim.reserved_names else "",
            container="", container_index=-1, cores=cores, memory=memory, device_ids=(), shares=tuple(shares),
            response=response, claim_uid=claim.uid, claim_namespace=claim.namespace, claim_name=claim.name,
            share_ids=tuple(d.share_id for d in claim.devices), request_names=tuple(d.request for d in claim.devices),
            reserved_pods=claim.reserved_pods, cdi_device_ids=(device_id(claim.uid),),
        )

    def _reply(self, claim: ClaimView, alloc: Allocation, *, seq: int, already: bool) -> ClaimPrepareReply:
        cdi = [device_id(claim.uid)]
        devices = [
            ClaimDeviceResult(request_names=[d.request], pool_name=d.pool, device_name=d.device,
                              cdi_device_ids=cdi, share_id=d.share_id)
            for d in claim.devices
        ]
        return ClaimPrepareReply(claim_uid=claim.uid, pod_uid=alloc.pod_uid, devices=devices,
                                 response=alloc.response, seq=seq, already=already)

    # --- NodeUnprepareResources, one claim ---
    async def unprepare(self, req: ClaimUnprepareRequest) -> ClaimUnprepareReply:
        alloc_id = claim_alloc_id(req.claim_uid)

        def decide(state: LedgerState) -> list[Event]:
            held = state.allocations.get(alloc_id)
            if held is None:
                return []  # not prepared (or unprepared already): nothing to do
            return [ClaimUnprepared(alloc_id=alloc_id, pod_uid=held.pod_uid, container="", reason=req.reason,
                                    claim_uid=req.claim_uid,
                                    reserved_pods=state.claim_pods.get(req.claim_uid, (held.pod_uid,)))]

        stored = await self.ledger.record(decide, command_id=f"unclaim:{req.claim_uid}")
        if stored:
            _logger.info("claim unprepared", claim_uid=req.claim_uid, reason=req.reason, seq=stored[0].seq)
        return ClaimUnprepareReply(released=bool(stored))

    # --- moving GPUs between the device plugin and DRA ---
    async def gpu_mode(self, req: GpuModeRequest) -> GpuModeReply:
        indexes = sorted({_gpu_index(g, self.state) for g in req.gpus})
        stored = await self.ledger.record(lambda s: _mode_events(s, indexes, req.mode, "command"))
        return GpuModeReply(changed=[ev.event.index for ev in stored])  # type: ignore[union-attr]
