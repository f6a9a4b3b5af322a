"""Saying on the bus that the watchdog answers ``watchdog.pods`` again.

The allocator keeps a copy of the watchdog's pod view from its ``pod.<verb>`` notifications. Those are
core NATS: while the watchdog (or its broker connection) was away, the ones it would have sent are
lost, e.g. the deletions of pods deleted meanwhile. So at its start and each time its connection comes
back, the watchdog publishes ``watchdog.ready``, and the copies resync at once instead of at their next
periodic resync.
"""

from __future__ import annotations

import asyncio

from libs.bus.client import Bus
from libs.commands import WatchdogReady
from libs.logger import get_logger

__all__ = ["ReadyAnnouncer"]

_logger = get_logger("watchdog")


class ReadyAnnouncer:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._sending: set[asyncio.Task[None]] = set()

    async def announce(self, cause: str) -> None:
        try:
            await self.bus.publish(self.bus.subjects.watchdog_ready, WatchdogReady(cause=cause))
        except Exception as exc:  # the broker away again: the next reconnect announces once more
            _logger.info("could not announce that the watchdog is ready", cause=cause, error=str(exc))

    def on_reconnect(self) -> None:
        """A Bus reconnect hook (a plain function): the announcement goes out from a task."""
        task = asyncio.get_running_loop().create_task(self.announce("reconnect"))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
