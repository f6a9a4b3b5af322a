"""The allocator's copy of the watchdog's pod view is current again as soon as the watchdog is back.

The copy follows the watchdog's ``pod.<verb>`` notifications (core NATS): those the watchdog would
have sent while it was away are lost. Its periodic resync (every 30 s) is far beyond the recovery
bound, so the watchdog announces ``watchdog.ready`` when it answers again and the copy resyncs then.
"""

from __future__ import annotations

from services.allocator.podcache import PodCache
from tests.builders import gpu_pod
from tests.e2e.helpers import WatchdogNode
from tests.polling import eventually

# Well under the allocator's periodic resync (30 s after its start), so only a prompt resync passes.
PROMPT_S = 8.0


def pod_cache(node: WatchdogNode) -> PodCache:
    return node.services["allocator"].handlers.pod_cache


async def test_a_pod_deleted_while_the_watchdog_was_away_leaves_the_allocators_copy_when_it_is_back(
        wnode: WatchdogNode) -> None:
    cache = pod_cache(wnode)
    gone = await wnode.run_pod(gpu_pod("gone", ("c", 20, 1)))
    kept = await wnode.run_pod(gpu_pod("kept", ("c", 20, 1)))
    uids = {gone["metadata"]["uid"], kept["metadata"]["uid"]}
    await eventually(lambda: uids <= set(cache.pods), timeout=10, interval=0.05, what="both pods in the copy")
    # The allocator started before the watchdog here: its first resync failed and is retried each second.
    await eventually(lambda: cache.resyncs >= 1, timeout=10, interval=0.05, what="the copy resynced once")

    await wnode.stop_watchdog()
    await wnode.sim.delete_pod("default", "gone")  # its notifications are never sent
    await eventually(lambda: wnode.sim.get_pod("default", "gone") is None, timeout=10, interval=0.05,
                     what="the pod removed from the API server")
    resyncs = cache.resyncs
    await wnode.start_watchdog()

    await eventually(lambda: gone["metadata"]["uid"] not in cache.pods, timeout=PROMPT_S, interval=0.05,
                     what="the deleted pod gone from the allocator's copy")
    assert cache.resyncs > resyncs
    assert kept["metadata"]["uid"] in cache.pods
