"""Allocator composition root: log -> replayed state -> GPU inventory -> NATS handlers -> outbox relay."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from libs.bus import Bus, Relay
from libs.config import Settings
from libs.gpu import load_inventory
from libs.ledger import LedgerState
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
        state = LedgerState()
        await events.replay(state.apply)
        log.info("state replayed", seq=state.seq, allocations=len(state.allocations))

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
        await handlers.serve()
        yield AllocatorService(handlers=handlers, relay=relay, supervisor=supervisor, observability=obs)
