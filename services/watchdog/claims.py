"""Releasing prepared DRA claims that nothing can use any more: the kubelet's unprepare was missed.

The kubelet unprepares a claim once no pod of the node uses it; when it misses that (it or the driver
was down, its checkpoint was lost), the claim's capacity would stay held in the ledger for ever. Each
reconciliation pass reads the ResourceClaim of every prepared claim from the API server and releases
(``allocator.claim-unprepare``, recorded as ``claim.unprepared`` with the reason) the claims

* whose ResourceClaim is gone (404), or was recreated under the same name (another UID):
  ``reconcile: claim gone``;
* whose ResourceClaim is reserved for no live pod: ``reconcile: not reserved for a live pod``.

Only positive evidence releases: an API error or a timeout keeps the claim (the next pass tries
again), and so does any doubt about a reserved pod. A reserved pod is live when it is on this node's
fresh pod list and not terminated; one missing from that list is looked up by name, and counts as
gone only when the API says so (404, another UID) or it has finished: a pod just reserved by the
scheduler and not bound yet keeps the claim. The claims are read BEFORE the pods are listed, so a pod
that reserved a claim since its read is on the list. Left: a claim reserved for nobody that a new pod
reserves between our read and the release would lose its grant while the kubelet still holds it
prepared (only when the kubelet missed the unprepare before, and within milliseconds).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from libs.bus.client import Bus
from libs.commands import ClaimUnprepareReply, ClaimUnprepareRequest
from libs.dra import ClaimView
from libs.errors import BusError
from libs.kube.claims import ClaimNotFound, ClaimSource
from libs.kube.pods import Pod, is_active
from libs.kube.source import PodSource
from libs.ledger.state import PreparedClaim
from libs.logger import bound, get_logger

__all__ = ["CLAIM_GONE", "NOT_RESERVED", "ClaimReconciler", "ClaimRepairs", "release_reason"]

CLAIM_GONE = "reconcile: claim gone"
NOT_RESERVED = "reconcile: not reserved for a live pod"

_logger = get_logger("watchdog")


@dataclass
class ClaimRepairs:
    """What one pass did with the prepared claims."""

    released: dict[str, str] = field(default_factory=dict)  # claim uid -> reason
    unread: list[str] = field(default_factory=list)         # claim uids kept: the API did not answer
    failed: bool = False                                     # a release could not be made: retry soon


def release_reason(prepared: PreparedClaim, claim: ClaimView | None, live: set[str]) -> str | None:
    """Why a prepared claim is released, or None to keep it. ``claim`` None: the API answered 404;
    ``live``: the pod UIDs known to be live (or possibly live) among the claim's reserved pods."""
    if claim is None:
        return CLAIM_GONE
    if claim.uid != prepared.uid:
        return f"{CLAIM_GONE} (recreated as {claim.uid})"
    if not live.intersection(claim.reserved_pods):
        return NOT_RESERVED
    return None


class ClaimReconciler:
    def __init__(self, bus: Bus, claims: ClaimSource, source: PodSource, timeout: float) -> None:
        self.bus = bus
        self.claims = claims
        self.source = source
        self.timeout = timeout

    async def reconcile(self, prepared: list[PreparedClaim]) -> ClaimRepairs:
        repairs = ClaimRepairs()
        if not prepared:
            return repairs
        read: list[tuple[PreparedClaim, ClaimView | None]] = []
        for ref in prepared:
            try:
                read.append((ref, await self._read(ref)))
            except Exception as exc:  # API error, timeout, a malformed object: no evidence either way
                repairs.unread.append(ref.uid)
                _logger.warning("prepared claim not checked: its ResourceClaim could not be read",
                                claim=f"{ref.namespace}/{ref.name}", claim_uid=ref.uid,
                                error=str(exc) or type(exc).__name__)
        node_pods = {p.uid: p for p in await asyncio.wait_for(self.source.list_fresh(), self.timeout)}
        for ref, claim in read:
            live = await self._live(claim, node_pods) if claim is not None else set()
            reason = release_reason(ref, claim, live)
            if reason is None:
                continue
            if await self._release(ref, reason):
                repairs.released[ref.uid] = reason
            else:
                repairs.failed = True
        return repairs

    async def _read(self, ref: PreparedClaim) -> ClaimView | None:
        try:
            return await self.claims.get(ref.namespace, ref.name, timeout=self.timeout)
        except ClaimNotFound:
            return None

    async def _live(self, claim: ClaimView, node_pods: dict[str, Pod]) -> set[str]:
        """The claim's reserved pods that are live or may be: on the node and active, or elsewhere in the
        API and not finished (scheduled, not bound yet). Unanswered look-ups count as live."""
        live = set()
        for uid, name in zip(claim.reserved_pods, claim.reserved_names or ("",) * len(claim.reserved_pods),
                             strict=True):
            pod = node_pods.get(uid)
            if pod is not None:
                if is_active(pod):
                    live.add(uid)
                continue
            if not name:
                live.add(uid)  # no name to look it up by: no evidence that it is gone
                continue
            try:
                other = await asyncio.wait_for(self.source.get(claim.namespace, name), self.timeout)
            except Exception as exc:
                _logger.warning("reserved pod not checked", pod=f"{claim.namespace}/{name}", pod_uid=uid,
                                error=str(exc) or type(exc).__name__)
                live.add(uid)
                continue
            if other is not None and other.uid == uid and other.status.phase not in ("Succeeded", "Failed"):
                live.add(uid)
        return live

    async def _release(self, ref: PreparedClaim, reason: str) -> bool:
        with bound(request_id=uuid.uuid4().hex, claim_uid=ref.uid):
            try:
                reply = await self.bus.request(
                    self.bus.subjects.claim_unprepare, ClaimUnprepareRequest(claim_uid=ref.uid, reason=reason),
                    ClaimUnprepareReply, timeout=self.timeout,
                )
            except BusError as exc:  # the allocator is away: the next pass tries again
                _logger.warning("claim release request failed", claim=f"{ref.namespace}/{ref.name}",
                                error=str(exc))
                return False
        if reply.released:
            _logger.info("prepared claim released", claim=f"{ref.namespace}/{ref.name}", claim_uid=ref.uid,
                         reason=reason)
        return True
