"""Returning the GPU shares of pods that are gone, the moment they are gone, and repairing misses.

A pod stops holding its shares when it is deleted or reaches Succeeded/Failed (gpu-manager's
"active", gpu-manager-reference.md 4.1). gpu-manager only noticed at the next Allocate; here the watch
event itself triggers the release. A pod that failed admission is also deleted when a controller owns
it (4.3), so the controller makes a new one.

The periodic reconciliation (gpu-manager's checkAllocation, every ``--allocation-check-period``, and
once at start) compares the allocator's holders with a fresh list from the API server and with the
kubelet's pod-resources List, and repairs what was missed while a service was down: it releases the
shares of pods that are gone (reason ``reconcile: pod <deleted|succeeded|failed|terminated>``, as a
committed ``alloc.released`` event), deletes owned pods that failed admission, patches running pods
whose annotations disagree with the ledger, and keeps the node labels current. A stale cache must
never free a running pod's GPU, so a release needs the fresh list, and the kubelet's agreement when
its socket answers.

With the DRA driver on, a pass also releases the prepared claims whose ResourceClaim is gone or
reserved for no live pod (``services.watchdog.claims``). Claims are left out of everything else here:
a claim is not its first pod's grant (several pods may share it), and only ``claim.unprepared``
keeps the ledger's record of unprepared claims that refuses stale prepares.

A pass also runs as soon as something may have been missed, not at the next period: when the NATS
connection comes back (the broker was away), and, after a release or a pass that failed (the
allocator, the broker or the API server away), every ``RETRY_S`` until a pass succeeds, i.e. as soon
as they answer again. So pods deleted during an outage are released within seconds of recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from libs.bus.client import Bus
from libs.commands import (
    InventoryReply,
    InventoryRequest,
    PodChanged,
    ReleaseReply,
    ReleaseRequest,
    StateReply,
    StateRequest,
)
from libs.errors import BusError
from libs.kube.annotations import extender_indexes
from libs.kube.pods import RESOURCE_VCORE, Pod, is_active
from libs.kube.source import PodSource
from libs.ledger.state import CLAIM_PREFIX, Allocation
from libs.logger import bound, get_logger
from services.watchdog.admission import AdmissionCleanup, admission_failed
from services.watchdog.annotations import AnnotationRepair, left_to_the_allocator
from services.watchdog.claims import ClaimReconciler
from services.watchdog.kubeletpods import KubeletPods, KubeletView
from services.watchdog.labels import NodeLabeler

__all__ = ["Recycler", "Repairs", "notified_in_full"]

FIRST_PASS_RETRY_S = 0.25   # the first reconciliation's pause between tries, doubling...
FIRST_PASS_MAX_RETRY_S = 4.0  # ...up to this (never longer than the period)
RETRY_S = 1.0  # between later passes while one fails or a release could not be made

_logger = get_logger("watchdog")
_VERBS = {"ADDED": "added", "MODIFIED": "updated", "DELETED": "deleted"}


def notified_in_full(pod: Pod) -> bool:
    """Whether every change of ``pod`` is sent as a notification (``pod.updated``), or only its
    arrival and its deletion. The allocator, their only reader, follows a pod's changes when it may
    hold a grant: it asks for vcuda-core, or uses ResourceClaims (a claim's grant is held under its
    pod, whose phase tells when to release it). Of any other pod it needs only to know that it is
    there, under its name: the kubelet's List names every pod, and one the allocator does not know
    may be the one asking. Such a pod's status updates, most notifications on a node where most pods
    are not GPU pods, would cost the allocator a decode each for nothing. Neither the resources nor
    the claims of a pod can change once it is made."""
    return pod.wants_gpu or bool(pod.spec.resource_claims)


def _reason(pod: Pod | None) -> str:
    if pod is None:
        return "deleted"
    if pod.metadata.deletion_timestamp:
        return "deleted"  # the API's MODIFIED with deletionTimestamp comes before its DELETED
    if pod.status.phase in ("Succeeded", "Failed"):
        return pod.status.phase.lower()
    return "terminated"


@dataclass
class Repairs:
    """What one reconciliation pass did."""

    released: dict[str, str] = field(default_factory=dict)  # pod uid -> reason
    deferred: list[str] = field(default_factory=list)       # gone per the API, still running per the kubelet
    deleted: list[str] = field(default_factory=list)        # pod keys (failed admission, controller-owned)
    patched: list[str] = field(default_factory=list)        # pod keys whose annotations were repaired
    unrecorded: list[str] = field(default_factory=list)     # kubelet vcore assignments the ledger lacks
    claims_released: dict[str, str] = field(default_factory=dict)  # DRA claim uid -> reason
    labels_updated: bool = False

    def __bool__(self) -> bool:
        return bool(self.released or self.deleted or self.patched or self.unrecorded or self.claims_released
                    or self.labels_updated)


class Recycler:
    def __init__(self, bus: Bus, timeout: float, source: PodSource, *, admission: AdmissionCleanup | None = None,
                 annotations: AnnotationRepair | None = None, labeler: NodeLabeler | None = None,
                 kubelet: KubeletPods | None = None, claims: ClaimReconciler | None = None) -> None:
        self.bus = bus
        self.timeout = timeout
        self.source = source  # the recycler gets its changes: the composition root runs source.run(self.on_change)
        self.admission = admission
        self.annotations = annotations
        self.labeler = labeler
        self.kubelet = kubelet
        self.claims = claims  # the DRA driver's prepared claims, when it is on
        self.passes = 0  # finished reconciliation passes, for tests
        self._released: set[str] = set()  # pods already released, so MODIFIED events do not repeat it
        self._releasing: set[asyncio.Task[object]] = set()  # releases of pods gone or going, in flight
        self._kick = asyncio.Event()  # a pass is due now (see kick())
        self._retry = False           # a release failed since the last pass: retry passes until one works

    def kick(self) -> None:
        """Run a reconciliation pass now (e.g. the NATS connection is back), not at the next period."""
        self._kick.set()

    async def on_change(self, kind: str, old: Pod | None, new: Pod | None) -> None:
        pod = new or old
        assert pod is not None
        if kind != "MODIFIED" or notified_in_full(pod):
            await self.bus.publish(self.bus.subjects.pod_fact(_VERBS.get(kind, "updated")),
                                   PodChanged(kind=kind, pod=pod))
        if not pod.wants_gpu:
            return
        if kind == "DELETED":
            # Released already when it stopped (its MODIFIED came first): asking again would cost a
            # bus round trip that releases nothing. A release that failed took the pod out of
            # _released (a later pass retries), so DELETED releases it here.
            if pod.uid not in self._released:
                # Not awaited: the release costs the allocator a durable append, and the next event
                # (often the ADDED of the pod the kubelet is about to admit) must not wait behind it.
                self._in_background(self.release(pod.uid, "deleted"))
            self._released.discard(pod.uid)
            if self.admission is not None:
                self.admission.forget(pod.uid)
            return
        assert new is not None
        failed_admission = self.admission is not None and admission_failed(new)
        release = (failed_admission or not is_active(new)) and pod.uid not in self._released
        if release:
            self._released.add(pod.uid)  # at once: the pod's next events start no second release
        if release or failed_admission:
            # Not awaited either: a pod being deleted is MODIFIED, then DELETED, and the next pod's
            # ADDED waited ~10 ms behind this release in the Allocate benchmark (a refused deletion
            # is retried for up to 10 s).
            reason = f"admission failed: {new.status.reason or 'PreStartContainer'}" if failed_admission \
                else _reason(new)
            self._in_background(self._settle(new, reason if release else None, delete=failed_admission))

    def _in_background(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(work)
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _settle(self, pod: Pod, release: str | None, *, delete: bool) -> None:
        """Release a pod that stopped (``release``: the reason; None: released already), then delete it
        when it failed admission and a controller owns it."""
        if release is not None and not await self.release(pod.uid, release):
            self._released.discard(pod.uid)  # the allocator was away: a later event or pass retries
        if delete and self.admission is not None:
            try:
                await self.admission.delete_if_owned(pod)
            except Exception as exc:  # (the API server refused) the next reconciliation pass retries
                _logger.warning("could not delete a pod that failed admission", pod=pod.key, error=str(exc))

    async def release(self, pod_uid: str, reason: str) -> bool:
        # A request id of its own, bound here, so the allocator's lines for this release carry it too.
        with bound(request_id=uuid.uuid4().hex, pod_uid=pod_uid):
            return await self._release(pod_uid, reason)

    async def _release(self, pod_uid: str, reason: str) -> bool:
        try:
            reply = await self.bus.request(
                self.bus.subjects.release, ReleaseRequest(pod_uid=pod_uid, reason=reason), ReleaseReply,
                timeout=self.timeout,
            )
        except BusError as exc:  # the allocator is away: reconciliation will repair it
            _logger.warning("release request failed", pod_uid=pod_uid, error=str(exc))
            self._retry = True
            self._kick.set()
            return False
        if reply.released:
            _logger.info("released", pod_uid=pod_uid, reason=reason, alloc_ids=reply.released)
        return True

    async def reconcile(self) -> Repairs:
        await asyncio.wait_for(self.source.synced.wait(), self.timeout)
        repairs = Repairs()
        state = await self.bus.request(self.bus.subjects.state, StateRequest(), StateReply, timeout=self.timeout)
        held: dict[str, list[Allocation]] = defaultdict(list)
        for alloc in state.snapshot.allocations:
            if not alloc.alloc_id.startswith(CLAIM_PREFIX):  # claims: see self.claims below
                held[alloc.pod_uid].append(alloc)
        fresh = {p.uid: p for p in await self.source.list_fresh()}
        kubelet = await self.kubelet.view() if self.kubelet is not None else None

        for uid, allocs in sorted(held.items()):
            pod = fresh.get(uid)
            if pod is not None and is_active(pod):
                continue
            if kubelet is not None and _kubelet_still_runs(kubelet, allocs):
                repairs.deferred.append(uid)
                continue
            reason = f"reconcile: pod {_reason(pod)}"
            if await self.release(uid, reason):
                repairs.released[uid] = reason
                self._released.add(uid)

        for pod in fresh.values():
            if self.admission is not None and admission_failed(pod) and await self.admission.delete_if_owned(pod):
                repairs.deleted.append(pod.key)
            elif (self.annotations is not None and pod.status.phase == "Running" and held.get(pod.uid)
                  and not left_to_the_allocator(held[pod.uid], time.time_ns())
                  and await self.annotations.repair(pod, held[pod.uid], extender_indexes(state.snapshot.gpus))):
                repairs.patched.append(pod.key)

        if kubelet is not None:
            recorded = {d for allocs in held.values() for a in allocs for d in a.device_ids}
            for (ns, name, ctr), devices in sorted(kubelet.items()):
                if devices.get(RESOURCE_VCORE, set()) - recorded:
                    repairs.unrecorded.append(f"{ns}/{name}/{ctr}")
            if repairs.unrecorded:
                _logger.warning("the kubelet reports GPU devices the ledger does not hold",
                                containers=repairs.unrecorded)

        if self.claims is not None:
            claims = await self.claims.reconcile(state.claims)
            repairs.claims_released = claims.released
            if claims.failed:
                self._retry = True  # the allocator did not answer: try again soon

        if self.labeler is not None:
            inventory = await self.bus.request(self.bus.subjects.inventory, InventoryRequest(), InventoryReply,
                                               timeout=self.timeout)
            repairs.labels_updated = await self.labeler.ensure([g.name for g in inventory.inventory.gpus])
        self.passes += 1
        return repairs

    async def reconcile_forever(self, period: float) -> None:
        """Reconcile every ``period`` seconds. Until the first pass succeeds (the allocator or the API
        server still starting, as on every ``gpuledger up``), retry after a short, growing pause
        instead: the node labels and the repairs should not wait a whole period. Later, a failed pass
        or release is tried again after RETRY_S, and `kick` (the broker is back) runs a pass at once."""
        retry = FIRST_PASS_RETRY_S
        while True:
            self._kick.clear()
            self._retry = False
            ok = False
            try:
                repairs = await self.reconcile()
                ok = True
                if repairs:
                    _logger.info("reconciliation repaired state", released=repairs.released, deleted=repairs.deleted,
                                 patched=repairs.patched, claims_released=repairs.claims_released,
                                 labels_updated=repairs.labels_updated)
            except Exception as exc:  # the allocator or the API server is away: try again
                error = str(exc) or type(exc).__name__
                if self.passes == 0:
                    # quiet while things start; a warning once the pauses have grown to their longest
                    say = _logger.debug if retry < FIRST_PASS_MAX_RETRY_S else _logger.warning
                    say("first reconciliation waits for the allocator and the API server", error=error)
                    await asyncio.sleep(min(retry, period))
                    retry = min(retry * 2, FIRST_PASS_MAX_RETRY_S)
                    continue
                skipped = isinstance(exc, (BusError, TimeoutError, OSError))
                _logger.warning("reconciliation skipped" if skipped else "reconciliation failed", error=error)
            wait = period if ok and not self._retry else min(RETRY_S, period)
            if self._retry:
                self._kick.clear()  # a failed release asks for a retry, paced by RETRY_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), wait)


def _kubelet_still_runs(kubelet: KubeletView, allocs: list[Allocation]) -> bool:
    """Some container of the allocation is still listed by the kubelet with its vcore device IDs."""
    for alloc in allocs:
        listed = kubelet.get((alloc.namespace, alloc.pod_name, alloc.container), {}).get(RESOURCE_VCORE, set())
        if listed & set(alloc.device_ids):
            return True
    return False
