"""The one polling wait of the tests: check a condition that has no event to wait on, until it holds.

Use it for state that lives in another component, on disk or behind a request (counters, files, a
pod store, /metrics); wait on an event or a condition instead where the code under test offers one.
Every call names its timeout, its interval and what it waits for, so a failure says what never came.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(predicate: Callable[[], T | Awaitable[T]], *, timeout: float, interval: float, what: str) -> T:
    """Call ``predicate`` (plain or async) every ``interval`` seconds until it returns something truthy,
    and return that. The whole wait, a predicate call in flight included, is bounded by ``timeout``;
    past it, an AssertionError says ``what`` never came."""
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            while True:
                result = predicate()
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    return result  # type: ignore[return-value]
                await asyncio.sleep(interval)
    except TimeoutError:
        if not scope.expired():
            raise  # the predicate's own timeout, not ours: let it tell its story
        raise AssertionError(f"not within {timeout} s: {what}") from None
