"""Moving older events out of the live log: ``allocator.archive`` on request, and the retention setting.

The allocator is the log's only writer, so it is the only one that archives (libs/store/archive.py has
the steps and their crash safety); the CLI's ``gpuledger log archive`` asks it over NATS. Two bounds
keep what a running allocator needs in the live log:
- a fresh snapshot is written first and the archive stops before its seq, so the next start reads the
  snapshot and the live tail, never a segment;
- the archive stops at what the outbox relay has published, so the relay never needs an archived row.
One archive runs at a time; appends go on meanwhile (each delete chunk holds the write lock briefly).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from libs.bus import Bus
from libs.commands import ArchiveReply, ArchiveRequest
from libs.errors import ServiceError, StoreError
from libs.ledger.snapshot import SnapshotKeeper
from libs.logger import get_logger
from libs.store.archive import archive_prefix, cut_for, live_bounds

__all__ = ["Archiver"]

_logger = get_logger("archiver")

RETENTION_CHECK_S = 30.0


class Archiver:
    def __init__(
        self,
        log_path: Path,
        snapshots: SnapshotKeeper,
        published: Callable[[], int],
        *,
        retention: int = 0,
    ) -> None:
        self.log_path = log_path
        self.snapshots = snapshots
        self.published = published
        self.retention = retention
        self._lock = asyncio.Lock()

    async def serve(self, bus: Bus) -> None:
        await bus.serve(bus.subjects.archive, ArchiveRequest, self.handle)

    async def handle(self, req: ArchiveRequest) -> ArchiveReply:
        if req.before < 0 or req.keep_events < 0 or (not req.before and not req.keep_events):
            raise ServiceError(400, "give a time (before) or a number of events to keep (keep_events), not negative")
        try:
            return await self.archive(before_ns=req.before or None, keep_events=req.keep_events or None)
        except StoreError as exc:
            raise ServiceError(409, str(exc)) from exc

    async def archive(self, *, before_ns: int | None = None, keep_events: int | None = None) -> ArchiveReply:
        async with self._lock:
            await self.snapshots.save()  # start-up must never need what leaves the live log
            limit = min(self.snapshots.saved_seq - 1, self.published())
            wanted = await asyncio.to_thread(cut_for, self.log_path, before_ns=before_ns, keep_events=keep_events)
            upto = await asyncio.to_thread(cut_for, self.log_path, before_ns=before_ns, keep_events=keep_events,
                                           limit=limit)
            note = ""
            if wanted > upto:
                note = (f"stopped at seq {upto} instead of {wanted}: the newest snapshot and the events not yet "
                        "published on the stream stay in the live log")
            seg = await asyncio.to_thread(archive_prefix, self.log_path, upto) if upto else None
            first = await asyncio.to_thread(self._live_first)
            if seg is None:
                return ArchiveReply(archived=0, live_first_seq=first, note=note or "nothing to archive")
            return ArchiveReply(archived=seg.events, file=seg.file, first_seq=seg.first_seq, last_seq=seg.last_seq,
                                live_first_seq=first, note=note)

    def _live_first(self) -> int:
        import sqlite3

        conn = sqlite3.connect(f"file:{self.log_path}?mode=ro", uri=True)
        try:
            return live_bounds(conn)[0]
        finally:
            conn.close()

    def due(self, live_first: int, last_seq: int) -> bool:
        """Archive once the live log exceeds the retention by a quarter: segments of retention/4 events."""
        return bool(self.retention) and last_seq - live_first + 1 > self.retention + max(1, self.retention // 4)

    async def retention_forever(self, last_seq: Callable[[], int], interval: float = RETENTION_CHECK_S) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                if self.due(await asyncio.to_thread(self._live_first), last_seq()):
                    reply = await self.archive(keep_events=self.retention)
                    _logger.info("retention archive", archived=reply.archived, file=reply.file, note=reply.note)
            except (StoreError, OSError) as exc:  # retried at the next check; the live log is intact
                _logger.error("retention archive failed", error=str(exc))
