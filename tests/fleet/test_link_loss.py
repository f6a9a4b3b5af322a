"""Link loss and crashes: the node admits at its normal pace with the fleet link down and its broker
SIGKILLed; the backlog reaches the fleet stream after the link returns, nothing lost or twice, in order;
a central server SIGKILLed loses nothing and stalls the fleet stream only for seconds."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from libs.fleet.naming import FLEET_STREAM
from libs.fleet.stream import ensure_fleet_stream
from services.fleet.app import service
from tests.fleet.helpers import (
    HubCluster,
    LedgerNode,
    fleet_count,
    per_node_seqs,
    read_fleet,
    recorder_settings,
    start_fleet_node,
)
from tests.polling import eventually

CUT_S = 5.0  # CI-sized; the bench and docs/fleet.md cover minutes-long cuts
STALL_BOUND_S = 30.0  # a central server's SIGKILL: measured 1-10 s on a loaded 2-core machine (load 3-4)


async def _grant_times(ledger: LedgerNode, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        await ledger.grant()
        times.append(time.perf_counter() - start)
    return times


async def test_backlog_after_a_cut_link_and_a_killed_broker(hub: HubCluster, short_dir: Path) -> None:
    cut = await start_fleet_node(hub, short_dir / "cut", "node-cut", through_proxy=True)
    steady = await start_fleet_node(hub, short_dir / "steady", "node-steady")
    bus = await hub.recorder_bus()
    try:
        await ensure_fleet_stream(bus.js, [cut.name, steady.name])
        before = await _grant_times(cut.ledger, 20)
        await eventually(lambda: _at_least(bus, 22), timeout=30, interval=0.2, what="the first events in the hub")
        await cut.broker.cut()
        during = await _grant_times(cut.ledger, 20)
        await cut.broker.kill()                      # the node's broker SIGKILLed while the link is down
        during += await _grant_times(cut.ledger, 10)  # admissions go on: the log is the outbox
        await cut.ledger.stop()                       # the allocator (relay) goes away too...
        await cut.broker.start()                      # ...the broker comes back, still cut off
        cut.ledger = await LedgerNode(cut.name, short_dir / "cut" / "ledger", cut.broker.url).start()
        during += await _grant_times(cut.ledger, 10)
        await steady.ledger.grant()
        await asyncio.sleep(CUT_S)
        assert statistics.median(during) < max(5 * statistics.median(before), 0.05)
        await cut.broker.restore()
        restored = time.monotonic()
        want = cut.ledger.event_log.last_seq + steady.ledger.event_log.last_seq  # type: ignore[union-attr]
        await eventually(lambda: _at_least(bus, want), timeout=60, interval=0.25, what="the backlog in the hub")
        assert time.monotonic() - restored < 45
        seqs = per_node_seqs(await read_fleet(bus))
        assert seqs[cut.name] == list(range(1, cut.ledger.event_log.last_seq + 1))  # type: ignore[union-attr]
        assert seqs[steady.name] == list(range(1, steady.ledger.event_log.last_seq + 1))  # type: ignore[union-attr]
    finally:
        await bus.close()
        for n in (cut, steady):
            await n.stop()


@pytest.mark.parametrize("victim", ["stream-leader", "leaf-links"])
async def test_a_central_server_killed_loses_nothing_and_stalls_briefly(
    hub: HubCluster, short_dir: Path, victim: str
) -> None:
    """SIGKILL, while nodes write, of the fleet stream's leader (a new one is elected) or of another
    server that holds leaf links (the leaves move; a source whose consumer was being created over a
    dead link is restarted by the recorder, where NATS alone would wait out a back-off of ~40 s)."""
    nodes = [await start_fleet_node(hub, short_dir / f"n{i}", f"node-{i}") for i in range(3)]
    bus = await hub.recorder_bus()
    async with AsyncExitStack() as stack:
        stack.push_async_callback(bus.close)
        for n in nodes:
            stack.push_async_callback(n.stop)
        await eventually(lambda: len(hub.leaf_links()) == len(nodes), timeout=30, interval=0.2,
                         what="every leaf linked to the central cluster")
        await stack.enter_async_context(service(recorder_settings(hub, short_dir / "rec")))
        await ensure_fleet_stream(bus.js, [n.name for n in nodes])
        leader = (await bus.js.stream_info(FLEET_STREAM)).cluster.leader  # type: ignore[union-attr]
        held = Counter(hub.leaf_links().values())
        if victim == "stream-leader":
            index = hub.index_of(leader)
        else:  # the other server holding the most links (with every link on the leader: any other)
            index = max((i for i, s in enumerate(hub.specs) if s.name != leader), key=lambda i: held[hub.specs[i].name])

        async def load(rounds: int) -> None:
            for _ in range(rounds):
                await asyncio.gather(*(n.ledger.grant() for n in nodes))
                await asyncio.sleep(0.01)

        writer = asyncio.create_task(load(60))
        await asyncio.sleep(0.3)  # the sources' consumers are being created
        await hub.kill(index)
        killed = time.monotonic()
        await writer
        want = sum(n.ledger.event_log.last_seq for n in nodes)  # type: ignore[union-attr]
        await eventually(lambda: _at_least(bus, want), timeout=STALL_BOUND_S + 15, interval=0.1,
                         what="every event in the fleet stream after the kill")
        stalled = time.monotonic() - killed
        print(f"central kill ({victim}, {hub.specs[index].name} holding {held[hub.specs[index].name]} leaf links): "
              f"fleet stream complete {stalled:.1f}s after the kill, load {os.getloadavg()[0]:.1f}")
        # A killed stream leader: its followers elect a new one after NATS's raft election timeout
        # (4-9 s, not configurable); a moved leaf link: a second or two, plus a meta leader election
        # when the source must be restarted and the killed server led the JetStream meta group.
        assert stalled < STALL_BOUND_S
        await hub.restart(index)
        seqs = per_node_seqs(await read_fleet(bus))
        for n in nodes:
            assert seqs[n.name] == list(range(1, n.ledger.event_log.last_seq + 1))  # type: ignore[union-attr]


async def _at_least(bus: object, want: int) -> bool:
    try:  # a short timeout: no answer while the stream's leader is being elected, and the stall is timed
        return await asyncio.wait_for(fleet_count(bus), 1.0) >= want  # type: ignore[arg-type]
    except Exception:
        return False
