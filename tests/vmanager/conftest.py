"""Real parts: a nats-server, the SQLite event log with its outbox relay, the vmanager service.

Unix socket paths must stay under 108 bytes, so every directory is a short one under /tmp.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from libs.bus import Bus, NatsServer, Relay, ensure_stream
from libs.commands import PodsRequest
from libs.config import Settings
from libs.store import EventLog
from services.vmanager.app import VmanagerService
from tests.vmanager.helpers import NODE, FakeRuntime, FakeWatchdog, Ledger, running_vmanager, short_tmp


@pytest.fixture
async def nats() -> AsyncIterator[NatsServer]:
    store = short_tmp("vmnats")
    server = NatsServer(store)
    await server.start()
    yield server
    await server.stop()
    shutil.rmtree(store, ignore_errors=True)


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmp()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def settings(workdir: Path, nats: NatsServer) -> Settings:
    return Settings(node_name=NODE, state_dir=str(workdir / "state"), vm_dir=str(workdir / "vm"),
                    nats_url=nats.url, request_timeout=1.0, cgroup_root=str(workdir / "cgroup"),
                    proc_root=str(workdir / "proc"), driver_volumes=False)


@pytest.fixture
async def ledger(settings: Settings) -> AsyncIterator[Ledger]:
    event_log = await EventLog.open(settings.log_path)
    bus = await Bus.connect(settings.nats_url, name="test-relay", node=settings.node_name)
    await ensure_stream(bus)
    relay = Relay(bus, event_log)
    task = asyncio.create_task(relay.run())
    yield Ledger(event_log, relay)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await bus.close()
    await event_log.close()


@pytest.fixture
async def watchdog(settings: Settings) -> AsyncIterator[FakeWatchdog]:
    bus = await Bus.connect(settings.nats_url, name="test-watchdog", node=settings.node_name)
    fake = FakeWatchdog()
    await bus.serve(bus.subjects.pods, PodsRequest, fake.handle)
    yield fake
    await bus.close()


@pytest.fixture
async def vmanager(settings: Settings, ledger: Ledger) -> AsyncIterator[VmanagerService]:
    async with running_vmanager(settings) as svc:
        yield svc


@pytest.fixture
async def client_bus(settings: Settings) -> AsyncIterator[Bus]:
    """A bus for the test's own requests (as the allocator would send them)."""
    bus = await Bus.connect(settings.nats_url, name="test-client", node=settings.node_name)
    yield bus
    await bus.close()


@pytest.fixture
async def runtime(workdir: Path) -> AsyncIterator[FakeRuntime]:
    """A CRI runtime answering ContainerStatus on a real unix socket."""
    fake = FakeRuntime(workdir / "cri.sock")
    await fake.start()
    yield fake
    await fake.stop()
