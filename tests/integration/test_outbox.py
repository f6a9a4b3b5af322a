"""The log is the outbox: every committed event reaches JetStream once, across relay and broker crashes."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from libs.bus import Bus, LogFollower, NatsServer, Relay
from libs.errors import StoreError
from libs.store import EventLog
from tests.builders import released_event


async def stream_contents(bus: Bus, count: int) -> list[tuple[int, str]]:
    out = []
    for seq in range(1, count + 1):
        msg = await bus.js.get_msg(bus.subjects.stream, seq)
        out.append((msg.seq, (msg.headers or {})["Gpuledger-Event-Id"]))
    return out


async def test_each_event_is_published_once_across_relay_restarts(nats_server: NatsServer, short_dir: Path) -> None:
    bus = await Bus.connect(nats_server.url, name="t", node="node.a")
    log = await EventLog.open(short_dir / "ledger.sqlite")
    try:
        for round_ in range(3):  # stop the relay mid-stream three times
            relay = Relay(bus, log)
            task = asyncio.create_task(relay.run())
            writes = [asyncio.create_task(log.append([released_event(round_ * 100 + i)])) for i in range(100)]
            await asyncio.sleep(0.02)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await asyncio.gather(*writes)
        relay = Relay(bus, log)
        task = asyncio.create_task(relay.run())
        await relay.wait_published(300, timeout=10)
        info = await bus.js.stream_info(bus.subjects.stream)
        assert (info.state.messages, info.state.last_seq) == (300, 300)
        mine = [(e.seq, e.event_id) for e in await log.read_after(0, 1000)]
        assert await stream_contents(bus, 300) == mine
        task.cancel()
    finally:
        await log.close()
        await bus.close()


async def test_a_broker_crash_loses_and_doubles_nothing(short_dir: Path) -> None:
    server = NatsServer(short_dir / "js")
    await server.start()
    port = server.port
    bus = await Bus.connect(server.url, name="t", node="n1")
    log = await EventLog.open(short_dir / "ledger.sqlite")
    relay = Relay(bus, log)
    task = asyncio.create_task(relay.run())
    try:
        for i in range(50):
            await log.append([released_event(i)])
        await relay.wait_published(50, timeout=10)
        await server.kill()  # SIGKILL, mid-stream
        for i in range(50, 120):  # the allocator keeps committing while the broker is down
            await log.append([released_event(i)])
        await asyncio.sleep(0.5)
        server = NatsServer(short_dir / "js", port=port)
        await server.start()
        await relay.wait_published(120, timeout=20)
        mine = [(e.seq, e.event_id) for e in await log.read_after(0, 1000)]
        assert await stream_contents(bus, 120) == mine
        info = await bus.js.stream_info(bus.subjects.stream)
        assert info.state.messages == 120
    finally:
        task.cancel()
        await log.close()
        await bus.close()
        await server.stop()


async def test_a_follower_resumes_where_it_left_off(nats_server: NatsServer, short_dir: Path) -> None:
    bus = await Bus.connect(nats_server.url, name="t", node="n1")
    log = await EventLog.open(short_dir / "ledger.sqlite")
    relay_task = asyncio.create_task(Relay(bus, log).run())
    try:
        for i in range(20):
            await log.append([released_event(i)])
        seen: list[int] = []
        follower = LogFollower(bus, lambda e: seen.append(e.seq))
        task = asyncio.create_task(follower.run())
        await follower.wait_for(20, timeout=10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for i in range(20, 30):
            await log.append([released_event(i)])
        resumed = LogFollower(bus, lambda e: seen.append(e.seq), after_seq=follower.last_seq)
        task = asyncio.create_task(resumed.run())
        await resumed.wait_for(30, timeout=10)
        task.cancel()
        assert seen == list(range(1, 31))
    finally:
        relay_task.cancel()
        await log.close()
        await bus.close()


async def test_a_log_behind_its_stream_stops_publication(nats_server: NatsServer, short_dir: Path) -> None:
    bus = await Bus.connect(nats_server.url, name="t", node="n1")
    first = await EventLog.open(short_dir / "a.sqlite")
    relay = Relay(bus, first)
    task = asyncio.create_task(relay.run())
    for i in range(5):
        await first.append([released_event(i)])
    await relay.wait_published(5, timeout=10)
    task.cancel()
    other = await EventLog.open(short_dir / "b.sqlite")  # a wiped state dir against the same broker
    try:
        await other.append([released_event(99)])
        with pytest.raises(StoreError, match="holds 5 events but the log"):
            await Relay(bus, other).run()
        for i in range(5):
            await other.append([released_event(i)])
        with pytest.raises(StoreError, match="histories forked"):
            await Relay(bus, other).run()
    finally:
        await first.close()
        await other.close()
        await bus.close()
