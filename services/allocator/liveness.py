"""Before an Allocate is refused for want of room: are the pods that hold the GPUs still alive?

A pod deleted while the watchdog was away (restarting, frozen) keeps its GPUs until the watchdog's
reconciliation releases them; a kubelet that admits a new pod meanwhile would fail it for good
(``UnexpectedAdmissionError``) for room that only dead pods hold. So, on a capacity refusal, the
allocator asks the kubelet's pod-resources ``List`` (live: the pods it has on the node now) and looks
at its pod cache (the watchdog's notifications), releases the allocations of pods that are gone, and
places again.

Never release a live pod: a holder counts as gone only on positive evidence, and when neither source
can answer nothing is released (the refusal stands, as before).
- pod-resources answered: a holder the kubelet does not list (by namespace and name) is gone, and so is
  one the pod cache knows as Succeeded or Failed. An empty listing while we hold allocations is not
  believed (a kubelet just restarted lists nothing until it has synced its pods; and the pod being
  admitted right now should be listed).
- pod-resources unavailable: only the pod cache's Succeeded or Failed counts; a pod missing from the
  cache proves nothing (the cache is a hint and may not be synced).
The ``List`` is awaited outside the ledger lock and bounded by the kubelet client's timeout.
"""

from __future__ import annotations

from libs.kube.pods import Pod
from libs.ledger.state import LedgerState
from libs.logger import get_logger
from services.allocator.podresources import KubeletPodResources, KubeletRecord, PodResourcesUnavailable

__all__ = ["GONE_AT_ALLOCATE", "gone_holders"]

GONE_AT_ALLOCATE = "holder gone at allocate"  # the release event's reason
_TERMINATED = ("Succeeded", "Failed")
_logger = get_logger("allocator")


async def gone_holders(
    state: LedgerState, kubelet: KubeletPodResources | None, cached: dict[str, Pod] | None,
) -> list[str]:
    """The uids of pods that hold allocations but are gone from the node (possibly none)."""
    record: KubeletRecord | None = None
    if kubelet is not None:
        try:
            record = await kubelet.list("room")
        except PodResourcesUnavailable as exc:
            _logger.info("pod-resources unavailable: liveness from the pod cache only", error=str(exc))
    return decide_gone(state, record, cached or {})


def decide_gone(state: LedgerState, record: KubeletRecord | None, cached: dict[str, Pod]) -> list[str]:
    holders = {a.pod_uid: (a.namespace, a.pod_name) for a in state.allocations.values()}
    if not holders:
        return []
    if record is not None and not record.containers:
        record = None  # an empty listing is a kubelet that has not synced yet, not a node without pods
    gone = []
    for uid, key in sorted(holders.items()):
        pod = cached.get(uid)
        terminated = pod is not None and pod.status.phase in _TERMINATED
        unlisted = record is not None and key not in record.containers
        if terminated or unlisted:
            gone.append(uid)
    return gone
