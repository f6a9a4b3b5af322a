"""The log is the outbox: every committed event reaches JetStream once, across relay and broker crashes."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

from libs.bus import Bus, LogFollower, NatsServer, Relay
from libs.bus.outbox import REBUILT_METADATA, StreamRebuilt, rebuilt_subject
from libs.store import EventLog
from tests.builders import released_event


async def stream_contents(bus: Bus, count: int) -> list[tuple[int, str]]:
    out = []
    for seq in range(1, count + 1):
        msg = await bus.js.get_msg(bus.subjects.stream, seq)
        out.append((msg.seq, (msg.headers or {})["Gpuledger-Event-Id"]))
    return out


async def tear_down(tasks: list[asyncio.Task[None]], event_log: EventLog, bus: Bus, server: NatsServer) -> None:
    """Stop the relay and follower tasks, then close the log, the connection and the broker."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await event_log.close()
    await bus.close()
    await server.stop()


async def test_each_event_is_published_once_across_relay_restarts(nats_server: NatsServer, short_dir: Path) -> None:
    bus = await Bus.connect(nats_server.url, name="t", node="node.a")
    event_log = await EventLog.open(short_dir / "ledger.sqlite")
    try:
        for round_ in range(3):  # stop the relay mid-stream three times
            relay = Relay(bus, event_log)
            task = asyncio.create_task(relay.run())
            writes = [asyncio.create_task(event_log.append([released_event(round_ * 100 + i)])) for i in range(100)]
            await asyncio.sleep(0.02)
            task.cancel()
            # Bounded, and not a suppress(CancelledError): that would also swallow the test's own cancel
            # (pytest-timeout), and a relay that ignores its stop would show up rounds later, elsewhere.
            await asyncio.wait([task], timeout=5)
            assert task.cancelled(), f"round {round_}: the relay did not stop when cancelled"
            await asyncio.gather(*writes)
        relay = Relay(bus, event_log)
        task = asyncio.create_task(relay.run())
        await relay.wait_published(300, timeout=10)
        info = await bus.js.stream_info(bus.subjects.stream)
        assert (info.state.messages, info.state.last_seq) == (300, 300)
        mine = [(e.seq, e.event_id) for e in await event_log.read_after(0, 1000)]
        assert await stream_contents(bus, 300) == mine
        task.cancel()
    finally:
        await event_log.close()
        await bus.close()


async def test_a_broker_crash_loses_and_doubles_nothing(short_dir: Path) -> None:
    server = NatsServer(short_dir / "js")
    await server.start()
    port = server.port
    bus = await Bus.connect(server.url, name="t", node="n1")
    event_log = await EventLog.open(short_dir / "ledger.sqlite")
    relay = Relay(bus, event_log)
    task = asyncio.create_task(relay.run())
    try:
        for i in range(50):
            await event_log.append([released_event(i)])
        await relay.wait_published(50, timeout=10)
        await server.kill()  # SIGKILL, mid-stream
        for i in range(50, 120):  # the allocator keeps committing while the broker is down
            await event_log.append([released_event(i)])
        await asyncio.sleep(0.5)
        server = NatsServer(short_dir / "js", port=port)
        await server.start()
        await relay.wait_published(120, timeout=20)
        mine = [(e.seq, e.event_id) for e in await event_log.read_after(0, 1000)]
        assert await stream_contents(bus, 120) == mine
        info = await bus.js.stream_info(bus.subjects.stream)
        assert info.state.messages == 120
    finally:
        task.cancel()
        await event_log.close()
        await bus.close()
        await server.stop()


async def test_a_follower_resumes_where_it_left_off(nats_server: NatsServer, short_dir: Path) -> None:
    bus = await Bus.connect(nats_server.url, name="t", node="n1")
    event_log = await EventLog.open(short_dir / "ledger.sqlite")
    relay_task = asyncio.create_task(Relay(bus, event_log).run())
    try:
        for i in range(20):
            await event_log.append([released_event(i)])
        seen: list[int] = []
        follower = LogFollower(bus, lambda e: seen.append(e.seq))
        task = asyncio.create_task(follower.run())
        await follower.wait_for(20, timeout=10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for i in range(20, 30):
            await event_log.append([released_event(i)])
        resumed = LogFollower(bus, lambda e: seen.append(e.seq), after_seq=follower.last_seq)
        task = asyncio.create_task(resumed.run())
        await resumed.wait_for(30, timeout=10)
        task.cancel()
        assert seen == list(range(1, 31))
    finally:
        relay_task.cancel()
        await event_log.close()
        await bus.close()


async def test_a_follower_reads_on_as_soon_as_the_broker_is_back(short_dir: Path) -> None:
    """A broker restart forgets the follower's consumer. The reconnect itself ends the follower's wait
    and it subscribes again from its own position: the events committed meanwhile reach it within
    seconds, not after its idle check (set far away here, so that only the reconnect can do it)."""
    server = NatsServer(short_dir / "js")
    await server.start()
    port = server.port
    bus = await Bus.connect(server.url, name="t", node="n1")
    event_log = await EventLog.open(short_dir / "ledger.sqlite")
    relay_task = asyncio.create_task(Relay(bus, event_log).run())
    seen: list[int] = []
    follower = LogFollower(bus, lambda e: seen.append(e.seq), idle_check=600)
    follow_task = asyncio.create_task(follower.run())
    try:
        for i in range(5):
            await event_log.append([released_event(i)])
        await follower.wait_for(5, timeout=10)
        await server.kill()
        server = NatsServer(short_dir / "js", port=port)
        await server.start()
        for i in range(5, 10):
            await event_log.append([released_event(i)])
        await follower.wait_for(10, timeout=4)  # nats-py's own heartbeat check would take longer
        assert seen == list(range(1, 11))
    finally:
        await tear_down([follow_task, relay_task], event_log, bus, server)


async def rebuilt_notices(bus: Bus) -> tuple[list[StreamRebuilt], object]:
    seen: list[StreamRebuilt] = []

    async def on_notice(notice: StreamRebuilt) -> None:
        seen.append(notice)

    sub = await bus.subscribe(rebuilt_subject(bus), StreamRebuilt, on_notice)
    return seen, sub


async def assert_stream_is_the_log(bus: Bus, event_log: EventLog) -> None:
    mine = [(e.seq, e.event_id) for e in await event_log.read_after(0, 1000)]
    info = await bus.js.stream_info(bus.subjects.stream)
    assert (info.state.messages, info.state.last_seq) == (len(mine), len(mine))
    assert await stream_contents(bus, len(mine)) == mine


async def test_a_stream_of_another_history_is_rebuilt_from_the_log(nats_server: NatsServer, short_dir: Path) -> None:
    """The log is the truth: a stream ahead of the log (a wiped state dir, a log restored from an older copy,
    a broker store reused for another log) or forked from it is replaced by the log's, from seq 1, and
    subscribers hear of it. Publication never stops."""
    bus = await Bus.connect(nats_server.url, name="t", node="n1")
    seen, sub = await rebuilt_notices(bus)
    first = await EventLog.open(short_dir / "a.sqlite")
    relay = Relay(bus, first)
    task = asyncio.create_task(relay.run())
    for i in range(5):
        await first.append([released_event(i)])
    await relay.wait_published(5, timeout=10)
    task.cancel()
    other = await EventLog.open(short_dir / "b.sqlite")  # a wiped state dir against the same broker
    tasks: list[asyncio.Task[None]] = []
    try:
        await other.append([released_event(99)])
        behind = Relay(bus, other)
        tasks.append(asyncio.create_task(behind.run()))
        await behind.wait_published(1, timeout=10)
        await assert_stream_is_the_log(bus, other)
        assert behind.rebuilds == 1
        info = await bus.js.stream_info(bus.subjects.stream)
        assert "holds 5 events but the log" in (info.config.metadata or {})[REBUILT_METADATA]
        for i in range(5):
            await other.append([released_event(i)])
        await behind.wait_published(6, timeout=10)
        tasks.pop().cancel()

        # The first log goes on (a restored backup that forked): its relay replaces the stream again.
        await first.append([released_event(7)])
        forked = Relay(bus, first)
        tasks.append(asyncio.create_task(forked.run()))
        await forked.wait_published(6, timeout=10)
        await assert_stream_is_the_log(bus, first)
        assert forked.rebuilds == 1
        await asyncio.sleep(0.2)  # the core notices
        assert [(n.stream_last_seq_before, n.log_last_seq) for n in seen] == [(5, 1), (6, 6)]
        assert "holds 5 events" in seen[0].cause and "histories forked" in seen[1].cause
        await first.append([released_event(8)])  # and publication goes on as usual
        await forked.wait_published(7, timeout=10)
        await assert_stream_is_the_log(bus, first)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await sub.unsubscribe()
        await first.close()
        await other.close()
        await bus.close()


async def test_a_broker_store_lost_while_down_is_rebuilt(short_dir: Path) -> None:
    """The broker comes back on the same port with an empty store: the running relay republishes the
    whole log, and a follower that was reading it reads on without a gap or a repeat."""
    server = NatsServer(short_dir / "js")
    await server.start()
    port = server.port
    bus = await Bus.connect(server.url, name="t", node="n1")
    event_log = await EventLog.open(short_dir / "ledger.sqlite")
    relay = Relay(bus, event_log)
    task = asyncio.create_task(relay.run())
    follower_seen: list[int] = []
    follower = LogFollower(bus, lambda e: follower_seen.append(e.seq))
    follow_task = asyncio.create_task(follower.run())
    try:
        for i in range(20):
            await event_log.append([released_event(i)])
        await follower.wait_for(20, timeout=10)
        await server.kill()
        shutil.rmtree(short_dir / "js")  # the store is lost while the broker is down
        for i in range(20, 30):
            await event_log.append([released_event(i)])
        server = NatsServer(short_dir / "js", port=port)
        await server.start()
        await relay.wait_published(30, timeout=30)
        await assert_stream_is_the_log(bus, event_log)
        assert relay.rebuilds == 1
        info = await bus.js.stream_info(bus.subjects.stream)
        assert "the stream is missing" in (info.config.metadata or {})[REBUILT_METADATA]
        await follower.wait_for(30, timeout=30)
        assert follower_seen == list(range(1, 31))
    finally:
        await tear_down([follow_task, task], event_log, bus, server)


async def test_publication_waits_for_the_owners_replies_at_most_a_bounded_time(
        nats_server: NatsServer, short_dir: Path) -> None:
    """An event committed while its owner still answers requests (an Allocate confirms its grant
    against the kubelet's List after the append) is published once those replies are out; an owner
    that never says so holds publication back for at most HOLD_AT_MOST_S per round."""
    from libs.bus.outbox import HOLD_AT_MOST_S

    bus = await Bus.connect(nats_server.url, name="t", node="hold")
    event_log = await EventLog.open(short_dir / "ledger.sqlite")
    answered = asyncio.Event()
    relay = Relay(bus, event_log, replies_out=answered.wait)
    task = asyncio.create_task(relay.run())
    try:
        await event_log.append([released_event(1)])
        await relay.wait_published(1, timeout=10)  # nothing in flight at first: only the bound held it
        await event_log.append([released_event(2)])
        await asyncio.sleep(HOLD_AT_MOST_S / 5)
        assert relay.published == 1  # still answering: not yet
        answered.set()
        await relay.wait_published(2, timeout=HOLD_AT_MOST_S / 2)  # at once after the replies
        answered.clear()
        loop = asyncio.get_running_loop()
        began = loop.time()
        await event_log.append([released_event(3)])
        await relay.wait_published(3, timeout=10)  # an owner that never answers: the bound
        assert HOLD_AT_MOST_S * 0.8 <= loop.time() - began < HOLD_AT_MOST_S + 1.0
    finally:
        task.cancel()
        await asyncio.wait([task], timeout=5)
        await event_log.close()
        await bus.close()
