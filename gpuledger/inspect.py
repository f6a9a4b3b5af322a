"""``gpuledger events`` and ``gpuledger replay``: read the log file directly (read-only).

Reading the SQLite file works with every service stopped, which is when an auditor often needs it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import msgspec

from libs.config import MIB
from libs.events.codec import StoredEvent, format_time, to_record
from libs.events.schema import (
    AllocationCorrected,
    AllocationGranted,
    AllocationRefused,
    AllocationReleased,
    InventoryRecorded,
)
from libs.ledger.state import LedgerSnapshot, LedgerState
from libs.store import iter_events, open_reader, replay

__all__ = ["follow_events", "print_events", "print_snapshot", "replay_state", "summary"]


def summary(stored: StoredEvent) -> str:
    ev = stored.event
    if isinstance(ev, AllocationGranted):
        gpus = ",".join(f"GPU{s.index}" for s in ev.shares)
        return (f"{ev.namespace}/{ev.pod_name} container={ev.container} cores={ev.cores} "
                f"memory={ev.memory // MIB}MiB on {gpus}")
    if isinstance(ev, AllocationReleased):
        return f"pod={ev.pod_uid} container={ev.container} reason={ev.reason}"
    if isinstance(ev, AllocationCorrected):  # issue 3
        return (f"{ev.namespace}/{ev.pod_name} container={ev.container} memory={ev.memory // MIB}MiB "
                f"(was pod={ev.previous_pod_uid} container={ev.previous_container}; {ev.reason})")
    if isinstance(ev, AllocationRefused):
        return f"{ev.device_count} x {ev.resource}: {ev.reason}"
    if isinstance(ev, InventoryRecorded):
        return f"node={ev.node} backend={ev.backend} gpus={len(ev.gpus)} driver={ev.driver_version or '-'}"
    return ""


def _line(stored: StoredEvent, as_json: bool) -> str:
    if as_json:
        return msgspec.json.encode(to_record(stored)).decode()
    return f"{stored.seq:>7}  {format_time(stored.recorded_at)}  {stored.type:<18}  {summary(stored)}"


def _read(path: Path, after: int) -> Iterator[StoredEvent]:
    conn = open_reader(path)
    try:
        yield from iter_events(conn, after_seq=after)
    finally:
        conn.close()


def print_events(path: Path, *, since: int, as_json: bool, out: TextIO = sys.stdout) -> int:
    last = since
    for stored in _read(path, since):
        print(_line(stored, as_json), file=out)
        last = stored.seq
    out.flush()
    return last


def follow_events(path: Path, *, since: int, as_json: bool, poll: float = 0.3) -> None:
    last = print_events(path, since=since, as_json=as_json)
    while True:
        time.sleep(poll)
        last = print_events(path, since=last, as_json=as_json)


def replay_state(path: Path, *, at: int | None = None, seq: int | None = None) -> LedgerSnapshot:
    state = LedgerState()
    replay(path, state.apply, upto_seq=seq, upto_time=at)
    return state.snapshot()


def print_snapshot(snap: LedgerSnapshot, *, as_json: bool, out: TextIO = sys.stdout) -> None:
    if as_json:
        print(msgspec.json.encode(snap).decode(), file=out)
        return
    when = format_time(snap.time) if snap.time else "-"
    print(f"state at seq {snap.seq} ({when}), node {snap.node or '-'}", file=out)
    print(f"{'GPU':<5}{'UUID':<42}{'cores used':>11}{'memory used':>18}  allocations", file=out)
    for g in snap.gpus:
        print(f"{g.index:<5}{g.uuid:<42}{g.cores_used:>7}/100{g.memory_used // MIB:>10}/{g.memory_total // MIB:<7}"
              f"  {len(g.alloc_ids)}", file=out)
    if not snap.allocations:
        print("no allocations", file=out)
        return
    print(f"\n{'POD':<36}{'CONTAINER':<16}{'GPUS':<10}{'CORES':>6}{'MEMORY':>10}  {'SINCE':<28}SEQ", file=out)
    for a in snap.allocations:
        pod = f"{a.namespace}/{a.pod_name}"
        gpus = ",".join(str(s.index) for s in a.shares)
        print(f"{pod:<36}{a.container:<16}{gpus:<10}{a.cores:>6}{a.memory // MIB:>7}MiB  "
              f"{format_time(a.granted_at):<28}{a.granted_seq}", file=out)
