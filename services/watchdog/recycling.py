"""Returning the GPU shares of pods that are gone, the moment they are gone, and repairing misses.

A pod stops holding its shares when it is deleted or reaches Succeeded/Failed (gpu-manager's
"active", gpu-manager-reference.md 4.1). gpu-manager only noticed at the next Allocate; here the watch
event itself triggers the release. Reconciliation compares the allocator's holders with the pods the
API server knows, so releases missed while a service was down are repaired; it double-checks with a
fresh list before releasing anything, because a stale cache must never free a running pod's GPU.
"""

from __future__ import annotations

import asyncio

from libs.bus.client import Bus
from libs.commands import PodChanged, ReleaseReply, ReleaseRequest, StateReply, StateRequest
from libs.errors import BusError
from libs.kube.pods import Pod, is_active
from libs.kube.source import PodSource
from libs.log import get_logger

__all__ = ["Recycler"]

_log = get_logger("watchdog")
_VERBS = {"ADDED": "added", "MODIFIED": "updated", "DELETED": "deleted"}


def _reason(pod: Pod) -> str:
    if pod.metadata.deletion_timestamp:
        return "deleted"  # the API's MODIFIED with deletionTimestamp comes before its DELETED
    if pod.status.phase in ("Succeeded", "Failed"):
        return pod.status.phase.lower()
    return "terminated"


class Recycler:
    def __init__(self, bus: Bus, timeout: float) -> None:
        self.bus = bus
        self.timeout = timeout
        self.source: PodSource | None = None
        self._released: set[str] = set()  # pods already released, so MODIFIED events do not repeat it

    async def on_change(self, kind: str, old: Pod | None, new: Pod | None) -> None:
        pod = new or old
        assert pod is not None
        await self.bus.publish(self.bus.subjects.pod_fact(_VERBS.get(kind, "updated")), PodChanged(kind=kind, pod=pod))
        if not pod.wants_gpu:
            return
        if kind == "DELETED":
            await self.release(pod.uid, "deleted")
            self._released.discard(pod.uid)
        elif new is not None and not is_active(new) and pod.uid not in self._released:
            reason = _reason(new)
            if await self.release(pod.uid, reason):
                self._released.add(pod.uid)

    async def release(self, pod_uid: str, reason: str) -> bool:
        try:
            reply = await self.bus.request(
                self.bus.subjects.release, ReleaseRequest(pod_uid=pod_uid, reason=reason), ReleaseReply,
                timeout=self.timeout,
            )
        except BusError as exc:  # the allocator is away: reconciliation will repair it
            _log.warning("release request failed", pod_uid=pod_uid, error=str(exc))
            return False
        if reply.released:
            _log.info("released", pod_uid=pod_uid, reason=reason, allocations=len(reply.released))
        return True

    async def reconcile(self) -> list[str]:
        """Release every holder the API server no longer reports as active; return their UIDs."""
        assert self.source is not None
        await asyncio.wait_for(self.source.synced.wait(), self.timeout)
        reply = await self.bus.request(self.bus.subjects.state, StateRequest(), StateReply, timeout=self.timeout)
        holders = {a.pod_uid for a in reply.snapshot.allocations}
        suspects = {u for u in holders if u not in self.source.pods or not is_active(self.source.pods[u])}
        if not suspects:
            return []
        fresh = {p.uid: p for p in await self.source.list_fresh()}
        gone = sorted(u for u in suspects if u not in fresh or not is_active(fresh[u]))
        for uid in gone:
            await self.release(uid, "reconcile")
        return gone

    async def reconcile_forever(self, period: float) -> None:
        while True:
            try:
                gone = await self.reconcile()
                if gone:
                    _log.info("reconciliation released allocations of pods that are gone", pods=gone)
            except (BusError, TimeoutError, OSError) as exc:
                _log.warning("reconciliation skipped", error=str(exc) or type(exc).__name__)
            except Exception as exc:  # an API error: try again next period
                _log.warning("reconciliation failed", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(period)
