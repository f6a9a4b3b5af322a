"""Replay rate: the log folded into LedgerState, next to a raw scan of the same rows (the floor).

A synthetic log of grants and releases is written through the real writer (group commit, fsync),
then read back three ways in the same run:
- floor: ``SELECT`` of every row through the raw driver with ``fetchmany`` (no decoding);
- decode: the same plus msgspec decoding into typed events (``iter_events``);
- fold: ``replay()`` into ``LedgerState``, what the allocator does at start.

    python -m bench.replay [--events 200000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from libs.events.schema import (
    AllocationGranted,
    AllocationReleased,
    ContainerResponse,
    Event,
    GpuInfo,
    GpuShare,
    InventoryRecorded,
)
from libs.ledger.state import LedgerState
from libs.store import EventLog, iter_events, open_reader, replay
from services.allocator.responses import build_response

GPUS = 8


def synthetic(count: int) -> list[Event]:
    """A realistic mix: every grant (with its full response) is released two grants later."""
    gib = 1 << 30
    events: list[Event] = [InventoryRecorded(node="bench", backend="fake", gpus=tuple(
        GpuInfo(index=i, minor=i, uuid=f"GPU-{i:08d}", memory=80 * gib) for i in range(GPUS)))]
    live: list[AllocationGranted] = []
    i = 0
    while len(events) < count:
        if len(live) > 2:
            old = live.pop(0)
            events.append(AllocationReleased(alloc_id=old.alloc_id, pod_uid=old.pod_uid, container=old.container,
                                             reason="deleted"))
            continue
        gpu = i % GPUS
        share = GpuShare(index=gpu, uuid=f"GPU-{gpu:08d}", minor=gpu, cores=25, memory=gib)
        response: ContainerResponse = build_response(shares=(share,), cores=25, memory=gib, pod_uid=f"pod-{i}",
                                                     vm_root=Path("/vm"), vdriver_root=Path("/vd"))
        grant = AllocationGranted(
            alloc_id=f"{i:032x}", request_id=f"r{i}", pod_uid=f"pod-{i}", namespace="bench", pod_name=f"p{i}",
            container="c", container_index=0, cores=25, memory=gib,
            device_ids=tuple(f"tencent.com/vcuda-core-{(i * 25 + k) % 800}" for k in range(25)),
            shares=(share,), response=response)
        live.append(grant)
        events.append(grant)
        i += 1
    return events[:count]


async def build(path: Path, count: int) -> float:
    log = await EventLog.open(path)
    events = synthetic(count)
    started = time.perf_counter()
    try:
        for start in range(0, len(events), 5000):
            batch = events[start:start + 5000]
            await asyncio.gather(*(log.append(batch[k:k + 500]) for k in range(0, len(batch), 500)))
            print(f"  wrote {start + len(batch)}/{count}", file=sys.stderr, flush=True)
    finally:
        await log.close()
    return time.perf_counter() - started


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(3):  # best of three: the page cache is warm after the first
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    path = Path(tempfile.mkdtemp(prefix="glr", dir="/tmp")) / "ledger.sqlite"
    write_s = asyncio.run(build(path, args.events))

    def floor() -> None:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        cur = conn.execute("SELECT seq, recorded_at, stream_id, version, type, schema_v, event_id, command_id, "
                           "payload FROM events ORDER BY seq")
        while cur.fetchmany(10_000):
            pass
        conn.close()

    def decode() -> None:
        conn = open_reader(path)
        for _ in iter_events(conn):
            pass
        conn.close()

    def fold() -> None:
        state = LedgerState()
        replay(path, state.apply)
        assert state.seq == args.events

    rows = []
    for name, fn in (("raw scan (floor)", floor), ("scan + decode", decode), ("scan + decode + fold", fold)):
        seconds = timed(fn)
        rows.append({"name": name, "seconds": round(seconds, 3), "events_per_s": round(args.events / seconds)})
    size = path.stat().st_size
    print("| read | seconds | events/s |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['seconds']} | {r['events_per_s']:,} |")
    print(f"\n{args.events:,} events, {size / args.events:.0f} bytes/event on disk, written in {write_s:.1f} s "
          f"({args.events / write_s:,.0f}/s, durable group commit) — {platform.machine()} {os.cpu_count()} cpu")
    if args.json:
        args.json.write_text(json.dumps({"events": args.events, "rows": rows, "bytes_per_event": size / args.events}))


if __name__ == "__main__":
    main()
