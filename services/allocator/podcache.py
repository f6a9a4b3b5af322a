"""The node's pods as the watchdog announces them (``pod.<verb>`` notifications), kept by the allocator.

An Allocate must name a pending pod. Asking the watchdog costs a NATS round trip, and the kubelet
usually admits a pod before the pod's watch event has reached the watchdog's cache, which then costs
a fresh LIST from the API server too. Here the allocator listens to the watchdog's notifications, so
a pod is matched without any request once its notification is in, and a miss waits (briefly) for the
next notification instead of listing. It is a hint: notifications are core NATS (may be lost while
disconnected), so a miss after the wait falls back to asking the watchdog, and the cache is resynced
from the watchdog at start, periodically, and at once when notifications may have been lost: when
the watchdog says it answers again (``watchdog.ready``: it restarted, or its broker connection came
back) and when the allocator's own connection comes back. A resync that fails is retried every
``RETRY_S`` until one works.
"""

from __future__ import annotations

import asyncio

from libs.bus.client import Bus
from libs.commands import PodChanged, PodsReply, PodsRequest, WatchdogReady
from libs.errors import BusError
from libs.kube.pods import Pod
from libs.logger import get_logger

__all__ = ["PodCache"]

_logger = get_logger("allocator")

RETRY_S = 1.0  # between resyncs while they fail (the watchdog or the broker away)


class PodCache:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.pods: dict[str, Pod] = {}
        self.version = 0
        self._changed = asyncio.Condition()
        self.resyncs = 0      # resyncs that replaced the cache (for tests and logs)
        self._due = asyncio.Event()  # a resync is due now (see kick())
        self._failures = 0  # resyncs failed in a row
        self._during: list[PodChanged] | None = None  # notifications applied while a resync is asked

    async def start(self, timeout: float) -> None:
        await self.bus.subscribe(self.bus.subjects.pod_fact("*"), PodChanged, self._on_change)
        await self.bus.subscribe(self.bus.subjects.watchdog_ready, WatchdogReady, self._on_watchdog_ready)
        self.bus.on_reconnect.append(self.kick)  # our own connection was away: so were the notifications
        await self.resync(timeout)

    def kick(self) -> None:
        """Resync now (from ``resync_forever``), not at the next period."""
        self._due.set()

    async def resync(self, timeout: float) -> None:
        """Replace the cache with the watchdog's view, then apply again the notifications that came
        while it was asked: the reply can be handled after a notification the watchdog sent after it
        (the request's answer resumes this coroutine a loop turn or two later than a notification
        resumes its handler), and replacing would erase that pod. Replayed in order on top of the
        view, each pod ends as its latest notification says (a change the view holds and the
        replay does not is notified too, and applies when it comes)."""
        self._during = []
        try:
            reply = await self.bus.request(self.bus.subjects.pods, PodsRequest(), PodsReply, timeout=timeout)
        except BusError as exc:
            if self._failures % 30 == 0:  # retried every RETRY_S: one line when it starts, then now and then
                _logger.info("pod cache not synced from the watchdog yet", error=str(exc), tries=self._failures + 1)
            self._failures += 1
            return
        finally:
            during, self._during = self._during, None
        pods = {p.uid: p for p in reply.pods}
        for change in during:
            _apply(pods, change)
        self.pods = pods
        self._failures = 0
        self.resyncs += 1
        await self._bump()

    async def resync_forever(self, period: float, timeout: float) -> None:
        """Every ``period``; at once after ``kick()``; every ``RETRY_S`` while a resync fails."""
        while True:
            wait = min(RETRY_S, period) if self._failures else period
            try:
                async with asyncio.timeout(wait):
                    await self._due.wait()
            except TimeoutError:
                pass
            self._due.clear()
            await self.resync(timeout)

    def pending(self) -> list[Pod]:
        return [p for p in self.pods.values() if p.status.phase == "Pending"]

    async def wait_for_change(self, since: int, timeout: float) -> bool:
        """True when a notification arrived after version ``since`` within ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(lambda: self.version != since)
        except TimeoutError:
            return False
        return True

    async def _on_watchdog_ready(self, ready: WatchdogReady) -> None:
        _logger.info("the watchdog answers again: resyncing the pod cache", cause=ready.cause)
        self.kick()

    async def _on_change(self, change: PodChanged) -> None:
        _apply(self.pods, change)
        if self._during is not None:
            self._during.append(change)
        await self._bump()

    async def _bump(self) -> None:
        async with self._changed:
            self.version += 1
            self._changed.notify_all()


def _apply(pods: dict[str, Pod], change: PodChanged) -> None:
    if change.kind == "DELETED":
        pods.pop(change.pod.uid, None)
    else:
        pods[change.pod.uid] = change.pod
