"""When the relay may publish what an Allocate committed (libs/bus/outbox.py, ``replies_out``).

Not while an Allocate is being handled: its reply is handed to the connection as its handler returns,
before anything else runs. And not until the last reply has had REPLY_HEADSTART_S to cross the broker
and the registrar to the kubelet (p90 ~1.5 ms here): the subscribers a publication wakes (the
broker's stream, the vmanager, the watchdog) would share the node's CPUs with it on the way. Published
along with it, they doubled the p99 of the reply's way back (docs/benchmarks.md, eleventh round).
The relay bounds the wait (HOLD_AT_MOST_S) however busy the Allocates keep us.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["REPLY_HEADSTART_S", "RepliesOut"]

REPLY_HEADSTART_S = 0.003


class RepliesOut:
    def __init__(self, headstart: float = REPLY_HEADSTART_S, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.headstart = headstart
        self._clock = clock
        self._handling = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._replied_at = float("-inf")

    @contextmanager
    def handling(self) -> Iterator[None]:
        """Around an Allocate's handler: its reply is not out until the handler returns."""
        self._handling += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._handling -= 1
            if not self._handling:
                self._idle.set()

    def replied(self) -> None:
        """An Allocate's reply was just handed to the connection."""
        self._replied_at = self._clock()

    async def wait(self) -> None:
        """Until no Allocate is being handled and the last reply has had its head start."""
        while True:
            await self._idle.wait()
            left = self._replied_at + self.headstart - self._clock()
            if left <= 0:
                return
            await asyncio.sleep(left)
