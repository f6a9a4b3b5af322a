"""Append throughput of the event log: group commit at 1, 8 and 64 concurrent writers, and one writer
committing inline (the allocator's way), all durable.

Each writer is an asyncio task awaiting ``EventLog.append([event])`` in a loop (what allocator handlers
do); an append returns only after the COMMIT holding it was fsynced (``synchronous=FULL``, WAL). The
inline case appends as the allocator's ledger does: on the event loop, each grant with its request's
command id (looked up before it is written, so that a retried request is written once). The
floor, measured in the same run on the same disk: raw ``sqlite3``, one event per
``BEGIN IMMEDIATE; INSERT; COMMIT`` with the same PRAGMAs, the same row (encoded body + chained hash)
and the same table with its indexes and triggers, no group commit and no asyncio.

Events are realistic grants (~1.1 KB, with the full Allocate response). Each case runs for
``--seconds`` (default 3) on a fresh file. CPU per append is the process's (every thread's) CPU time
over the case, divided by its appends: what an append costs beyond the wait for the disk.

    python -m bench.append [--seconds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sqlite3
import tempfile
import time
import uuid
from itertools import islice
from pathlib import Path

from bench.make_log import SETTINGS, synthetic
from libs.events.schema import AllocationGranted, Event
from libs.store import EventLog
from libs.store.layout import layout_of
from libs.store.log import create_schema
from libs.store.rows import GENESIS_HASH, chain_hash, event_row


def grants(count: int) -> list[Event]:
    return [e for e in islice(synthetic(count * 2), count * 2) if isinstance(e, AllocationGranted)][:count]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def raw_floor(path: Path, events: list[Event], seconds: float) -> dict[str, float]:
    create_schema(path)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    layout = layout_of(conn)
    prev, at, lat = GENESIS_HASH, 0, []
    cpu = time.process_time()
    started = time.perf_counter()
    n = 0
    while time.perf_counter() - started < seconds and n < len(events):
        t0 = time.perf_counter()
        ev = events[n]
        n += 1
        at = max(time.time_ns(), at)
        row = event_row(n, at, f"raw:{n}", 1, ev, uuid.uuid4().bytes, None, SETTINGS)
        prev = chain_hash(prev, row)
        conn.execute("BEGIN IMMEDIATE")
        layout.insert(conn, [(*row, prev)])
        conn.execute("COMMIT")
        lat.append(time.perf_counter() - t0)
    took = time.perf_counter() - started
    cpu = time.process_time() - cpu
    conn.close()
    return _result(lat, took, cpu)


def _result(lat: list[float], took: float, cpu: float) -> dict[str, float]:
    return {"events_per_s": len(lat) / took, "p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3,
            "cpu_ms": cpu / max(1, len(lat)) * 1e3}


async def group_commit(path: Path, events: list[Event], writers: int, seconds: float, *,
                       inline: bool = False) -> dict[str, float]:
    # as the allocator stores grants (``inline``: as it commits them, with their request ids)
    event_log = await EventLog.open(path, response_settings=SETTINGS, inline=inline)
    lat: list[float] = []
    stop = time.perf_counter() + seconds
    cursor = iter(events)

    async def writer() -> None:
        for ev in cursor:
            if time.perf_counter() > stop:
                return
            command_id = ev.request_id if inline and isinstance(ev, AllocationGranted) else None
            t0 = time.perf_counter()
            await event_log.append([ev], command_id=command_id)
            lat.append(time.perf_counter() - t0)

    cpu = time.process_time()
    started = time.perf_counter()
    try:
        await asyncio.gather(*(writer() for _ in range(writers)))
    finally:
        took = time.perf_counter() - started
        cpu = time.process_time() - cpu
        await event_log.close()
    return _result(lat, took, cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    events = grants(300_000)
    root = Path(tempfile.mkdtemp(prefix="glapp", dir="/tmp"))
    rows = [{"case": "raw sqlite3, 1 event per transaction (floor)", **raw_floor(root / "raw.sqlite", events,
                                                                                 args.seconds)}]
    for writers in (1, 8, 64):
        result = asyncio.run(group_commit(root / f"gc{writers}.sqlite", events, writers, args.seconds))
        rows.append({"case": f"EventLog.append, {writers} concurrent writer{'s' if writers > 1 else ''}", **result})
    result = asyncio.run(group_commit(root / "inline.sqlite", events, 1, args.seconds, inline=True))
    rows.append({"case": "EventLog.append inline, with command ids (the allocator's way), 1 writer", **result})
    print("| append (durable: WAL, synchronous=FULL) | events/s | p50 | p99 | CPU per append |\n"
          "|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['events_per_s']:,.0f} | {r['p50_ms']:.2f} ms | {r['p99_ms']:.2f} ms "
              f"| {r['cpu_ms']:.3f} ms |")
    shutil.rmtree(root, ignore_errors=True)
    print(f"\n{platform.machine()}, {os.cpu_count()} cpu, load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
