"""Allocator composition root: log -> replayed state -> GPU inventory -> NATS handlers -> outbox relay."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from libs.bus import Bus, Relay
from libs.config import Settings
from libs.gpu import load_inventory
from libs.ledger.snapshot import SnapshotKeeper, load_state
from libs.log import get_logger
from libs.runtime import Supervisor
from libs.store import EventLog
from services.allocator.handlers import Allocator
from services.allocator.inventory import inventory_event
from services.allocator.metrics import Observability, observe

__all__ = ["AllocatorService", "service"]


@dataclass
class AllocatorService:
    handlers: Allocator
    relay: Relay
    supervisor: Supervisor
    observability: Observability | None = None  # issue 7: metrics, health, usage


@asynccontextmanager
async def service(settings: Settings) -> AsyncIterator[AllocatorService]:
    log = get_logger("allocator")
    async with AsyncExitStack() as stack:
        events = await EventLog.open(settings.log_path)
        stack.push_async_callback(events.close)
        restored = await asyncio.to_thread(load_state, settings.log_path)  # snapshot + the log's tail
        state = restored.state
        log.info("state replayed", seq=state.seq, allocations=len(state.allocations),
                 snapshot_seq=restored.snapshot_seq, replayed=restored.replayed)
        snapshots = SnapshotKeeper(settings.log_path, state, saved_seq=restored.snapshot_seq)
        stack.push_async_callback(snapshots.save)  # at a clean stop, so the next start replays nothing

        found = await asyncio.to_thread(load_inventory, settings.gpus)
        if (changed := inventory_event(settings.node_name, found, state)) is not None:
            for stored in await events.append([changed]):
                state.apply(stored)
        log.info("gpus", backend=found.backend, count=len(found.gpus))

        bus = await Bus.connect(settings.nats_url, name="allocator", node=settings.node_name)
        stack.push_async_callback(bus.close)
        supervisor = Supervisor("allocator")
        stack.push_async_callback(supervisor.aclose)
        handlers = Allocator(settings, events, state, bus)
        relay = Relay(bus, events)
        supervisor.spawn(relay.run(), "relay")
        obs = await stack.enter_async_context(observe(settings, handlers, relay, found, supervisor))
        supervisor.spawn(snapshots.run(), "snapshots")
        await handlers.serve()
        yield AllocatorService(handlers=handlers, relay=relay, supervisor=supervisor, observability=obs)
