"""Which pods may call a shared claim's vcuda.sock: the pods that use the claim.

The kubelet prepares a claim once per node, whichever of its pods comes first; a pod that uses an
already prepared claim never reaches the driver. So the ledger knows the claim's ``reservedFor`` at
prepare time (``LedgerState.claim_pods``), and a pod that the scheduler reserved it for later is
checked against the pod itself, as the watchdog sees it: same namespace as the claim, and the claim
named in its ``spec.resourceClaims`` or, for a template entry, its ``status.resourceClaimStatuses``
(asked fresh from the API server, since the caller's pod is new). Only positive evidence admits.
"""

from __future__ import annotations

from libs.bus.client import Bus
from libs.commands import PodsReply, PodsRequest
from libs.errors import BusError, RemoteError
from libs.ledger.state import LedgerState, claim_alloc_id
from services.vmanager.peergate import Admission

__all__ = ["ClaimPods"]


class ClaimPods:
    def __init__(self, state: LedgerState, bus: Bus, *, timeout: float) -> None:
        self.state = state
        self.bus = bus
        self.timeout = timeout

    def is_claim(self, key: str) -> bool:
        return claim_alloc_id(key) in self.state.allocations

    def admission(self, key: str) -> Admission | None:
        """The gate's question for a prepared claim's directory; None for a pod's own directory."""
        if not self.is_claim(key):
            return None

        async def admit(pod_uid: str) -> str | None:
            return await self.refusal(key, pod_uid)
        return admit

    async def refusal(self, claim_uid: str, pod_uid: str) -> str | None:
        """None when the pod uses the claim, else why it may not call the claim's socket."""
        if not self.is_claim(claim_uid):
            return f"claim {claim_uid} is not prepared on this node"
        if pod_uid in self.state.claim_pods.get(claim_uid, ()):
            return None
        ref = self.state.claim_refs.get(claim_uid)
        if ref is None:
            return f"pod {pod_uid} is not reserved for claim {claim_uid}"
        try:
            reply = await self.bus.request(self.bus.subjects.pods, PodsRequest(uid=pod_uid, fresh=True), PodsReply,
                                           timeout=self.timeout)
            pods = reply.pods
        except RemoteError as exc:
            if exc.code != 404:
                return f"the watchdog cannot tell whether pod {pod_uid} uses claim {ref.namespace}/{ref.name}: {exc}"
            pods = []
        except BusError as exc:
            return f"the watchdog did not answer whether pod {pod_uid} uses claim {ref.namespace}/{ref.name}: {exc}"
        for pod in pods:
            if pod.uid == pod_uid and pod.metadata.namespace == ref.namespace and ref.name in pod.claim_names():
                return None
        return f"pod {pod_uid} does not use claim {ref.namespace}/{ref.name}"
