"""Replay rate: the audit replay and the allocator's full fold, next to a raw scan of the same rows.

A synthetic log (``bench.make_log``: one inventory, then grants with their full Allocate response and
releases, 2:1) is read back (warm page cache), in one process; the goal's figure and its floors best of
``--runs`` runs, the two figures given for context (full replay, chain verification) best of
``--context-runs`` (1 by default):
- floor: ``SELECT`` of every stored column of every row through the raw driver, no decoding; and the
  same for only the five columns the audit replay reads (seq, recorded_at, type, schema_v, payload);
- audit replay (``gpuledger replay``): narrow views of the events, fold into holdings;
- full replay: every event decoded into its typed Struct and folded into ``LedgerState`` (what the
  allocator does at start when it has no valid snapshot);
- chain verification (``gpuledger audit verify``): every row re-hashed.

Each is measured on the log as written (format 2, libs/store/layout.py, body version 3) and on the same
events as the release before format 2 stored them (``--formats``: format 1, body version 2,
``bench.make_log.as_format_1``), the runs of the two alternating, so both see the same machine and load.

    python -m bench.replay [--events 1000000] [--log PATH (reuse a log written by bench.make_log)]
                           [--formats 1,2]
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

from bench.make_log import as_format_1, synthetic, write_log
from libs.ledger.holdings import audit_replay
from libs.ledger.state import LedgerState
from libs.store import replay
from libs.store.layout import layout_of
from libs.store.replay import CHUNK
from libs.store.verify import verify_log


def timed(fn: Callable[[], object], runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def stored_table(path: Path) -> str:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return layout_of(conn).table
    finally:
        conn.close()


def cases(path: Path, count: int) -> list[tuple[str, Callable[[], object], bool]]:
    """(name, run, goal) of each measurement on the log at ``path``."""
    table = stored_table(path)

    def scan(columns: str) -> None:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        cur = conn.execute(f"SELECT {columns} FROM {table} ORDER BY seq")
        while cur.fetchmany(CHUNK):
            pass
        conn.close()

    def audit() -> None:
        assert audit_replay(path).seq == count

    def full() -> None:
        state = LedgerState()
        replay(path, state.apply)
        assert state.seq == count

    def verify() -> None:
        assert verify_log(path).ok

    # The third item: whether the case is the goal's figure or its floor (best of --runs), or context
    # (best of --context-runs: the full replay alone takes ~15 s a run here, and no goal is set on it).
    return [("raw scan of every stored column, no decoding (floor)", lambda: scan("*"), True),
            ("raw scan of the 5 columns the audit replay reads (its floor)",
             lambda: scan("seq, recorded_at, type, schema_v, payload"), True),
            ("audit replay: narrow decode + holdings (`gpuledger replay`)", audit, True),
            ("full replay: typed decode + LedgerState (allocator start without snapshot)", full, False),
            ("chain verification (`gpuledger audit verify`)", verify, False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--log", type=Path, default=None, help="reuse this log instead of writing one")
    parser.add_argument("--runs", type=int, default=3, help="runs of the audit replay and its floors (best taken)")
    parser.add_argument("--context-runs", type=int, default=1,
                        help="runs of the full replay and the chain verification (best taken)")
    parser.add_argument("--formats", default="1,2", help="row formats to measure, the same rows in each")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="glr", dir="/tmp"))
    path = args.log
    if path is None:
        path = scratch / "ledger.sqlite"
        write_log(path, synthetic(args.events))
    logs: dict[str, Path] = {}
    for fmt in args.formats.split(","):
        if fmt == stored_table_format(path):
            logs[fmt] = path
        elif fmt == "1":
            logs[fmt] = scratch / "format1.sqlite"
            as_format_1(path, logs[fmt])
        else:
            parser.error(f"format {fmt}: only format 1 can be made from the log (which is format "
                         f"{stored_table_format(path)})")
    count = sqlite3.connect(f"file:{path}?mode=ro", uri=True).execute("SELECT MAX(seq) FROM events").fetchone()[0]
    per_format = {fmt: cases(log, count) for fmt, log in logs.items()}
    rows = []
    for i, (name, _, goal) in enumerate(next(iter(per_format.values()))):
        best = dict.fromkeys(logs, float("inf"))
        for _ in range(args.runs if goal else args.context_runs):
            for fmt, measured in per_format.items():  # alternating: both formats under the same load
                best[fmt] = min(best[fmt], timed(measured[i][1], 1))
        rows.append({"name": name, "seconds": {f"format {f}": round(s, 3) for f, s in best.items()}})
        print(f"  {name}: " + ", ".join(f"format {f} {s:.2f} s" for f, s in best.items()), flush=True)
    sizes = {fmt: log.stat().st_size / count for fmt, log in logs.items()}
    print(f"\n| read ({count:,} events; " + ", ".join(f"format {f}: {b:,.0f} B/event on disk" for f, b in sizes.items())
          + ") | " + " | ".join(f"format {f} s (events/s)" for f in logs) + " |")
    print("|---|" + "---:|" * len(logs))
    for r in rows:
        print(f"| {r['name']} | " + " | ".join(f"{s} ({count / s:,.0f})" for s in r["seconds"].values()) + " |")
    print(f"\n{platform.machine()}, {os.cpu_count()} cpu, load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        args.json.write_text(json.dumps({"events": count, "rows": rows, "bytes_per_event": sizes}))
    shutil.rmtree(scratch, ignore_errors=True)


def stored_table_format(path: Path) -> str:
    return "1" if stored_table(path) == "events" else "2"


if __name__ == "__main__":
    main()
