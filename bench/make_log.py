"""Write a large synthetic allocation log, fast, in the exact format the allocator writes.

The events are realistic: one inventory, then grants (each with its full Allocate response and its
kubelet device IDs, stored compact as the allocator stores them: the response reproduced from the
recorded ``SETTINGS``, the IDs as runs) and releases, two grants to one release. It prints the size
of the file in bytes per event. Rows go
through the same row encoding and hash chain as the writer (``libs.store.rows``), and SQLite's
triggers still check every insert, but the file is written with ``synchronous=OFF`` in big
transactions: durability does not matter for a benchmark input, time does (1M events in ~15 s).

    python -m bench.make_log OUT.sqlite [--events 1000000] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from libs.events.schema import (
    AllocationGranted,
    AllocationReleased,
    ContainerResponse,
    Event,
    GpuInfo,
    GpuShare,
    InventoryRecorded,
)
from libs.placement.recorded import ResponseSettings
from libs.placement.responses import build_response
from libs.store.compact import (
    COMPACT_TYPES,
    COMPACT_V,
    COMPACT_V2,
    COMPACT_V3,
    SETTINGS_PREFIX,
    decode_compact,
    settings_row,
)
from libs.store.layout import Layout, layout_of
from libs.store.log import create_schema
from libs.store.rows import COLUMNS, GENESIS_HASH, chain_hash, event_row, row_to_stored
from libs.store.schema import FORMAT_1_DDL

__all__ = ["GPUS", "SETTINGS", "START_NS", "as_format_1", "copy_log", "synthetic", "write_log"]

GPUS = 8
GIB = 1 << 30
START_NS = 1_790_000_000_000_000_000  # 2026-09-21: a fixed start, so two runs give the same times
# The response settings the synthetic grants are built with (what the allocator records in meta).
SETTINGS = ResponseSettings(vm_root="/var/lib/gpuledger/vm", vdriver_root="/var/lib/gpuledger/vdriver")
# Made once: a Path per grant for each was about a seventh of the run.
_VM_ROOT, _VDRIVER_ROOT = Path(SETTINGS.vm_root), Path(SETTINGS.vdriver_root)


def synthetic(count: int, *, node: str = "bench") -> Iterator[Event]:
    """``count`` events: inventory, then grants each released two grants later."""
    yield InventoryRecorded(node=node, backend="fake", driver_version="550.54.15", gpus=tuple(
        GpuInfo(index=i, minor=i, uuid=f"GPU-{i:08d}", memory=80 * GIB, name="Fake H100") for i in range(GPUS)))
    live: list[AllocationGranted] = []
    made, i = 1, 0
    while made < count:
        made += 1
        if len(live) > 2:
            old = live.pop(0)
            yield AllocationReleased(alloc_id=old.alloc_id, pod_uid=old.pod_uid, container=old.container,
                                     reason="deleted")
            continue
        gpu = i % GPUS
        share = GpuShare(index=gpu, uuid=f"GPU-{gpu:08d}", minor=gpu, cores=25, memory=GIB)
        uid = f"{i:08x}-0000-4000-8000-000000000000"
        response: ContainerResponse = build_response(shares=(share,), cores=25, memory=GIB, pod_uid=uid,
                                                     vm_root=_VM_ROOT, vdriver_root=_VDRIVER_ROOT)
        grant = AllocationGranted(
            alloc_id=f"{i:032x}", request_id=f"req-{i:08d}", pod_uid=uid, namespace="bench", pod_name=f"job-{i}",
            container="main", container_index=0, cores=25, memory=GIB,
            device_ids=tuple(f"tencent.com/vcuda-core-{(i * 25 + k) % (GPUS * 100)}" for k in range(25)),
            shares=(share,), response=response)
        live.append(grant)
        yield grant
        i += 1


def write_log(path: Path, events: Iterator[Event], *, seed: int = 1, step_ns: int = 1_000_000,
              progress: bool = True) -> int:
    """Append ``events`` to the log at ``path`` (created if absent); returns the last seq."""
    create_schema(path)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    layout = layout_of(conn)
    conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", settings_row(SETTINGS))
    seq, at, prev = 0, START_NS, GENESIS_HASH
    last = conn.execute("SELECT seq, recorded_at, hash FROM events ORDER BY seq DESC LIMIT 1").fetchone()
    if last:
        seq, at, prev = last
    rng = random.Random(f"{seed}:{seq}")  # a continued log gets fresh event ids
    versions: dict[str, int] = {}
    rows: list[tuple[object, ...]] = []
    started = time.monotonic()

    def flush() -> None:
        conn.execute("BEGIN IMMEDIATE")
        layout.insert(conn, rows)
        conn.execute("COMMIT")
        rows.clear()
        if progress:
            rate = seq / max(time.monotonic() - started, 1e-9)
            print(f"  wrote {seq:,} events ({rate:,.0f}/s)", file=sys.stderr, flush=True)

    for ev in events:
        seq += 1
        at += step_ns
        stream = ev.stream()
        known = versions.get(stream)
        if known is None and last:  # continuing a log: the stream may already have events
            known = layout.stream_version(conn, stream)
        version = (known or 0) + 1
        versions[stream] = version
        if isinstance(ev, AllocationReleased):
            versions.pop(stream, None)  # a synthetic pod is done after its release: keep the dict small
        command = ev.request_id if isinstance(ev, AllocationGranted) else None
        row = event_row(seq, at, stream, version, ev, rng.randbytes(16), command, SETTINGS)
        prev = chain_hash(prev, row)
        rows.append((*row, prev))
        if len(rows) >= 20_000:
            flush()
    if rows:
        flush()
    conn.close()
    return seq


def copy_log(source: Path, path: Path, *, after: int, count: int) -> int:
    """Append the source log's rows ``after`` < seq <= ``after + count`` (already written by
    ``write_log``, hash chain and all) to the log at ``path`` (created if absent), as they are; returns
    the last seq now in ``path``. What ``write_log`` would write for the same events, without making
    them again: bench/archive.py's churn reads ``make bench``'s million-event log instead of generating
    a second one."""
    create_schema(path)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous=OFF")
        layout = layout_of(conn)
        table = layout.table
        conn.execute("ATTACH DATABASE ? AS src", (f"file:{source}?mode=ro",))
        if layout.format != "2" or layout_of(conn, "src").format != "2":
            raise ValueError(f"{source} and {path} must both be format 2 logs")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT OR IGNORE INTO meta SELECT * FROM src.meta")
        conn.execute("INSERT OR IGNORE INTO types SELECT * FROM src.types")  # the same ids: rows name them
        conn.execute(f"INSERT INTO {table} SELECT * FROM src.{table} WHERE seq > ? AND seq <= ? ORDER BY seq",
                     (after, after + count))
        conn.execute("COMMIT")
        conn.execute("DETACH DATABASE src")
        last = conn.execute(f"SELECT MAX(seq) FROM {table}").fetchone()[0]
        return int(last or 0)
    finally:
        conn.close()


def as_format_1(path: Path, out: Path, *, upto: int | None = None) -> None:
    """The events of the log at ``path`` (up to seq ``upto``) in a new file as the release before log format 2
    wrote them: format 1's schema and indexes, compact bodies of version 2 (releases whole), each row hashed
    in its own chain."""
    src = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    dst = sqlite3.connect(out, isolation_level=None)
    try:
        for ddl in FORMAT_1_DDL:
            dst.execute(ddl)
        dst.execute("BEGIN")
        meta = src.execute("SELECT key, value FROM meta").fetchall()
        dst.executemany("INSERT INTO meta VALUES (?, ?)", [(k, "1" if k == "format" else v) for k, v in meta])
        recorded = {s.digest: s for k, v in meta if k.startswith(SETTINGS_PREFIX)
                    for s in [msgspec.json.decode(v, type=ResponseSettings)]}
        cur = src.execute(f"SELECT {COLUMNS} FROM events WHERE seq <= ? ORDER BY seq",
                          (upto if upto is not None else 1 << 62,))
        prev = GENESIS_HASH
        while chunk := cur.fetchmany(5_000):
            rows = []
            for row in chunk:
                stored = row_to_stored(row, src)
                compact = row[5] in (COMPACT_V, COMPACT_V3) and row[4] in COMPACT_TYPES
                named = getattr(decode_compact(row[4], row[5], row[8]), "settings", b"") if compact else b""
                old = event_row(*row[:4], stored.event, row[6], row[7], recorded.get(named), COMPACT_V2)
                prev = chain_hash(prev, old)
                rows.append((*old, prev))
            Layout("1").insert(dst, rows)
        dst.execute("COMMIT")
    finally:
        src.close()
        dst.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} exists: this tool writes a new log")
    started = time.monotonic()
    last = write_log(args.out, synthetic(args.events), seed=args.seed)
    took = time.monotonic() - started
    size = args.out.stat().st_size
    print(f"{last:,} events in {took:.1f} s, {size / 1e6:,.0f} MB ({size / max(last, 1):.0f} bytes/event): {args.out}")


if __name__ == "__main__":
    main()
