"""Real parts: a nats-server, the SQLite event log with its outbox relay, the vmanager service.

Unix socket paths must stay under 108 bytes, so every directory is a short one under /tmp.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from libs.bus import Bus, NatsServer, Relay, ensure_stream
from libs.commands import PodsReply, PodsRequest
from libs.config import Settings
from libs.events.schema import Event
from libs.kube.pods import Pod
from libs.store import EventLog
from services.vmanager.app import VmanagerService, service
from tests.vmanager.builders import NODE


def short_tmp(prefix: str = "vm") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


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


class Ledger:
    """The allocation log as the allocator would write it, published by a running relay."""

    def __init__(self, log: EventLog, relay: Relay) -> None:
        self.log = log
        self.relay = relay

    async def append(self, *events: Event) -> int:
        stored = await self.log.append(list(events))
        await self.relay.wait_published(stored[-1].seq, 5)
        return stored[-1].seq


@pytest.fixture
async def ledger(settings: Settings) -> AsyncIterator[Ledger]:
    log = await EventLog.open(settings.log_path)
    bus = await Bus.connect(settings.nats_url, name="test-relay", node=settings.node_name)
    await ensure_stream(bus)
    relay = Relay(bus, log)
    task = asyncio.create_task(relay.run())
    yield Ledger(log, relay)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await bus.close()
    await log.close()


class FakeWatchdog:
    """Answers ``watchdog.pods`` the way the watchdog does: from its view of the node's pods."""

    def __init__(self) -> None:
        self.pods: dict[str, Pod] = {}
        self.calls: list[PodsRequest] = []

    def add(self, pod: Pod) -> None:
        self.pods[pod.uid] = pod

    async def handle(self, req: PodsRequest) -> PodsReply:
        self.calls.append(req)
        return PodsReply(pods=[p for uid, p in self.pods.items() if not req.uid or uid == req.uid])


@pytest.fixture
async def watchdog(settings: Settings) -> AsyncIterator[FakeWatchdog]:
    bus = await Bus.connect(settings.nats_url, name="test-watchdog", node=settings.node_name)
    fake = FakeWatchdog()
    await bus.serve(bus.subjects.pods, PodsRequest, fake.handle)
    yield fake
    await bus.close()


@contextlib.asynccontextmanager
async def running_vmanager(settings: Settings) -> AsyncIterator[VmanagerService]:
    async with service(settings) as svc:
        await asyncio.wait_for(svc.tracker.caught_up.wait(), 10)
        yield svc


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


async def folded(svc: VmanagerService, seq: int) -> None:
    await svc.tracker.follower.wait_for(seq, 5)
