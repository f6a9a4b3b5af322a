"""Bounded growth: a million events of steady churn, a retention of 100k, and the start-up after it.

The events are bench/make_log.py's mix (grants with their full Allocate responses, each released two
grants later), written with its fast path (same rows and hash chain, ``synchronous=OFF``, big
transactions) in batches of retention/4 events, or copied in such batches from a log it wrote
(``--from-log``: ``make bench`` passes the million-event log it has just made); after each batch,
when the live log exceeds the retention by a quarter, the allocator's archive step
(``libs.store.archive.archive_prefix``, exactly what ``allocator.archive`` runs: segment file,
stream heads, catalog, chunked delete) moves all but the newest ``--retention`` events into a
segment. Reported over time: the live file's size (and its WAL), the archive's size, the time each
archive took. Then the allocator's start-up, as bench/restart.py measures it (process spawn -> it
answers on NATS, the node's stream current), on the result: once without a snapshot (it must replay
the segments too: the first start after an upgrade) and twice with the snapshot its clean stop wrote
(the normal restart, which needs the snapshot and the live tail, never a segment).

    python -m bench.archive [--events 1000000] [--retention 100000] [--from-log PATH (bench.make_log's)]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

from bench.make_log import copy_log, synthetic, write_log
from bench.restart import seed_stream, start_and_wait, stop, wait_published
from libs.bus import NatsServer
from libs.ledger.holdings import audit_replay
from libs.store.archive import archive_dir, archive_prefix, cut_for
from libs.store.verify import verify_log


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else 0


def _events_in(log: Path) -> int:
    """The last seq of a log bench.make_log wrote (checked before the churn: a short one would copy
    nothing more, batch after batch)."""
    conn = sqlite3.connect(f"file:{log}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT MAX(seq) FROM events").fetchone()[0] or 0)
    finally:
        conn.close()


def churn(log: Path, events: int, retention: int, from_log: Path | None = None) -> list[dict[str, float]]:
    batch = max(1, retention // 4)
    source = synthetic(events)  # lazy: nothing is made when the events are copied
    rows: list[dict[str, float]] = []
    written = 0
    while written < events:
        started = time.perf_counter()
        if from_log is not None:
            written = copy_log(from_log, log, after=written, count=min(batch, events - written))
        else:
            written = write_log(log, itertools.islice(source, batch), progress=False)
        wrote_s = time.perf_counter() - started
        archived_s = 0.0
        upto = cut_for(log, keep_events=retention)
        if written > retention + batch - 1 and upto:
            started = time.perf_counter()
            archive_prefix(log, upto)
            archived_s = time.perf_counter() - started
        rows.append({"events": written, "live_mb": _size(log) / 1e6, "wal_mb": _size(Path(f"{log}-wal")) / 1e6,
                     "archive_mb": _dir_size(archive_dir(log)) / 1e6, "write_s": wrote_s, "archive_s": archived_s})
        print(f"  {written:>9,} events: live {rows[-1]['live_mb']:6.1f} MB (+ WAL {rows[-1]['wal_mb']:5.1f} MB), "
              f"archive {rows[-1]['archive_mb']:6.1f} MB, archive step {archived_s:.2f} s", flush=True)
    return rows


def whole_history(log: Path) -> dict[str, float]:
    """What an auditor pays once most of the history is archived: every segment is decompressed."""
    out = {}
    started = time.perf_counter()
    view = audit_replay(log)
    out[f"audit replay to seq {view.seq:,} (`gpuledger replay`)"] = time.perf_counter() - started
    started = time.perf_counter()
    report = verify_log(log)
    assert report.ok, report.problem
    out[f"`audit verify`: {report.segments} segments + the live log, {report.events:,} events"] = (
        time.perf_counter() - started)
    return out


async def starts(state_dir: Path, events: int) -> list[dict[str, object]]:
    server = NatsServer(state_dir.parent / "nats")
    await server.start()
    try:
        out: list[dict[str, object]] = []
        empty = state_dir.parent / "empty"
        seconds, proc = await start_and_wait(empty, server.url)
        await stop(proc)
        out.append({"case": "floor: empty log", "seconds": seconds})
        await seed_stream(server.url, state_dir / "ledger.sqlite")  # the stream is current, as on a running node
        seconds, proc = await start_and_wait(state_dir, server.url)
        out.append({"case": "no snapshot: replays every segment and the live log", "seconds": seconds})
        await wait_published(server.url, events + 1)  # what this start appended (its inventory)
        await stop(proc)  # a clean stop writes the snapshot
        for attempt in (1, 2):
            seconds, proc = await start_and_wait(state_dir, server.url)
            await stop(proc)
            out.append({"case": f"snapshot (restart {attempt})", "seconds": seconds})
        return out
    finally:
        await server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--retention", type=int, default=100_000)
    parser.add_argument("--from-log", type=Path, default=None,
                        help="take the events from this log written by bench.make_log (at least --events of them) "
                             "instead of making them again: the same rows, without the generation's time")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.from_log is not None and (held := _events_in(args.from_log)) < args.events:
        parser.error(f"{args.from_log} holds {held:,} events, not --events {args.events:,}")
    root = Path(tempfile.mkdtemp(prefix="glarch", dir="/tmp"))
    try:
        state = root / "state"
        state.mkdir()
        log = state / "ledger.sqlite"
        started = time.perf_counter()
        rows = churn(log, args.events, args.retention, args.from_log)
        churn_s = time.perf_counter() - started
        segments = len(list(archive_dir(log).glob("*.seg.zst")))
        reads = whole_history(log)
        timings = asyncio.run(starts(state, args.events))
        live = [r for r in rows if r["events"] > 2 * args.retention]
        print(f"\n{args.events:,} events, retention {args.retention:,}, churn + archiving {churn_s:.0f} s")
        print("| events written | live log MB | its WAL MB | archive MB | archive step s |\n|---:|---:|---:|---:|---:|")
        step = max(1, len(rows) // 10)
        for r in rows[step - 1 :: step]:
            print(f"| {r['events']:,.0f} | {r['live_mb']:.1f} | {r['wal_mb']:.1f} | {r['archive_mb']:.1f} | "
                  f"{r['archive_s']:.2f} |")
        if live:
            print(f"\nlive log after {2 * args.retention:,} events: {min(r['live_mb'] for r in live):.1f} to "
                  f"{max(r['live_mb'] for r in live):.1f} MB; {segments} segments, "
                  f"{rows[-1]['archive_mb'] * 1e6 / max(1, args.events - args.retention):.0f} bytes/archived event")
        print("\n| reading the whole history (segments + live log) | seconds |\n|---|---:|")
        for case, seconds in reads.items():
            print(f"| {case} | {seconds:.2f} |")
        print("\n| allocator start (process spawn -> answers on NATS) | seconds |\n|---|---:|")
        for t in timings:
            print(f"| {t['case']} | {float(str(t['seconds'])):.2f} |")
        print(f"\n{platform.machine()}, {os.cpu_count()} cpu, load average {os.getloadavg()[0]:.2f} at the end")
        if args.json:
            args.json.write_text(json.dumps({"churn": rows, "reads": reads, "starts": timings}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
