"""The allocator's copy of the node's pods: a resync's answer does not erase a newer notification.

The likely cause of one CI failure of tests/e2e/test_rejected_midway.py (the allocator's log was not
kept, so not proven): the watchdog's start makes the allocator resync while that test creates its
pods. If the watchdog answers before it has pod P, and P's notification, sent after the answer, is
handled before it (a request's answer resumes its caller a loop turn or two after a notification
resumes its handler), the answer replaces the copy and P is gone. With the watchdog frozen next,
P's Allocate waits on it until the kubelet's deadline, as it did there.

Here a real broker, the allocator's ``PodCache`` and a stand-in for the watchdog's pod query, which
holds its (stale) answer until the test has delivered P's notification.
"""

from __future__ import annotations

import asyncio

import msgspec

from libs.bus import NatsServer
from libs.bus.client import Bus
from libs.commands import PodChanged, PodsReply, PodsRequest
from libs.kube.pods import Pod
from services.allocator.podcache import PodCache
from tests.builders import gpu_pod
from tests.polling import eventually

NODE = "race-node"


def pod(name: str, uid: str) -> Pod:
    manifest = gpu_pod(name, ("c", 20, 1))
    manifest["metadata"]["uid"] = uid
    manifest["status"] = {"phase": "Pending"}
    return msgspec.convert(manifest, Pod)


async def test_a_notification_handled_before_a_stale_resync_answer_stays(nats_server: NatsServer) -> None:
    allocator = await Bus.connect(nats_server.url, name="allocator", node=NODE, wait=5)
    watchdog = await Bus.connect(nats_server.url, name="watchdog", node=NODE, wait=5)
    old, new = pod("old", "uid-old"), pod("new", "uid-new")
    asked, answer = asyncio.Event(), asyncio.Event()
    view = [old]  # what the watchdog answers
    hold = False  # whether it waits with its answer until the test says

    async def pods(_req: PodsRequest) -> PodsReply:
        reply = PodsReply(pods=list(view))  # the view as it is when asked
        asked.set()
        if hold:
            await answer.wait()
        return reply

    try:
        await watchdog.serve(watchdog.subjects.pods, PodsRequest, pods)
        await watchdog.flush()  # the broker has the subscription before the allocator asks
        cache = PodCache(allocator)
        await cache.start(timeout=5)  # first sync, from the watchdog's view
        assert set(cache.pods) == {"uid-old"}

        hold = True
        asked.clear()
        resync = asyncio.create_task(cache.resync(timeout=5))
        await asyncio.wait_for(asked.wait(), 5)
        view.append(new)  # the watchdog has the new pod after it answered, and says so
        await watchdog.publish(watchdog.subjects.pod_fact("added"), PodChanged(kind="ADDED", pod=new))
        await eventually(lambda: "uid-new" in cache.pods, timeout=5, interval=0.01, what="the notification handled")
        answer.set()
        await asyncio.wait_for(resync, 5)

        assert set(cache.pods) == {"uid-old", "uid-new"}
        assert cache.pending() and {p.uid for p in cache.pending()} == {"uid-old", "uid-new"}

        # A pod deleted while a resync is asked is not brought back by the answer either.
        asked.clear()
        answer.clear()
        resync = asyncio.create_task(cache.resync(timeout=5))
        await asyncio.wait_for(asked.wait(), 5)
        view.remove(old)
        await watchdog.publish(watchdog.subjects.pod_fact("deleted"), PodChanged(kind="DELETED", pod=old))
        await eventually(lambda: "uid-old" not in cache.pods, timeout=5, interval=0.01, what="the deletion handled")
        answer.set()
        await asyncio.wait_for(resync, 5)
        assert set(cache.pods) == {"uid-new"}

        # With nothing in between, the answer is the copy, as before: a pod the copy missed appears.
        hold = False
        view.append(old)
        await cache.resync(timeout=5)
        assert set(cache.pods) == {"uid-old", "uid-new"}
    finally:
        await allocator.close()
        await watchdog.close()
