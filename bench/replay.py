"""Replay rate: the audit replay and the allocator's full fold, next to a raw scan of the same rows.

A synthetic log (``bench.make_log``: one inventory, then grants with their full Allocate response and
releases, 2:1) is read back, best of ``--runs`` runs each (warm page cache), in one process:
- floor: ``SELECT`` of every column of every row through the raw driver, no decoding; and the same
  for only the five columns the audit replay reads (seq, recorded_at, type, schema_v, payload);
- audit replay (``gpuledger replay``): narrow views of the events, fold into holdings;
- full replay: every event decoded into its typed Struct and folded into ``LedgerState`` (what the
  allocator does at start when it has no valid snapshot);
- chain verification (``gpuledger audit verify``): every row re-hashed.

    python -m bench.replay [--events 1000000] [--log PATH (reuse a log written by bench.make_log)]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.make_log import synthetic, write_log
from libs.ledger.holdings import audit_replay
from libs.ledger.state import LedgerState
from libs.store import replay
from libs.store.replay import CHUNK
from libs.store.verify import verify_log


def timed(fn: Callable[[], object], runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--log", type=Path, default=None, help="reuse this log instead of writing one")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    scratch = None
    path = args.log
    if path is None:
        scratch = Path(tempfile.mkdtemp(prefix="glr", dir="/tmp"))
        path = scratch / "ledger.sqlite"
        write_log(path, synthetic(args.events))
    count = sqlite3.connect(f"file:{path}?mode=ro", uri=True).execute("SELECT MAX(seq) FROM events").fetchone()[0]

    def scan(columns: str) -> None:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        cur = conn.execute(f"SELECT {columns} FROM events ORDER BY seq")
        while cur.fetchmany(CHUNK):
            pass
        conn.close()

    def floor() -> None:
        scan("*")

    def narrow_floor() -> None:
        scan("seq, recorded_at, type, schema_v, payload")

    def audit() -> None:
        assert audit_replay(path).seq == count

    def full() -> None:
        state = LedgerState()
        replay(path, state.apply)
        assert state.seq == count

    def verify() -> None:
        assert verify_log(path).ok

    cases = [("raw scan of every column, no decoding (floor)", floor, args.runs),
             ("raw scan of the 5 columns the audit replay reads (its floor)", narrow_floor, args.runs),
             ("audit replay: narrow decode + holdings (`gpuledger replay`)", audit, args.runs),
             ("full replay: typed decode + LedgerState (allocator start without snapshot)", full, args.runs),
             ("chain verification (`gpuledger audit verify`)", verify, 1)]
    rows = []
    for name, fn, runs in cases:
        seconds = timed(fn, runs)
        rows.append({"name": name, "seconds": round(seconds, 3), "events_per_s": round(count / seconds)})
        print(f"  {name}: {seconds:.2f} s", flush=True)
    size = path.stat().st_size
    print(f"| read ({count:,} events, {size / count:,.0f} bytes/event on disk) | seconds | events/s |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['seconds']} | {r['events_per_s']:,} |")
    print(f"\n{platform.machine()}, {os.cpu_count()} cpu, load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        args.json.write_text(json.dumps({"events": count, "rows": rows, "bytes_per_event": size / count}))
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
