"""Publication lag: from an append's commit to a subscriber's receipt, next to a plain NATS one-way trip.

One process runs a real nats-server (child process), the event log with its outbox relay, and a
subscriber on its own connection (a core subscription on ``gpuledger.<node>.alloc.*``, as an operator
would run it). Each sample appends one event and waits for the subscriber to receive it; the lag is
commit (append returned) -> message handed to the subscriber callback. The floor, measured in the
same run against the same server: a core NATS publish of a message of the same size from one
connection to a subscriber on another (publish -> receipt), and a JetStream publish + ack round trip.

    python -m bench.publication_lag [--samples 500] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import nats

from libs.bus import Bus, NatsServer, Relay
from libs.events.codec import to_record
from libs.events.schema import AllocationReleased
from libs.store import EventLog


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stats(name: str, lat: list[float]) -> dict[str, Any]:
    return {"case": name, "p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3,
            "mean_ms": sum(lat) / len(lat) * 1e3, "samples": len(lat)}


async def run(samples: int) -> list[dict[str, Any]]:
    root = Path(tempfile.mkdtemp(prefix="gllag", dir="/tmp"))
    server = NatsServer(root / "nats")
    await server.start()
    try:
        bus = await Bus.connect(server.url, name="bench-allocator", node="bench")
        event_log = await EventLog.open(root / "ledger.sqlite")
        relay = Relay(bus, event_log)
        relay_task = asyncio.create_task(relay.run())
        sub_nc = await nats.connect(server.url)
        arrived: dict[int, float] = {}
        waiter: dict[int, asyncio.Event] = {}

        async def on_event(msg: Any) -> None:
            seq = json.loads(msg.data)["seq"]
            arrived[seq] = time.perf_counter()
            if seq in waiter:
                waiter[seq].set()

        await sub_nc.subscribe(f"{bus.subjects.prefix}.alloc.*", cb=on_event)
        await sub_nc.flush()
        lag: list[float] = []
        size = 0
        for i in range(samples + 50):
            ev = AllocationReleased(alloc_id=f"{i:032x}", pod_uid=f"pod-{i}", container="main", reason="deleted")
            stored = await event_log.append([ev])
            committed = time.perf_counter()
            seq = stored[0].seq
            waiter[seq] = asyncio.Event()
            if seq not in arrived:
                await asyncio.wait_for(waiter[seq].wait(), 10)
            if i >= 50:  # warm-up
                lag.append(arrived[seq] - committed)
            size = len(msgspec.json.encode(to_record(stored[0])))
        relay_task.cancel()

        # Floors against the same server: core one-way trip, JetStream publish + ack.
        got = asyncio.Event()
        received = [0.0]

        async def on_plain(_msg: Any) -> None:
            received[0] = time.perf_counter()
            got.set()

        await sub_nc.subscribe("bench.plain", cb=on_plain)
        await sub_nc.flush()
        pub_nc = await nats.connect(server.url)  # the floor is plain NATS: a plain client publishes it
        payload = b"x" * size
        one_way: list[float] = []
        for i in range(samples + 50):
            got.clear()
            sent = time.perf_counter()
            await pub_nc.publish("bench.plain", payload)
            await asyncio.wait_for(got.wait(), 10)
            if i >= 50:
                one_way.append(received[0] - sent)
        js = bus.js
        await js.add_stream(name="BENCHFLOOR", subjects=["benchfloor.>"])
        js_rtt: list[float] = []
        for i in range(samples + 50):
            sent = time.perf_counter()
            await js.publish("benchfloor.x", payload)
            if i >= 50:
                js_rtt.append(time.perf_counter() - sent)
        await pub_nc.close()
        await sub_nc.close()
        await event_log.close()
        await bus.close()
        return [stats(f"commit -> subscriber (outbox relay, JetStream, {size} B record)", lag),
                stats(f"floor: plain NATS publish -> subscriber, {size} B", one_way),
                stats(f"floor: JetStream publish + ack round trip, {size} B", js_rtt)]
    finally:
        await server.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = asyncio.run(run(args.samples))
    print("| path | p50 | p99 | mean |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['p50_ms']:.2f} ms | {r['p99_ms']:.2f} ms | {r['mean_ms']:.2f} ms |")
    print(f"\n{args.samples} samples each after 50 warm-up; {platform.machine()}, {os.cpu_count()} cpu, "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
