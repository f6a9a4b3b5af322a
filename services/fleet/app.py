"""Fleet recorder composition root: the fleet stream (central cluster) -> the SQL projection, the
witness of every node's checkpoints (its state in the same database), the watch over the fleet
stream's sources, /metrics. Usually one per cluster (``gpuledger fleet record``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine, create_engine

from libs.bus import Bus
from libs.config import Settings
from libs.fleet.credentials import load_credentials, with_credentials
from libs.fleet.naming import HUB_INBOX
from libs.logger import get_logger
from libs.runtime import Supervisor
from services.fleet.ingest import FleetIngest
from services.fleet.metrics import observe
from services.fleet.projection import FleetProjection
from services.fleet.sources import SourceWatch
from services.fleet.witness import WitnessDesk, open_witness

__all__ = ["FleetService", "open_engine", "service"]

_logger = get_logger("fleet")


@dataclass
class FleetService:
    ingest: FleetIngest
    watch: SourceWatch
    desk: WitnessDesk
    projection: FleetProjection
    supervisor: Supervisor


def open_engine(url: str) -> Engine:
    """SQLite (the default, embedded) or PostgreSQL (``postgresql+psycopg://...``)."""
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return create_engine(url, pool_pre_ping=True)


@asynccontextmanager
async def service(settings: Settings, *, source_interval: float = 1.0) -> AsyncIterator[FleetService]:
    async with AsyncExitStack() as stack:
        creds = load_credentials(settings.fleet_credentials) if settings.fleet_credentials else None
        bus = await Bus.connect(with_credentials(settings.nats_url, creds), name="fleet-recorder", node="fleet",
                                inbox_prefix=HUB_INBOX)
        stack.push_async_callback(bus.close)
        engine = open_engine(settings.fleet_db_url)
        stack.callback(engine.dispose)
        projection = FleetProjection(engine)
        refolded = projection.load()
        _logger.info("fleet projection loaded", nodes=len(projection.folds), events=refolded)
        ingest = FleetIngest(bus, projection)
        watch = SourceWatch(bus, Path(settings.state_dir), interval=source_interval)
        desk = WitnessDesk(bus, open_witness(settings, engine), settings.cluster_name)
        await desk.start()
        await stack.enter_async_context(observe(settings, ingest, watch, desk))  # /metrics
        supervisor = Supervisor("fleet")
        stack.push_async_callback(supervisor.aclose)
        supervisor.spawn(ingest.run(), "ingest")
        supervisor.spawn(watch.run(), "sources")
        yield FleetService(ingest=ingest, watch=watch, desk=desk, projection=projection, supervisor=supervisor)
