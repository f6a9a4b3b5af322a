"""Never refused for room that only dead pods hold.

A pod deleted while its release cannot be recorded (here: the allocator is down when the watchdog sees
the deletion, and the watchdog's reconciliation is far away) keeps its GPUs in the ledger. A new pod
that needs them is admitted anyway: before refusing for capacity the allocator asks the kubelet's
pod-resources who is still alive, releases the gone pod with an ordinary release event that says why,
and places. A holder that is alive is never released: a pod that does not fit is refused as before.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

from libs.bus.server import NatsServer
from libs.errors import BusError
from libs.kube.pods import RESOURCE_VCORE
from services.allocator import app as allocator_app
from services.allocator.liveness import GONE_AT_ALLOCATE
from services.registrar import app as registrar_app
from services.vmanager import app as vmanager_app
from services.watchdog import app as watchdog_app
from tests.builders import gpu_pod, settings_for
from tests.e2e.helpers import Node, base_node


async def held(node: Node, timeout: float = 10) -> set[str]:
    """The pods the ledger holds GPUs for (a just restarted allocator's subscriptions may still be on their way)."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                return {a.pod_name for a in (await node.snapshot()).allocations}
            except BusError:
                await asyncio.sleep(0.1)


async def test_room_held_by_a_dead_pod_is_freed_at_allocate(nats_server: NatsServer, short_dir: Path) -> None:
    settings = settings_for(short_dir, nats_server.url, identity_check_period=0)
    async with AsyncExitStack() as stack:
        node = await base_node(stack, short_dir, nats_server.url, settings)
        allocator = AsyncExitStack()
        await allocator.enter_async_context(allocator_app.service(settings))
        try:
            # Reconciliation once at start, then not for an hour: only the allocator can free the room.
            await stack.enter_async_context(watchdog_app.service(settings, reconcile_period=3600))
            await stack.enter_async_context(vmanager_app.service(settings))
            await stack.enter_async_context(registrar_app.service(settings))
            await node.sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=20)

            # Two 60-core shares (GPUs 0 and 1) stay alive; the doomed pod holds GPUs 2 and 3 whole. The
            # kubelet's own count has room for a 50-core share all along (80 of its 400 IDs are free).
            alive = await node.run_pod(gpu_pod("alive", ("a", 60, 1), ("b", 60, 1)))
            doomed = await node.run_pod(gpu_pod("doomed", ("c", 200, 0)))
            assert alive["status"]["phase"] == doomed["status"]["phase"] == "Running"

            # A live holder is never released: with both pods alive, a pod that needs room is refused.
            refused = await node.run_pod(gpu_pod("too-big", ("c", 50, 1)))
            assert refused["status"]["phase"] == "Failed", refused["status"]
            assert "no free node" in refused["status"]["message"]
            assert not node.tap.of("alloc.released")

            await allocator.aclose()  # the allocator is away while the watchdog sees the deletion
            await node.sim.delete_pod("default", "doomed")
            await asyncio.sleep(0.5)  # the watchdog's release request meets no allocator
            allocator = AsyncExitStack()
            await allocator.enter_async_context(allocator_app.service(settings))
            assert await held(node) == {"alive", "doomed"}  # the ledger still holds the dead pod's GPUs

            pod = await node.run_pod(gpu_pod("newcomer", ("c", 200, 0)))
            assert pod["status"]["phase"] == "Running", pod["status"]
            released = await node.tap.wait("alloc.released", 1)
            assert [r.data["pod_uid"] for r in released] == [doomed["metadata"]["uid"]]
            assert released[0].data["reason"] == GONE_AT_ALLOCATE
            assert await held(node) == {"alive", "newcomer"}

            # And still: nothing more is freed for a pod that does not fit beside live holders.
            refused = await node.run_pod(gpu_pod("too-big-2", ("c", 50, 1)))
            assert refused["status"]["phase"] == "Failed", refused["status"]
            assert len(node.tap.of("alloc.released")) == 1
        finally:
            await allocator.aclose()
