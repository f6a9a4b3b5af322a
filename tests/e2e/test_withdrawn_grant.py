"""A grant recorded for the one pending pod while the kubelet's List was still on its way, and withdrawn.

An Allocate whose pod has a single candidate in the allocator's copy of the node's pods is recorded
at once, while the kubelet's pod-resources List runs; the List is checked before anything is answered
to the kubelet. The registrar asks it as the Allocate comes in and checks the grant the allocator
replies with; a registrar that cannot reach pod-resources leaves it to the allocator, which asks at
the request's receipt (both run here). When our copy is stale (here: the watchdog was away while the
candidate was deleted and another pod created), the kubelet is not admitting that candidate: the grant
is released with the reason "withdrawn at allocate", nothing having been answered for it, and the
request goes on to the pod really asking.
"""

from __future__ import annotations

import asyncio

import pytest
import structlog

from libs.kube.pods import RESOURCE_VCORE
from services.allocator.handlers import WITHDRAWN
from tests.builders import gpu_pod
from tests.e2e.helpers import WatchdogNode
from tests.polling import eventually


@pytest.mark.parametrize("wnode", ["registrar checks", "allocator checks"], indirect=True)
async def test_a_grant_for_a_pod_the_kubelet_is_not_admitting_is_withdrawn_before_the_reply(
        wnode: WatchdogNode, request: pytest.FixtureRequest) -> None:
    cache = wnode.services["allocator"].handlers.pod_cache
    async with wnode.sim.kubelet.admission_lock:  # neither pod is admitted before the stage is set
        stale = await wnode.sim.create_pod(gpu_pod("stale", ("c", 20, 1)))
        await eventually(lambda: stale["metadata"]["uid"] in cache.pods, timeout=10, interval=0.05,
                         what="the first pod in the allocator's copy")
        await wnode.stop_watchdog()  # from here, our copy hears nothing
        await wnode.sim.delete_pod("default", "stale")
        asking = await wnode.sim.create_pod(gpu_pod("asking", ("c", 20, 2)))
    # The kubelet skips the deleted pod and asks for the second one's devices; its request is first
    # matched to the only candidate our copy holds. The watchdog comes back meanwhile, so the pod
    # really asking can be found.
    with structlog.testing.capture_logs() as logs:
        await asyncio.sleep(0.3)
        await wnode.start_watchdog()
        pod = await wnode.sim.wait_for_pod("default", "asking",
                                           lambda p: p["status"].get("phase") in ("Running", "Failed"), 30)
    assert pod["status"]["phase"] == "Running", pod["status"]
    asked_again = [e for e in logs if e["event"].startswith("the kubelet is not admitting the pod the grant went to")]
    assert len(asked_again) == (1 if request.node.callspec.params["wnode"] == "registrar checks" else 0), logs

    stale_uid, asking_uid = stale["metadata"]["uid"], asking["metadata"]["uid"]
    granted = await wnode.tap.wait("alloc.granted", 2)
    assert [g.stream for g in granted] == [f"pod:{stale_uid}", f"pod:{asking_uid}"], granted
    [withdrawn] = [r for r in await wnode.tap.wait("alloc.released", 1) if r.stream == f"pod:{stale_uid}"]
    assert withdrawn.data["reason"].startswith(WITHDRAWN), withdrawn.data
    assert withdrawn.seq == granted[0].seq + 1  # released before anything else was recorded
    # The ledger holds the devices the kubelet gave the second pod for that pod, and nothing for the first.
    ids = wnode.sim.allocated_device_ids(asking_uid, "c", RESOURCE_VCORE)
    snap = await wnode.snapshot()
    assert [(a.pod_uid, set(a.device_ids)) for a in snap.allocations] == [(asking_uid, set(ids))]
