"""Stopping a task that waits on NATS: a cancellation must never get lost below us.

nats-py waits for a reply with ``asyncio.wait_for``; on Python 3.11 that returns the reply (or raises
the reply's error) instead of CancelledError when the reply and the cancellation arrive in the same
loop turn, and its flush swallows CancelledError outright. The task then runs on as if nobody had
asked it to stop, and whoever awaits it after ``cancel()`` (a service's shutdown, a test) waits forever.
The request is counted in ``Task.cancelling()`` all the same, which is what these helpers check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["honour_cancel", "raise_if_cancelling"]

T = TypeVar("T")


def raise_if_cancelling(exc: BaseException | None) -> None:
    """A cancellation can get lost below us: ``next_msg`` turns it into ConnectionClosedError on a
    closing connection, and Python 3.11's ``wait_for`` inside it can swallow a cancellation that
    races its timeout or its result. A follower being stopped must stop, not read on."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from exc


async def honour_cancel(call: Awaitable[T]) -> T:
    """Await one NATS call (a JetStream API request, a publish) in the current task, then raise
    CancelledError if the task was cancelled meanwhile, whatever the call returned or raised."""
    try:
        result = await call
    except Exception as exc:
        raise_if_cancelling(exc)
        raise
    raise_if_cancelling(None)
    return result
