"""Follow the node's committed events in seq order, from any position, through JetStream.

An ordered consumer (ephemeral, flow-controlled, recreated by the client on gaps) starting at
``after_seq + 1``. Because stream seq == log seq, a follower that folds events and remembers its last
seq can stop and resume without missing or repeating anything; ``LedgerState.apply`` also refuses gaps.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

import msgspec
import structlog
from nats.js import api
from nats.js.errors import NotFoundError

from libs.bus.client import Bus
from libs.events.codec import EventRecord, StoredEvent, from_record
from libs.log import correlation, get_logger

__all__ = ["LogFollower"]

_log = get_logger("follow")

Handler = Callable[[StoredEvent], Awaitable[None] | None]


class LogFollower:
    def __init__(self, bus: Bus, handler: Handler, *, after_seq: int = 0) -> None:
        self.bus = bus
        self.handler = handler
        self.last_seq = after_seq
        self._progress = asyncio.Condition()

    async def wait_for(self, seq: int, timeout: float) -> None:
        """Wait until events up to ``seq`` have been handled."""
        async with asyncio.timeout(timeout), self._progress:
            await self._progress.wait_for(lambda: self.last_seq >= seq)

    async def run(self) -> None:
        stream = self.bus.subjects.stream
        delay = 0.1
        while True:  # the allocator creates the stream; until then there is nothing to follow
            try:
                await self.bus.js.stream_info(stream)
                break
            except NotFoundError:
                if delay >= 1.0:
                    _log.info("waiting for the event stream", stream=stream)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        sub = await self.bus.js.subscribe(
            f"{self.bus.subjects.prefix}.>",
            stream=stream,
            ordered_consumer=True,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.last_seq + 1
            ),
        )
        try:
            async for msg in sub.messages:
                record = msgspec.json.decode(msg.data, type=EventRecord)
                if record.seq <= self.last_seq:
                    continue
                stored = from_record(record)
                # The command that caused the event (an Allocate's request id): its log lines follow it here.
                # The command that caused the event (an Allocate's request id) and the allocation and pod it
                # concerns: the handler's log lines can be followed back to it.
                bound = correlation(stored.event, request_id=stored.command_id)
                with structlog.contextvars.bound_contextvars(**bound, seq=stored.seq):
                    result = self.handler(stored)
                    if inspect.isawaitable(result):
                        await result
                async with self._progress:
                    self.last_seq = stored.seq
                    self._progress.notify_all()
        finally:
            await sub.unsubscribe()
