"""The recorder's durable consumer of the fleet stream.

One pull consumer (``fleet-recorder``, ack-all) reads the fleet stream in order; each fetched batch is
folded and stored in one database transaction, then acknowledged. A recorder killed between the two
gets the batch again and the projection skips what it already holds (by node and seq), so each event
is stored once. The fleet stream's per-source state (how far behind each node the stream is, when a
source last delivered) is read every few seconds for the metrics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import nats.errors
from nats.js import api

from libs.bus import Bus
from libs.events.subjects import unescape_token
from libs.fleet.naming import FLEET_STREAM
from libs.logger import get_logger
from services.fleet.projection import Batch, FleetMessage, FleetProjection

__all__ = ["DURABLE", "FleetIngest", "SourceState"]

DURABLE = "fleet-recorder"
_logger = get_logger("fleet-ingest")


@dataclass
class SourceState:
    lag: int = 0           # events the node's stream holds that the fleet stream does not yet
    active_s: float = 0.0  # seconds since the source last delivered (or heard from) the node
    error: str = ""


@dataclass
class FleetIngest:
    bus: Bus
    projection: FleetProjection
    batch_size: int = 500
    ingested: int = 0
    duplicates: int = 0
    gaps: int = 0
    rejected: int = 0
    pending: int = 0  # fleet stream messages not yet consumed
    sources: dict[str, SourceState] = field(default_factory=dict)
    stored_at: float = 0.0
    _progress: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        sub = None
        while sub is None:  # the stream may not exist yet (no node joined): wait for it
            try:
                sub = await self.bus.js.pull_subscribe(
                    "gpuledger.>", durable=DURABLE, stream=FLEET_STREAM,
                    config=api.ConsumerConfig(ack_policy=api.AckPolicy.ALL, ack_wait=30,
                                              max_ack_pending=20_000, deliver_policy=api.DeliverPolicy.ALL))
            except (TimeoutError, nats.errors.Error, OSError) as exc:
                _logger.warning("fleet stream not readable yet", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(1.0)
        while True:
            try:
                msgs = await sub.fetch(self.batch_size, timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            except (nats.errors.Error, OSError) as exc:
                _logger.warning("fleet fetch failed", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(0.5)
                continue
            if not msgs:
                continue
            batch = [FleetMessage(m.metadata.sequence.stream, m.subject, dict(m.headers or {}), m.data) for m in msgs]
            outcome = await asyncio.to_thread(self.projection.apply, batch)
            await msgs[-1].ack()
            self._count(outcome)
            self.pending = msgs[-1].metadata.num_pending or 0

    def _count(self, outcome: Batch) -> None:
        self.ingested += sum(outcome.stored.values())
        self.duplicates += outcome.duplicates
        self.gaps += outcome.gaps
        self.rejected += len(outcome.rejected)
        for r in outcome.rejected:
            _logger.error("fleet event refused", subject=r.subject, source=r.source, reason=r.reason)
        self.stored_at = time.time()
        self._progress.set()

    async def wait_progress(self, timeout: float) -> None:
        """Until the next batch is stored (tests)."""
        self._progress.clear()
        await asyncio.wait_for(self._progress.wait(), timeout)

    async def watch_sources(self, interval: float = 5.0) -> None:
        while True:
            try:
                info = await self.bus.js.stream_info(FLEET_STREAM)
                fresh = {}
                for s in info.sources or []:
                    node = unescape_token(s.name.removeprefix("GPULEDGER_"))
                    fresh[node] = SourceState(lag=s.lag or 0, active_s=(s.active or 0) / 1e9,
                                              error=str((s.error or {}).get("description", "")))
                self.sources = fresh
            except (TimeoutError, nats.errors.Error, OSError) as exc:
                _logger.warning("fleet stream info unavailable", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(interval)
