"""A broadcast "something changed" signal for waiters that re-check a predicate."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["Changes"]


class Changes:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        # Wake everyone waiting on the current event, and hand later waiters a fresh one.
        self._event.set()
        self._event = asyncio.Event()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float, *, poll: float = 0.2) -> None:
        """Return once `predicate()` holds; TimeoutError after `timeout`.

        Also re-checks every `poll` seconds, for conditions that change with time alone (an
        endpoint's removal grace running out).
        """
        async with asyncio.timeout(timeout):
            while not predicate():
                event = self._event
                try:
                    async with asyncio.timeout(poll):
                        await event.wait()
                except TimeoutError:
                    pass
