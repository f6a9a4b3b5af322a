"""The outbox relay: publishes each committed log event to the node's JetStream stream exactly once.

The log is the outbox and the relay keeps no cursor of its own. Its position is the stream's
``last_seq`` and every message k carries ``Nats-Expected-Last-Sequence: k-1``, so JetStream accepts
event k only right after event k-1: a message that was stored but whose ack was lost is refused when
re-sent (error 10071), and the relay resyncs from the stream instead of publishing twice. Stream
sequence numbers therefore equal log seq numbers, which is what lets a consumer resume "after seq N".

If the stream holds more than the log, or a different event at the same seq, the two histories have
forked (a restored backup, a wiped state dir against an old broker). The relay then stops with an
error that says so, instead of publishing on top of a history it does not share.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque

import msgspec
import nats.errors
from nats.js import api
from nats.js.errors import APIError, NotFoundError

from libs.bus.client import Bus
from libs.errors import StoreError
from libs.events.codec import StoredEvent, to_record
from libs.log import get_logger
from libs.store.log import EventLog

__all__ = ["EVENT_ID_HEADER", "Relay", "ensure_stream"]

EVENT_ID_HEADER = "Gpuledger-Event-Id"
WRONG_LAST_SEQUENCE = 10071

_log = get_logger("outbox")


async def ensure_stream(bus: Bus) -> api.StreamInfo:
    """Create (or widen) the node's stream: file storage, no deletes, no purges, no limits."""
    js = bus.js
    subjects = bus.subjects.event_subjects()
    config = api.StreamConfig(
        name=bus.subjects.stream,
        subjects=subjects,
        storage=api.StorageType.FILE,
        retention=api.RetentionPolicy.LIMITS,
        deny_delete=True,
        deny_purge=True,
        allow_direct=True,
        description=f"gpuledger allocation log of node {bus.subjects.node}; seq == log seq",
    )
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        return await js.add_stream(config)
    if sorted(info.config.subjects or []) != sorted(subjects):
        return await js.update_stream(config)
    return info


class Relay:
    def __init__(self, bus: Bus, log: EventLog, *, poll_interval: float = 0.25, window: int = 64) -> None:
        self.bus = bus
        self.log = log
        self.poll_interval = poll_interval
        self.window = window
        self.published = 0  # last seq known to be in the stream
        self._wake = asyncio.Event()
        self._synced = asyncio.Event()
        # Events just committed, handed over in memory so that publishing does not read them back
        # from SQLite; the log stays the source whenever this buffer does not continue the stream.
        self._recent: deque[StoredEvent] = deque(maxlen=4096)
        log.on_events(self._recent.extend)
        log.on_commit(lambda _seq: self._wake.set())

    async def wait_published(self, seq: int, timeout: float) -> None:
        """Wait until the stream holds ``seq`` (tests and the CLI use it; services never need to)."""
        async with asyncio.timeout(timeout):
            while self.published < seq:
                self._synced.clear()
                await self._synced.wait()

    async def run(self) -> None:
        await ensure_stream(self.bus)
        await self._resync()
        backoff = 0.1
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self._publish_pending()
                backoff = 0.1
            except _Resync:
                await self._resync()
            except (nats.errors.Error, APIError, OSError) as exc:
                # The broker is away or busy: the events wait in the log; try again shortly.
                _log.warning("publication paused", error=str(exc) or type(exc).__name__, retry_in=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                with contextlib.suppress(nats.errors.Error, APIError, OSError, _Resync):
                    await self._resync()

    async def _resync(self) -> None:
        info = await self.bus.js.stream_info(self.bus.subjects.stream)
        stream_last = info.state.last_seq
        log_last = self.log.last_seq
        if stream_last > log_last:
            raise StoreError(
                f"JetStream stream {self.bus.subjects.stream} holds {stream_last} events but the log at "
                f"{self.log.path} only {log_last}: the log lost its tail or belongs to another history. "
                "Restore the log, or remove the stream if this node really starts afresh."
            )
        if stream_last:
            await self._check_same_history(stream_last)
        self.published = stream_last
        self._synced.set()
        self._wake.set()

    async def _check_same_history(self, seq: int) -> None:
        msg = await self.bus.js.get_msg(self.bus.subjects.stream, seq)
        mine = await self.log.read_after(seq - 1, 1)
        theirs = (msg.headers or {}).get(EVENT_ID_HEADER)
        if not mine or theirs != mine[0].event_id:
            raise StoreError(
                f"the log and stream {self.bus.subjects.stream} disagree at seq {seq} "
                f"(log event {mine[0].event_id if mine else None}, stream event {theirs}): histories forked"
            )

    async def _publish_pending(self) -> None:
        while self.published < self.log.last_seq:
            batch = self._recent_after(self.published) or await self.log.read_after(self.published, 512)
            if not batch:
                return
            for start in range(0, len(batch), self.window):
                chunk = batch[start : start + self.window]
                results = await asyncio.gather(*(self._publish(ev) for ev in chunk), return_exceptions=True)
                for stored, result in zip(chunk, results, strict=True):
                    if isinstance(result, BaseException):
                        if getattr(result, "err_code", None) == WRONG_LAST_SEQUENCE:
                            raise _Resync from result
                        raise result
                    self.published = stored.seq
                self._synced.set()

    def _recent_after(self, seq: int, limit: int = 512) -> list[StoredEvent]:
        recent = self._recent
        while recent and recent[0].seq <= seq:
            recent.popleft()
        if not recent or recent[0].seq != seq + 1:
            return []
        return list(itertools.islice(recent, limit))

    async def _publish(self, stored: StoredEvent) -> None:
        subjects = self.bus.subjects
        await self.bus.js.publish(
            subjects.event(stored.type),
            msgspec.json.encode(to_record(stored)),
            stream=subjects.stream,
            headers={
                "Nats-Expected-Last-Sequence": str(stored.seq - 1),
                "Nats-Msg-Id": f"{subjects.stream}:{stored.seq}",
                EVENT_ID_HEADER: stored.event_id,
                "Gpuledger-Type": stored.type,
            },
        )


class _Resync(Exception):
    """The stream's position is not what we thought: read it again."""
