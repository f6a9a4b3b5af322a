"""Fleet ledger: N leaf brokers with N node ledgers -> a 3-server central cluster -> the recorder.

Everything on this machine: 3 central nats-servers (routes, JetStream R3, fsync always), one leaf
broker per node (its own nats-server and JetStream domain), and one Python process driving every
node's real event log and outbox relay (the synthetic nodes share it, as the issue allows). Steps:

1. fill: each node appends ``--events`` grants to its own log; its relay publishes them to its leaf.
2. backlog: the fleet stream is created with every node as a source in one create; time until it
   holds every event (events/s). This is the floor's scenario b1 with gpuledger's relay in front.
2'. floor, in the same run: plain NATS as ``nats-fleet-floor.md`` measured it (b1): on every leaf a
   raw stream filled with as many 600-byte records by pipelined publishes, and a hub stream sourcing
   all of them in one create; time until it holds every record. ``fleet_vs_floor`` = the floor's
   events/s / the fleet backlog's (goal: at most 1.5). After an uncounted warm-up (the floor once:
   the first sourcing on a fresh cluster is slower, whichever it is), the two run in the order
   fleet, floor, floor, fleet; each figure is the mean of its two runs. The first fleet run uses
   the fleet stream's config under another name and is deleted; the last is the fleet stream.
3. join: one stream update adding one source to a stream that already sources 100/500/1000 nodes.
4. recorder: the fleet stream into SQLite, then into PostgreSQL (when installed): events/s.
5. ``fleet at T`` over everything recorded (SQLite and PostgreSQL).
6. RSS of the central servers (peak during the backlog, and after).
7. one node's grant latency (the allocator's append, relay running), with and without a fleet link,
   one grant on each in turn.

    python -m bench.fleet [--nodes 50] [--events 10000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nats.js import api

from libs.bus import NatsServer
from libs.fleet.naming import FLEET_STREAM, node_domain
from libs.fleet.queries import fleet_at
from libs.fleet.stream import ensure_fleet_stream, fleet_stream_config, node_source
from services.fleet.app import open_engine
from services.fleet.ingest import DURABLE, FleetIngest
from services.fleet.projection import FleetProjection
from tests.fleet.helpers import (
    HubCluster,
    LeafBroker,
    LedgerNode,
    PostgresServer,
    postgres_bindir,
)


def rss_mib(pid: int | None) -> float:
    if not pid:
        return 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


STALLED_ON_FLOW_CONTROL = 10228  # nats-server's err_code on a source whose flow-control replies are late


def say(what: str) -> None:
    """A progress line on stderr. The later phases print nothing of their own for minutes at full size
    (the recorder over 500,000 events), which must not read as a hang."""
    print(f"[bench.fleet {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


POLL_S = 0.1  # how often wait_sourced looks: the backlogs here take 4-7 s


async def wait_sourced(bus: Any, stream: str, total: int, *, on_poll: Callable[[], None] | None = None,
                       quiet_limit: float = 120.0, limit: float = 1800.0) -> dict[str, Any]:
    """Poll ``stream`` until it holds ``total`` messages: seconds taken, and the most sources that NATS
    reported at once as "stalled on flow control" (nats-server 2.15 flags a source whose flow-control
    replies are late; under a saturated hub that is transient). Fails, naming the flagged sources,
    when nothing arrived for ``quiet_limit`` seconds (a stall that does not clear by itself), or after
    ``limit`` seconds in all."""
    start = last_growth = last_said = time.perf_counter()
    count, flagged_max = -1, 0
    while True:
        info = await bus.js.stream_info(stream)
        now = time.perf_counter()
        failing = {s.name: s.error for s in info.sources or [] if s.error}
        flagged = [name for name, error in failing.items() if error.get("err_code") == STALLED_ON_FLOW_CONTROL]
        flagged_max = max(flagged_max, len(flagged))
        if info.state.messages > count:
            count, last_growth = info.state.messages, now
        if count >= total:
            return {"seconds": now - start, "sources_flagged_stalled_max": flagged_max,
                    "bytes_per_message": info.state.bytes / max(1, info.state.messages)}
        if now - last_said >= 5:
            say(f"{stream}: {count}/{total} after {now - start:.0f}s, {len(flagged)} sources flagged stalled")
            last_said = now
        if now - start > limit:
            raise TimeoutError(f"{stream} at {count}/{total} after {limit:g}s")
        if now - last_growth > quiet_limit:
            raise TimeoutError(f"{stream} stuck at {count}/{total} for {quiet_limit:g}s; "
                               f"sources in error: {dict(list(failing.items())[:10])}")
        if on_poll:
            on_poll()
        await asyncio.sleep(POLL_S)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def fill(node: LedgerNode, events: int, batch: int = 50, live: int = 20) -> None:
    """``events`` grants and releases through the real log (``batch`` per commit, as a busy allocator
    groups them), each release ending the grant made ``live`` grants earlier: ~``live`` held per node."""
    import uuid
    from collections import deque

    import msgspec

    from libs.events import AllocationGranted, AllocationReleased

    assert node.event_log
    template: AllocationGranted = await node.grant()
    held: deque[AllocationGranted] = deque([template])
    left = events - 1
    while left > 0:
        chunk: list[Any] = []
        while len(chunk) < min(batch, left):
            if len(held) >= live and len(chunk) % 2:
                gone = held.popleft()
                chunk.append(AllocationReleased(alloc_id=gone.alloc_id, pod_uid=gone.pod_uid,
                                                container=gone.container, reason="deleted"))
            else:
                grant = msgspec.structs.replace(template, alloc_id=uuid.uuid4().hex, pod_uid=str(uuid.uuid4()))
                held.append(grant)
                chunk.append(grant)
        await node.event_log.append(chunk)
        left -= len(chunk)
    assert node.relay
    await node.relay.wait_published(node.event_log.last_seq, timeout=1800)


FLOOR_STREAM = "FLOOR"
FLOOR_RECORD = b"x" * 600  # the floor's record size (gpuledger's JSON record shape, ~600 bytes)


async def floor_fill(node: LedgerNode, records: int, in_flight: int = 256) -> None:
    """Plain NATS on the node's leaf: a raw stream, ``records`` pipelined acked publishes."""
    assert node.bus
    js = node.bus.js
    await js.add_stream(api.StreamConfig(name=f"{FLOOR_STREAM}_{node.node.replace('-', '_')}", subjects=["floor.>"],
                                         storage=api.StorageType.FILE))
    window = asyncio.Semaphore(in_flight)

    async def one(seq: int) -> None:
        async with window:
            await js.publish("floor.rec", FLOOR_RECORD, headers={"Nats-Msg-Id": f"{node.node}:{seq}"})

    await asyncio.gather(*(one(i) for i in range(records)))


def floor_leaf_stream(node: LedgerNode) -> str:
    return f"{FLOOR_STREAM}_{node.node.replace('-', '_')}"


async def timed_sourcing(bus: Any, create: Callable[[], Awaitable[object]], name: str, total: int, *,
                         keep: bool = False, on_poll: Callable[[], None] | None = None) -> dict[str, Any]:
    """``create()`` (a hub stream ``name`` sourcing every leaf in one create), then wait until it holds
    ``total``: wait_sourced's figures, with the seconds from the create on and the create's ms. The
    stream is deleted after unless ``keep``."""
    start = time.perf_counter()
    await create()
    create_ms = (time.perf_counter() - start) * 1e3
    waited = await wait_sourced(bus, name, total, on_poll=on_poll)
    seconds = time.perf_counter() - start
    if not keep:
        await bus.js.delete_stream(name)
    return {**waited, "seconds": seconds, "create_ms": create_ms}


async def floor_backlog(bus: Any, nodes: list[LedgerNode], total: int, name: str = FLOOR_STREAM) -> dict[str, Any]:
    """A hub stream ``name`` sourcing every leaf's raw stream, timed and deleted; the leaves' raw
    streams stay (``delete_floor_leaves``)."""
    sources = [api.StreamSource(name=floor_leaf_stream(n),
                                external=api.ExternalStream(api=f"$JS.{node_domain(n.node)}.API", deliver=""))
               for n in nodes]
    config = api.StreamConfig(name=name, storage=api.StorageType.FILE, num_replicas=3, sources=sources)
    return await timed_sourcing(bus, lambda: bus.js.add_stream(config), name, total)


async def delete_floor_leaves(nodes: list[LedgerNode]) -> None:
    for n in nodes:
        assert n.bus
        await n.bus.js.delete_stream(floor_leaf_stream(n))


async def fleet_backlog(bus: Any, nodes: list[LedgerNode], total: int, *, keep: bool,
                        on_poll: Callable[[], None] | None = None) -> dict[str, Any]:
    """The fleet stream (the product's config, every node a source, one create), timed. ``keep``: the
    real fleet stream, kept for the recorder; else the same config under another name, deleted after."""
    names = [n.node for n in nodes]
    if keep:
        return await timed_sourcing(bus, lambda: ensure_fleet_stream(bus.js, names), FLEET_STREAM, total,
                                    keep=True, on_poll=on_poll)
    config = fleet_stream_config(names)
    config.name = f"{FLEET_STREAM}_TRIAL"
    return await timed_sourcing(bus, lambda: bus.js.add_stream(config), config.name, total, on_poll=on_poll)


async def grant_latencies(node: LedgerNode, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        start = time.perf_counter()
        await node.grant()
        out.append((time.perf_counter() - start) * 1e3)
    return out


async def join_cost(bus: Any, sizes: list[int]) -> dict[int, float]:
    """ms for one update adding one source to a stream already sourcing ``size`` (absent) nodes."""
    out = {}
    for size in sizes:
        name = f"JOINBENCH{size}"
        config = api.StreamConfig(name=name, storage=api.StorageType.FILE, num_replicas=3,
                                  sources=[node_source(f"ghost-{i}") for i in range(size)])
        await bus.js.add_stream(config)
        config.sources = [*config.sources, node_source("ghost-new")]
        start = time.perf_counter()
        await bus.js.update_stream(config)
        out[size] = (time.perf_counter() - start) * 1e3
        await bus.js.delete_stream(name)
    return out


async def record(bus: Any, db_url: str, total: int) -> tuple[float, float]:
    """(events/s into the database, fleet-at-T ms) for the whole fleet stream."""
    engine = open_engine(db_url)
    projection = FleetProjection(engine)
    ingest = FleetIngest(bus, projection, batch_size=1000)
    start = last_said = time.perf_counter()
    task = asyncio.create_task(ingest.run())
    while ingest.ingested < total:
        await asyncio.sleep(0.2)
        now = time.perf_counter()
        if now - start > 1800:
            raise TimeoutError(f"recorder stuck at {ingest.ingested}/{total}")
        if now - last_said >= 15:
            say(f"recorder ({engine.dialect.name}): {ingest.ingested}/{total} after {now - start:.0f}s")
            last_said = now
    rate = total / (time.perf_counter() - start)
    task.cancel()
    await bus.js.delete_consumer(FLEET_STREAM, DURABLE)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        states = await asyncio.to_thread(fleet_at, engine, time.time_ns())
        times.append((time.perf_counter() - t) * 1e3)
    assert states  # every node holds its last grants
    engine.dispose()
    return rate, statistics.median(times)


async def run(nodes_n: int, events: int, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": nodes_n, "events_per_node": events, "cpus": os.cpu_count(),
                           "python": platform.python_version(), "load_before": os.getloadavg()}
    hub = HubCluster(root / "hub")
    await hub.start(timeout=60)
    leaves: list[LeafBroker] = []
    nodes: list[LedgerNode] = []
    bus = await hub.recorder_bus()
    try:
        for i in range(nodes_n):
            leaf = LeafBroker(f"bench-{i:04d}", root / f"leaf{i}", hub)
            leaves.append(leaf)
        for leaf in leaves:  # one reload per node is slow at 50: add the users first, then start
            hub.logins.setdefault(leaf.node, __import__("libs.fleet.natsconf", fromlist=["NodeLogin"])
                                  .NodeLogin(leaf.node, os.urandom(8).hex()))
        hub.add_node(leaves[0].node)
        await asyncio.sleep(1)
        for leaf in leaves:
            await leaf.start(timeout=60)
        for i, leaf in enumerate(leaves):
            nodes.append(await LedgerNode(leaf.node, root / f"n{i}", leaf.url).start())
        say(f"fill: {nodes_n} node logs x {events} events through their relays")
        start = time.perf_counter()
        for k in range(0, nodes_n, 10):
            await asyncio.gather(*(fill(n, events) for n in nodes[k:k + 10]))
        out["fill_s"] = time.perf_counter() - start
        total = sum(n.event_log.last_seq for n in nodes)  # type: ignore[union-attr]
        out["total_events"] = total
        out["local_fill_events_per_s"] = total / out["fill_s"]

        peak = [0.0] * 3

        def sample_rss() -> None:
            for i, s in enumerate(hub.servers):
                peak[i] = max(peak[i], rss_mib(s.pid))

        say("floor's data: raw records on every leaf")
        floor_total = nodes_n * events
        start = time.perf_counter()
        for k in range(0, nodes_n, 10):
            await asyncio.gather(*(floor_fill(n, events) for n in nodes[k:k + 10]))
        out["floor_fill_events_per_s"] = floor_total / (time.perf_counter() - start)

        # The first hub stream to source every leaf on a fresh cluster is the slower, whichever it is
        # (50 x 2,000: the fleet 6.8 s first, 5.4 s second; the floor 4.6 s first, 3.8 s second): a
        # warm-up that is not counted, then fleet, floor, floor, fleet, so drift falls on both alike.
        say("warm-up (not counted): a hub stream sourcing every leaf's raw records")
        await floor_backlog(bus, nodes, floor_total, name=f"{FLOOR_STREAM}_WARMUP")
        say(f"backlog, in the order fleet, floor, floor, fleet: {total} events of the fleet stream, "
            f"{floor_total} raw records, from {nodes_n} nodes")
        fleet_runs = [await fleet_backlog(bus, nodes, total, keep=False)]
        floor_runs = [await floor_backlog(bus, nodes, floor_total) for _ in range(2)]
        fleet_runs.append(await fleet_backlog(bus, nodes, total, keep=True, on_poll=sample_rss))  # the recorder's
        await delete_floor_leaves(nodes)
        fleet_s, floor_s = sum(r["seconds"] for r in fleet_runs), sum(r["seconds"] for r in floor_runs)
        out["create_ms"] = fleet_runs[-1]["create_ms"]
        out["backlog_s_each"] = [r["seconds"] for r in fleet_runs]
        out["backlog_s"] = fleet_s / len(fleet_runs)
        out["fleet_sources_flagged_stalled_max"] = max(r["sources_flagged_stalled_max"] for r in fleet_runs)
        out["backlog_events_per_s"] = total * len(fleet_runs) / fleet_s
        out["hub_rss_peak_mib"] = peak
        out["hub_rss_after_mib"] = [rss_mib(s.pid) for s in hub.servers]
        out["floor_backlog_s_each"] = [r["seconds"] for r in floor_runs]
        out["floor_backlog_s"] = floor_s / len(floor_runs)
        out["floor_backlog_events_per_s"] = floor_total * len(floor_runs) / floor_s
        out["floor_sources_flagged_stalled_max"] = max(r["sources_flagged_stalled_max"] for r in floor_runs)
        out["fleet_vs_floor"] = out["floor_backlog_events_per_s"] / out["backlog_events_per_s"]  # goal: <= 1.5
        # what each message weighs in the hub's stream (record, subject and headers, as NATS counts them):
        # the floor's records are the size nats-fleet-floor.md measured with, ours are what the relay sends
        out["fleet_stored_bytes_per_event"] = round(fleet_runs[-1]["bytes_per_message"])
        out["floor_stored_bytes_per_record"] = round(floor_runs[-1]["bytes_per_message"])

        say("join cost, then the recorder into SQLite and PostgreSQL")
        out["join_ms"] = await join_cost(bus, [100, 500, 1000])

        out["recorder_sqlite_events_per_s"], out["fleet_at_sqlite_ms"] = await record(
            bus, f"sqlite:///{root / 'fleet.sqlite'}", total)
        bindir = postgres_bindir()
        if bindir is not None:
            pg = PostgresServer(bindir)
            await pg.start()
            try:
                out["recorder_postgres_events_per_s"], out["fleet_at_postgres_ms"] = await record(bus, pg.url, total)
            finally:
                await pg.stop()

        say("grant latency with and without a fleet link, alternating")
        lone_server = NatsServer(root / "lone")
        await lone_server.start()
        lone = await LedgerNode("lone", root / "lone-ledger", lone_server.url).start()
        try:
            # One grant on each in turn, so whatever the hub or the machine does meanwhile falls on both.
            linked, alone = [], []
            for _ in range(300):
                linked += await grant_latencies(nodes[0], 1)
                alone += await grant_latencies(lone, 1)
        finally:
            await lone.stop()
            await lone_server.stop()
        out["grant_ms_linked"] = {"p50": pct(linked, 0.5), "p99": pct(linked, 0.99)}
        out["grant_ms_lone"] = {"p50": pct(alone, 0.5), "p99": pct(alone, 0.99)}
        out["load_after"] = os.getloadavg()
        return out
    finally:
        await bus.close()
        for n in nodes:
            await n.stop()
        for leaf in leaves:
            await leaf.stop()
        await hub.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="glfb", dir="/tmp"))
    try:
        result = asyncio.run(run(args.nodes, args.events, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
