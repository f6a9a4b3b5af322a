"""The outbox relay: publishes each committed log event to the node's JetStream stream exactly once.

The log is the outbox and the relay keeps no cursor of its own. Its position is the stream's
``last_seq`` and every message k carries ``Nats-Expected-Last-Sequence: k-1``, so JetStream accepts
event k only right after event k-1: a message that was stored but whose ack was lost is refused when
re-sent (error 10071), and the relay resyncs from the stream instead of publishing twice. Stream
sequence numbers therefore equal log seq numbers, which is what lets a consumer resume "after seq N".

The log is the truth, the broker's store is not. If the stream is missing (the broker's store was lost
while it was down), holds more than the log, or a different event at the same seq (a broker that
holds another history: a wiped state dir, a restored backup, a store reused for another log), the
relay rebuilds the stream from the log: it deletes it, creates it afresh and publishes the log again
from seq 1, so stream seq == log seq still holds. It says so loudly (an error line), records it in
the stream's metadata (``gpuledger.rebuilt``, with the time and the cause) and publishes a core
message on ``gpuledger.<node>.stream.rebuilt``, so that subscribers learn that what they read before
may not be what the stream now holds. The relay never stops publishing for a disagreement.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import nats.errors
from nats.js import api
from nats.js.errors import APIError, NotFoundError

from libs.bus.cancel import honour_cancel, raise_if_cancelling
from libs.bus.client import Bus
from libs.events.codec import StoredEvent, to_record
from libs.logger import get_logger

if TYPE_CHECKING:  # only the allocator, which holds the log, runs a relay: the others need no SQL
    from libs.store.log import EventLog

__all__ = [
    "EVENT_ID_HEADER", "REBUILT_METADATA", "ROW_HASH_HEADER", "Relay", "StreamRebuilt", "ensure_stream",
    "rebuilt_subject",
]

EVENT_ID_HEADER = "Gpuledger-Event-Id"
ROW_HASH_HEADER = "Gpuledger-Row-Hash"  # the row's chain hash in the log (hex), carried to the fleet stream
REBUILT_METADATA = "gpuledger.rebuilt"  # stream metadata key: "<RFC 3339 time> <cause>" of the last rebuild
WRONG_LAST_SEQUENCE = 10071

_logger = get_logger("outbox")


class StreamRebuilt(msgspec.Struct, frozen=True):
    """The core message on ``gpuledger.<node>.stream.rebuilt`` (not in the stream itself)."""

    node: str
    stream: str
    cause: str
    log_last_seq: int  # the stream is republished from seq 1 up to here (and on, as usual)
    stream_last_seq_before: int  # what the replaced stream held (0: it was missing)
    at: str  # RFC 3339, UTC


def rebuilt_subject(bus: Bus) -> str:
    return f"{bus.subjects.prefix}.stream.rebuilt"


def _stream_config(bus: Bus, metadata: dict[str, str] | None = None, first_seq: int | None = None) -> api.StreamConfig:
    return api.StreamConfig(
        name=bus.subjects.stream,
        subjects=bus.subjects.event_subjects(),
        storage=api.StorageType.FILE,
        retention=api.RetentionPolicy.LIMITS,
        deny_delete=True,
        deny_purge=True,
        allow_direct=True,
        description=f"gpuledger allocation log of node {bus.subjects.node}; seq == log seq",
        metadata=metadata,
        first_seq=first_seq,
    )


async def ensure_stream(bus: Bus, *, first_seq: int | None = None) -> api.StreamInfo:
    """Create (or widen) the node's stream: file storage, no deletes, no purges, no limits.
    ``first_seq``: where a stream created now starts (a log whose older events were archived)."""
    js = bus.js
    subjects = bus.subjects.event_subjects()
    config = _stream_config(bus, first_seq=first_seq)
    try:
        info = await honour_cancel(js.stream_info(config.name))
    except NotFoundError:
        return await honour_cancel(js.add_stream(config))
    if sorted(info.config.subjects or []) != sorted(subjects):
        config.metadata = info.config.metadata  # keep the record of an earlier rebuild
        return await honour_cancel(js.update_stream(config))
    return info


HOLD_AT_MOST_S = 0.05  # how long one publication round waits for its owner's replies (Relay ``replies_out``)


class Relay:
    def __init__(self, bus: Bus, event_log: EventLog, *, poll_interval: float = 0.25, window: int = 64,
                 replies_out: Callable[[], Awaitable[None]] | None = None) -> None:
        """``replies_out``: awaited (for at most HOLD_AT_MOST_S) before each publication round, until
        the owner's requests in flight are answered: what a commit's own waiter does next (an
        Allocate waits for the kubelet's List after its append, then replies) then does not share
        the node's CPUs with the subscribers this publication wakes."""
        self.bus = bus
        self._replies_out = replies_out
        self.event_log = event_log
        self.poll_interval = poll_interval
        self.window = window
        self.published = 0  # last seq known to be in the stream
        self.rebuilds = 0  # times this relay rebuilt the stream from the log
        self._marked = False  # whether the "published before" marker is known to be on disk
        self._wake = asyncio.Event()
        self._synced = asyncio.Event()
        # Events just committed, handed over in memory so that publishing does not read them back
        # from SQLite; the log stays the source whenever this buffer does not continue the stream.
        self._recent: deque[StoredEvent] = deque(maxlen=4096)
        event_log.on_events(self._recent.extend)
        event_log.on_commit(lambda _seq: self._wake.set())

    async def wait_published(self, seq: int, timeout: float) -> None:
        """Wait until the stream holds ``seq`` (tests and the CLI use it; services never need to)."""
        async with asyncio.timeout(timeout):
            while self.published < seq:
                self._synced.clear()
                await self._synced.wait()

    async def run(self) -> None:
        """Publish until cancelled. Every NATS call awaited here directly goes through ``honour_cancel``:
        a stop that nats-py lost on the way (see libs.bus.cancel) must end the relay, not leave it
        running while its owner waits for it (the publishes run under gather, which re-raises it)."""
        backoff = 0.1
        while True:  # the broker may not be up yet: the events wait in the log
            try:
                await self._resync()
                break
            except (nats.errors.Error, APIError, OSError) as exc:
                _logger.warning("publication not started", error=str(exc) or type(exc).__name__, retry_in=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        backoff = 0.1
        while True:
            # A commit wakes the relay; it looks again on its own only while events wait to be published
            # (a failed round), never when idle: each look would wake an idle allocator.
            behind = self.published < self.event_log.last_seq
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval if behind else None):
                    await self._wake.wait()
            self._wake.clear()
            await self._after_replies()
            raise_if_cancelling(None)  # a stop that a NATS call below lost must still end the relay
            try:
                await self._publish_pending()
                backoff = 0.1
            except _Resync:
                with contextlib.suppress(nats.errors.Error, APIError, OSError, _Resync):
                    await self._resync()
            except (nats.errors.Error, APIError, OSError) as exc:
                # The broker is away or busy: the events wait in the log; try again shortly.
                _logger.warning("publication paused", error=str(exc) or type(exc).__name__, retry_in=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                with contextlib.suppress(nats.errors.Error, APIError, OSError, _Resync):
                    await self._resync()

    async def _after_replies(self) -> None:
        """The owner's requests in flight answered (bounded), then one loop turn: what the commit's own
        waiter sends (an Allocate's reply) is written before these events' publication."""
        if self._replies_out is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HOLD_AT_MOST_S):
                    await self._replies_out()
        await asyncio.sleep(0)

    async def _resync(self) -> None:
        stream = self.bus.subjects.stream
        try:
            await honour_cancel(self.bus.js.stream_info(stream))
        except NotFoundError:
            # A stream that this log was published to before is lost: its subscribers must hear of it (a
            # log with archived events was: only published events are archived). A node's first start
            # (its first events committed before the relay ran) simply creates it.
            if self.event_log.last_seq and (self._published_before() or await self._archived()):
                await self._rebuild("the stream is missing (the broker's store was lost or replaced)", 0)
                return
        info = await ensure_stream(self.bus)  # creates it for a new node, widens its subjects after an upgrade
        stream_last = info.state.last_seq
        log_last = self.event_log.last_seq
        if stream_last > log_last:
            await self._rebuild(f"the stream holds {stream_last} events but the log at {self.event_log.path} only "
                                f"{log_last} (a broker holding another history, or a log restored from an "
                                "older copy: the log is the truth)", stream_last)
            return
        if stream_last and (fork := await self._fork_at(stream_last)):
            await self._rebuild(fork, stream_last)
            return
        self.published = stream_last
        self._synced.set()
        self._wake.set()

    async def _fork_at(self, seq: int) -> str | None:
        """Why the stream's event at ``seq`` is not the log's (None when it is)."""
        msg = await honour_cancel(self.bus.js.get_msg(self.bus.subjects.stream, seq))
        mine = await self.event_log.read_after(seq - 1, 1)
        theirs = (msg.headers or {}).get(EVENT_ID_HEADER)
        if mine and theirs == mine[0].event_id:
            return None
        return (f"the log and the stream disagree at seq {seq} (log event {mine[0].event_id if mine else None}, "
                f"stream event {theirs}): histories forked")

    async def _rebuild(self, cause: str, stream_last: int) -> None:
        """Replace the stream by one republished from the log, from seq 1; tell subscribers.

        When older events were archived (libs/store/archive.py), the live log starts later: the new
        stream then starts at that seq (``first_seq``), so stream seq == log seq still holds and the
        archived events are read from the archive."""
        subjects, js = self.bus.subjects, self.bus.js
        at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        _logger.error("rebuilding the event stream from the log", stream=subjects.stream, cause=cause,
                      log_last_seq=self.event_log.last_seq, stream_last_seq=stream_last)
        with contextlib.suppress(NotFoundError):
            await honour_cancel(js.delete_stream(subjects.stream))
        oldest = await self.event_log.read_after(0, 1)
        first = oldest[0].seq if oldest else 1
        config = _stream_config(self.bus, {REBUILT_METADATA: f"{at} {cause}"}, first if first > 1 else None)
        await honour_cancel(js.add_stream(config))
        self.rebuilds += 1
        notice = StreamRebuilt(node=subjects.node, stream=subjects.stream, cause=cause,
                               log_last_seq=self.event_log.last_seq, stream_last_seq_before=stream_last, at=at)
        await honour_cancel(self.bus.publish(rebuilt_subject(self.bus), notice))
        self.published = first - 1
        self._synced.set()
        self._wake.set()

    async def _publish_pending(self) -> None:
        while self.published < self.event_log.last_seq:
            batch = self._recent_after(self.published) or await self.event_log.read_after(self.published, 512)
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
                self._note_published()

    async def _archived(self) -> bool:
        oldest = await self.event_log.read_after(0, 1)
        return bool(oldest) and oldest[0].seq > 1

    def _marker(self) -> Path:
        return Path(f"{self.event_log.path}.published")

    def _published_before(self) -> bool:
        """Whether this log's events ever reached a stream (a marker beside the log, written once)."""
        return self._marked or self._marker().exists()

    def _note_published(self) -> None:
        if not self._marked:
            with contextlib.suppress(OSError):  # only the loss notice depends on it, never publication
                self._marker().touch()
            self._marked = True

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
                **({ROW_HASH_HEADER: stored.row_hash} if stored.row_hash else {}),
            },
        )


class _Resync(Exception):
    """The stream's position is not what we thought: read it again."""
