"""The allocator's request handlers: the only code that appends to the allocation log.

Every change follows the same order: decide under the lock, append the event (durable when append
returns), fold it into the in-memory state, then answer. A reply therefore never promises anything
the log does not hold, and replaying the log rebuilds exactly the state the replies described.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid

from libs.bus.client import Bus
from libs.commands import (
    AllocateReply,
    AllocateRequest,
    InventoryReply,
    InventoryRequest,
    PodsReply,
    PodsRequest,
    PrepareReply,
    PrepareRequest,
    PreStartReply,
    PreStartRequest,
    ReleaseReply,
    ReleaseRequest,
    StateReply,
    StateRequest,
)
from libs.config import MEMORY_BLOCK, Settings
from libs.errors import BusError, ServiceError
from libs.events.codec import StoredEvent
from libs.events.schema import AllocationGranted, AllocationRefused, AllocationReleased, Event
from libs.kube.pods import ANNOTATION_CORE_LIMIT, RESOURCE_VCORE, Pod
from libs.ledger.state import Allocation, LedgerState
from libs.log import get_logger
from libs.store.log import EventLog
from services.allocator.hami import HamiDelivery
from services.allocator.matching import Candidate, find_candidate
from services.allocator.placement import place
from services.allocator.responses import build_response

__all__ = ["Allocator"]

_VCORE_ID = re.compile(r"^tencent\.com/vcuda-core-(\d+)$")
_log = get_logger("allocator")


class Allocator:
    def __init__(self, settings: Settings, log: EventLog, state: LedgerState, bus: Bus) -> None:
        self.settings = settings
        self.log = log
        self.state = state
        self.bus = bus
        self.lock = asyncio.Lock()

    async def serve(self) -> None:
        s = self.bus.subjects
        await self.bus.serve(s.allocate, AllocateRequest, self.allocate)
        await self.bus.serve(s.prestart, PreStartRequest, self.prestart)
        await self.bus.serve(s.release, ReleaseRequest, self.release)
        await self.bus.serve(s.inventory, InventoryRequest, self.inventory)
        await self.bus.serve(s.state, StateRequest, self.snapshot)

    async def _append(self, events: list[Event], *, command_id: str | None = None) -> list[StoredEvent]:
        stored = await self.log.append(events, command_id=command_id)
        for ev in stored:
            self.state.apply(ev)
        return stored

    # --- Allocate ---
    async def allocate(self, req: AllocateRequest) -> AllocateReply:
        try:
            return await self._allocate(req)
        except ServiceError as exc:
            await self._refuse(req, exc.message)
            raise

    async def _allocate(self, req: AllocateRequest) -> AllocateReply:
        self._check_devices(req.resource, req.device_ids)
        earlier = next((a for a in self.state.allocations.values() if a.request_id == req.request_id), None)
        if earlier is not None:  # a retried request whose reply was lost
            return _reply(earlier)
        deadline = req.deadline or time.time() + self.settings.allocate_timeout
        cores = len(req.device_ids)
        # First the watchdog's cache; on a miss at once the API server itself (the kubelet admits a
        # pod as soon as it sees it, often before the watch event reaches the watchdog); then the
        # same with growing pauses until the kubelet's deadline.
        delay, fresh = 0.0, False
        while True:
            try:
                pods = await self._pending_pods(fresh=fresh)
            except ServiceError as exc:
                unavailable: ServiceError | None = exc  # the watchdog may still be starting: retry in time
            else:
                unavailable = None
                async with self.lock:
                    candidate = find_candidate(pods, self.state, cores)
                    if candidate is not None:
                        return await self._grant(req, candidate, deadline)
            # The pod may not have reached the watchdog's cache yet: ask the API server directly next.
            if time.time() + delay > deadline - 0.5:
                raise unavailable or ServiceError(
                    404, f"candidate pod not found for request of {cores} vcuda-core, allocation failed")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5) if delay else (0.05 if fresh else 0.0)
            fresh = True

    async def _grant(self, req: AllocateRequest, cand: Candidate, deadline: float) -> AllocateReply:
        pod, container = cand.pod, cand.container
        cores = len(req.device_ids)
        memory = container.vmemory * MEMORY_BLOCK
        links = self.state.inventory.links if self.state.inventory else ()
        shares = place(list(self.state.gpus.values()), links, cores=cores, memory=memory,
                       share_mode=self.settings.share_mode)
        response = build_response(
            shares=shares, cores=cores, memory=memory, pod_uid=pod.uid,
            vm_root=self.settings.vm_root, vdriver_root=self.settings.vdriver_root,
            compat32=(container.env_value("compat32") or "").lower() == "true",
            hami=HamiDelivery.from_settings(self.settings), container=container.name,
        )
        if time.time() > deadline:
            raise ServiceError(504, "the kubelet's deadline passed before the grant could be recorded")
        event = AllocationGranted(
            alloc_id=uuid.uuid4().hex, request_id=req.request_id,
            pod_uid=pod.uid, namespace=pod.metadata.namespace, pod_name=pod.metadata.name,
            container=container.name, container_index=cand.index, init_container=cand.init,
            cores=cores, memory=memory, device_ids=tuple(req.device_ids), shares=shares,
            core_limit=_core_limit(pod), response=response,
        )
        stored = await self._append([event], command_id=req.request_id)
        granted = self.state.allocations[stored[0].event.alloc_id]  # type: ignore[union-attr]
        _log.info("granted", pod=pod.key, container=container.name, cores=cores, memory=memory,
                  gpus=[s.index for s in shares], seq=stored[0].seq, request_id=req.request_id)
        return _reply(granted)

    async def _refuse(self, req: AllocateRequest, reason: str) -> None:
        _log.warning("allocate refused", reason=reason, request_id=req.request_id, devices=len(req.device_ids))
        event = AllocationRefused(request_id=req.request_id, resource=req.resource,
                                  device_count=len(req.device_ids), reason=reason)
        try:
            async with self.lock:
                await self._append([event])
        except Exception as exc:  # the refusal is still answered; only its record is lost
            _log.error("could not record a refusal", error=str(exc))

    async def _pending_pods(self, *, fresh: bool) -> list[Pod]:
        try:
            reply = await self.bus.request(
                self.bus.subjects.pods, PodsRequest(phase="Pending", fresh=fresh), PodsReply,
                timeout=min(self.settings.request_timeout, self.settings.allocate_timeout / 2),
            )
        except BusError as exc:
            raise ServiceError(503, f"cannot list the node's pending pods from the watchdog: {exc}") from exc
        return reply.pods

    def _check_devices(self, resource: str, device_ids: list[str]) -> None:
        if resource != RESOURCE_VCORE:
            raise ServiceError(400, f"the allocator places {RESOURCE_VCORE} only, not {resource!r}")
        if not device_ids:
            raise ServiceError(400, "no device IDs in the request")
        if len(set(device_ids)) != len(device_ids):
            raise ServiceError(400, "duplicate device IDs in the request")
        capacity = 100 * len(self.state.gpus)
        for dev in device_ids:
            m = _VCORE_ID.match(dev)
            if not m or int(m.group(1)) >= capacity:
                raise ServiceError(400, f"device ID {dev!r} was never advertised by this node")

    # --- PreStartContainer ---
    async def prestart(self, req: PreStartRequest) -> PreStartReply:
        self._check_devices(req.resource, req.device_ids)
        alloc = self.state.find_by_devices(req.device_ids)
        if alloc is None:
            raise ServiceError(404, (
                "PreStartContainer check failed, no allocation holds these "
                f"{len(req.device_ids)} {RESOURCE_VCORE} devices"
            ))
        try:
            prepared = await self.bus.request(
                self.bus.subjects.prepare, PrepareRequest(pod_uid=alloc.pod_uid, alloc_seq=alloc.granted_seq),
                PrepareReply, timeout=self.settings.request_timeout,
            )
        except BusError as exc:
            raise ServiceError(503, f"failed to setup VCuda for pod {alloc.pod_uid}: {exc}") from exc
        return PreStartReply(alloc_id=alloc.alloc_id, pod_uid=alloc.pod_uid, container=alloc.container,
                             vcuda_socket=prepared.socket)

    # --- release, queries ---
    async def release(self, req: ReleaseRequest) -> ReleaseReply:
        async with self.lock:
            held = self.state.pod_allocations(req.pod_uid)
            if not held:
                return ReleaseReply(released=[])
            events: list[Event] = [
                AllocationReleased(alloc_id=a.alloc_id, pod_uid=a.pod_uid, container=a.container, reason=req.reason)
                for a in held
            ]
            await self._append(events)
        _log.info("released", pod_uid=req.pod_uid, reason=req.reason, allocations=len(held))
        return ReleaseReply(released=[a.alloc_id for a in held])

    async def inventory(self, _req: InventoryRequest) -> InventoryReply:
        if self.state.inventory is None:
            raise ServiceError(503, "no GPU inventory recorded yet")
        return InventoryReply(inventory=self.state.inventory, share_mode=self.settings.share_mode)

    async def snapshot(self, _req: StateRequest) -> StateReply:
        return StateReply(snapshot=self.state.snapshot())


def _reply(alloc: Allocation) -> AllocateReply:
    return AllocateReply(alloc_id=alloc.alloc_id, pod_uid=alloc.pod_uid, namespace=alloc.namespace,
                         pod_name=alloc.pod_name, container=alloc.container, response=alloc.response)


def _core_limit(pod: Pod) -> int | None:
    raw = pod.metadata.annotations.get(ANNOTATION_CORE_LIMIT)
    if raw is None:
        return None
    try:
        return max(0, min(int(raw), 100))
    except ValueError:
        return None
