"""A stop that a NATS call loses on the way (Python 3.11's wait_for inside nats-py) still stops the caller."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from libs.bus.cancel import honour_cancel


async def reply_racing_the_cancel() -> str:
    """What a nats-py request does on Python 3.11 when its reply and the cancel arrive in one loop turn."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        return "reply"
    return "late reply"


async def error_racing_the_cancel() -> str:
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        raise OSError("stream not found") from None
    return "late reply"


async def stops(call: Callable[[], Awaitable[object]]) -> bool:
    """Whether a task awaiting ``call`` ends, cancelled, when cancelled while the call is under way."""

    async def caller() -> None:
        await call()
        await asyncio.sleep(10)  # a relay's next round

    task = asyncio.create_task(caller())
    await asyncio.sleep(0)  # the call is under way
    task.cancel()
    await asyncio.wait([task], timeout=0.5)
    if task.done():
        return task.cancelled()
    task.cancel()  # a second request: the sleep takes it
    await asyncio.wait([task], timeout=0.5)
    return False


async def test_a_lost_cancel_lets_a_plain_caller_run_on() -> None:
    assert not await stops(reply_racing_the_cancel)


async def test_a_lost_cancel_still_stops_the_caller() -> None:
    assert await stops(lambda: honour_cancel(reply_racing_the_cancel()))
    assert await stops(lambda: honour_cancel(error_racing_the_cancel()))


async def test_an_uncancelled_call_returns_or_raises_as_usual() -> None:
    async def reply() -> str:
        return "reply"

    async def error() -> str:
        raise OSError("stream not found")

    assert await honour_cancel(reply()) == "reply"
    with pytest.raises(OSError, match="stream not found"):
        await honour_cancel(error())
