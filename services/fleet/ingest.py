"""The recorder's durable consumer of the fleet stream.

One pull consumer (``fleet-recorder``, ack-all) reads the fleet stream in order; each fetched batch is
folded and stored in one database transaction, then acknowledged. A recorder killed between the two
gets the batch again and the projection skips what it already holds (by node and seq), so each event
is stored once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import nats.errors
from nats.js import api

from libs.bus import Bus
from libs.fleet.naming import FLEET_STREAM
from libs.logger import get_logger
from services.fleet.projection import Batch, FleetMessage, FleetProjection

__all__ = ["DURABLE", "FleetIngest"]

DURABLE = "fleet-recorder"
_logger = get_logger("fleet-ingest")


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

