"""The watchdog's claim reconciliation, end to end: a prepared claim whose ResourceClaim is gone, or is
reserved for no live pod while the kubelet's unprepare cannot reach the driver, is released with the
reason as a ``claim.unprepared`` and its capacity is free again; a claim in use by a live pod is never
released. The watchdog reconciles every second here (``DraNode.start_service``)."""

from __future__ import annotations

from typing import Any

from libs.events.codec import StoredEvent
from libs.events.schema import ClaimUnprepared
from services.watchdog.claims import CLAIM_GONE, NOT_RESERVED
from tests.dra.e2e.helpers import DraNode, claim_pod, claim_templates
from tests.polling import eventually


async def _unprepared_events(node: DraNode) -> list[ClaimUnprepared]:
    """Collects every claim.unprepared the allocator publishes from now on."""
    seen: list[ClaimUnprepared] = []

    async def on_event(stored: StoredEvent) -> None:
        assert isinstance(stored.event, ClaimUnprepared)
        seen.append(stored.event)

    await node.bus.subscribe_events(node.bus.subjects.event("claim.unprepared"), on_event)
    return seen


async def _cores_used(node: DraNode, index: int) -> int:
    return next(g.cores_used for g in (await node.snapshot()).gpus if g.index == index)


def _device_index(claim: dict[str, Any]) -> int:
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return int(result["device"].removeprefix("gpu-"))


async def _passes_after(node: DraNode, passes: int) -> None:
    recycler = node.services["watchdog"].recycler
    start = recycler.passes
    await eventually(lambda: recycler.passes >= start + passes, timeout=passes * 3 + 5, interval=0.05,
                     what=f"{passes} more reconciliation passes")


async def test_claim_whose_resourceclaim_is_deleted_is_released(dra_node: DraNode) -> None:
    node = dra_node
    events = await _unprepared_events(node)
    pod = await node.run_pod(claim_pod("share", "gpu-share"))
    assert pod["status"]["phase"] == "Running", pod["status"]
    claim = node.claim_of("share")
    claim_uid, index = claim["metadata"]["uid"], _device_index(claim)
    assert claim_uid in await node.claim_grants()
    assert await _cores_used(node, index) == 30

    # The ResourceClaim goes away behind the kubelet's back: the kubelet still holds it prepared.
    node.sim.dra_objects.claims.remove("default", claim["metadata"]["name"])
    await eventually(lambda: [e for e in events if e.claim_uid == claim_uid], timeout=10, interval=0.05,
                     what="the watchdog releasing the claim whose ResourceClaim is gone")
    (released,) = events
    assert released.reason == CLAIM_GONE and released.reserved_pods == (pod["metadata"]["uid"],)
    assert claim_uid not in await node.claim_grants()
    assert await _cores_used(node, index) == 0  # the capacity is free again
    assert node.sim.dra is not None and claim_uid in node.sim.dra.claims  # not the kubelet's doing


async def test_claim_reserved_for_no_live_pod_is_released_while_the_driver_is_away(dra_node: DraNode) -> None:
    node = dra_node
    events = await _unprepared_events(node)
    share = next(t for t in claim_templates() if t["metadata"]["name"] == "gpu-share")
    node.sim.dra_objects.claims.create({"metadata": {"name": "mine", "namespace": "default"},
                                        "spec": share["spec"]["spec"]})  # outlives its pods
    await node.run_pod(claim_pod("user", claim="mine"))
    claim = node.claim_of("user")
    claim_uid, index = claim["metadata"]["uid"], _device_index(claim)
    assert await _cores_used(node, index) == 30

    # The kubelet cannot unprepare (the driver is away) when the pod goes; the control plane empties
    # the claim's reservedFor. Only the watchdog can give the capacity back.
    await node.stop_service("registrar")
    await node.sim.delete_pod("default", "user")
    await eventually(lambda: not (node.sim.dra_objects.claims.get("default", "mine") or {})
                     .get("status", {}).get("reservedFor"), timeout=10, interval=0.05,
                     what="the pod's reservation dropped from the claim")
    await eventually(lambda: [e for e in events if e.claim_uid == claim_uid], timeout=10, interval=0.05,
                     what="the watchdog releasing the claim reserved for no live pod")
    (released,) = events
    assert released.reason == NOT_RESERVED
    assert claim_uid not in await node.claim_grants()
    assert await _cores_used(node, index) == 0
    assert node.sim.dra is not None and claim_uid in node.sim.dra.claims  # the kubelet's unprepare still pending

    # The driver comes back: the kubelet's retried unprepare finds nothing left to release.
    await node.start_service("registrar")
    await eventually(lambda: node.sim.dra is not None and not node.sim.dra.claims, timeout=20, interval=0.05,
                     what="the kubelet's unprepare retried after the driver came back")
    assert len(events) == 1


async def test_claim_reserved_for_a_live_pod_is_kept(dra_node: DraNode) -> None:
    node = dra_node
    events = await _unprepared_events(node)
    await node.run_pod(claim_pod("live", "gpu-share"))
    claim_uid = node.claim_of("live")["metadata"]["uid"]
    await _passes_after(node, 3)
    assert claim_uid in await node.claim_grants()
    assert events == []
