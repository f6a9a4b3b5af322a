"""Supervisor.aclose is bounded: a task that ignores its cancellation cannot hold a service's stop."""

from __future__ import annotations

import asyncio
import contextlib
import time

from libs.runtime import Supervisor


async def test_aclose_returns_even_when_a_task_ignores_cancellation() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)

    sup = Supervisor("t")
    task = sup.spawn(stubborn(), "stubborn")
    await asyncio.sleep(0)
    started = time.monotonic()
    await asyncio.wait_for(sup.aclose(timeout=0.2), timeout=5)
    assert time.monotonic() - started < 2
    assert not task.done()  # reported, not waited for
    release.set()
    task.cancel()
    await asyncio.wait({task}, timeout=5)


async def test_aclose_waits_for_tasks_that_stop() -> None:
    stopped = asyncio.Event()

    async def polite() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            stopped.set()

    sup = Supervisor("t")
    sup.spawn(polite(), "polite")
    await asyncio.sleep(0)
    await sup.aclose()
    assert stopped.is_set()
