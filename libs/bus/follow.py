"""Follow the node's committed events in seq order, from any position, through JetStream.

An ordered consumer (ephemeral, flow-controlled) starting at ``after_seq + 1``. Because stream seq ==
log seq, a follower that folds events and remembers its last seq can stop and resume without missing
or repeating anything; ``LedgerState.apply`` also refuses gaps. The follower's own position is the
only state: after a reconnect (the broker may have restarted and forgotten the ephemeral consumer), a
gap, or an error, it subscribes again from ``last_seq + 1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from nats.js import api
from nats.js.errors import APIError, NotFoundError

from libs.bus.cancel import raise_if_cancelling
from libs.bus.client import Bus
from libs.bus.outbox import ROW_HASH_HEADER
from libs.events.codec import EventRecord, StoredEvent, from_record
from libs.logger import bound, correlation, get_logger

__all__ = ["LogFollower", "raise_if_cancelling"]

_logger = get_logger("follow")

Handler = Callable[[StoredEvent], Awaitable[None] | None]

# A reconnect (a broker restart forgets the consumer) ends the follower's wait at once, through the
# bus's reconnect hook; an idle follower also looks this often whether one happened, in case it missed
# the hook. Not sooner: each look wakes an idle service.
IDLE_CHECK_S = 5.0
RETRY_S = 0.5  # after an error of the broker's, before subscribing again


class LogFollower:
    def __init__(self, bus: Bus, handler: Handler, *, after_seq: int = 0, idle_check: float = IDLE_CHECK_S) -> None:
        self.bus = bus
        self.handler = handler
        self.last_seq = after_seq
        self.idle_check = idle_check  # how often an idle follower checks that its subscription survived
        self._progress = asyncio.Condition()
        self._waiting: asyncio.Timeout | None = None  # the wait for the next message, while there is one

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
                    _logger.info("waiting for the event stream", stream=stream)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        while True:
            try:
                await self._follow_once(stream)
            except (nats.errors.Error, APIError, OSError) as exc:
                raise_if_cancelling(exc)
                # The broker went away (or restarted and forgot our ephemeral consumer): start again
                # from our own position, which is all the state a follower needs. Once the connection
                # is back, at once.
                _logger.info("resubscribing to the event stream", after_seq=self.last_seq,
                          reason=str(exc) or type(exc).__name__)
                if not isinstance(exc, _Reconnected):
                    await asyncio.sleep(RETRY_S)

    async def _follow_once(self, stream: str) -> None:
        reconnects = self.bus.reconnects
        sub = await self.bus.js.subscribe(
            f"{self.bus.subjects.prefix}.>",
            stream=stream,
            ordered_consumer=True,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.last_seq + 1
            ),
        )
        self.bus.on_reconnect.append(self._wake)
        try:
            while True:
                raise_if_cancelling(None)
                if self.bus.reconnects != reconnects:
                    raise _Reconnected()
                try:
                    async with asyncio.timeout(self.idle_check) as self._waiting:
                        msg = await sub.next_msg(timeout=None)
                except TimeoutError as exc:  # idle, or woken by a reconnect
                    raise_if_cancelling(exc)
                    continue
                finally:
                    self._waiting = None
                record = msgspec.json.decode(msg.data, type=EventRecord)
                if record.seq <= self.last_seq:
                    continue
                if record.seq != self.last_seq + 1:  # a gap: never skip events, read from our position again
                    raise _Gap(f"gap: expected seq {self.last_seq + 1}, got {record.seq}")
                stored = from_record(record)
                if msg.headers and ROW_HASH_HEADER in msg.headers:  # the row's chain hash (a restore checks it)
                    stored = msgspec.structs.replace(stored, row_hash=msg.headers[ROW_HASH_HEADER])
                # The command that caused the event (an Allocate's request id) and the allocation and pod it
                # concerns: the handler's log lines can be followed back to it.
                with bound(**correlation(stored.event, request_id=stored.command_id), seq=stored.seq):
                    result = self.handler(stored)
                    if inspect.isawaitable(result):
                        await result
                async with self._progress:
                    self.last_seq = stored.seq
                    self._progress.notify_all()
        finally:
            self.bus.on_reconnect.remove(self._wake)
            with contextlib.suppress(nats.errors.Error, APIError, OSError):
                await sub.unsubscribe()

    def _wake(self) -> None:
        """The connection came back: end the wait for the next message now (the loop resubscribes)."""
        if self._waiting is not None:
            self._waiting.reschedule(asyncio.get_running_loop().time())


class _Reconnected(nats.errors.Error):
    """The connection was re-established: resubscribe from our own position."""


class _Gap(nats.errors.Error):
    """An event is missing from what the consumer delivered: resubscribe from our own position."""
