"""``gpuledger events``, ``replay`` and ``history`` output; ``events --follow`` on the file or the stream.

Reading the SQLite file works with every service stopped, which is when an auditor often needs it.
``events --follow --nats-url`` reads the node's JetStream stream instead, as any operator's
subscriber would.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import msgspec

from gpuledger.table import table
from libs.config import MIB
from libs.errors import StoreError
from libs.events.codec import StoredEvent, decode_record, format_time, to_record
from libs.events.schema import (
    AllocationCorrected,
    AllocationGranted,
    AllocationRefused,
    AllocationReleased,
    GpuHealthChanged,
    GpuShare,
    InventoryRecorded,
)
from libs.events.subjects import unescape_token
from libs.ledger.holdings import AuditView, Holding, audit_replay
from libs.ledger.state import LedgerSnapshot, LedgerState
from libs.ledger.timeline import Entry
from libs.store import iter_events, open_reader, replay

__all__ = [
    "audit_view",
    "follow_events",
    "follow_stream",
    "history_json",
    "last_seq",
    "print_events",
    "print_history",
    "print_snapshot",
    "replay_json",
    "replay_state",
    "summary",
    "with_times",
]


def summary(stored: StoredEvent) -> str:
    ev = stored.event
    if isinstance(ev, AllocationGranted):
        gpus = ",".join(f"GPU{s.index}" for s in ev.shares)
        return (f"{ev.namespace}/{ev.pod_name} container={ev.container} cores={ev.cores} "
                f"memory={ev.memory // MIB}MiB on {gpus}")
    if isinstance(ev, AllocationReleased):
        return f"pod={ev.pod_uid} container={ev.container} reason={ev.reason}"
    if isinstance(ev, AllocationCorrected):  # pod identity
        return (f"{ev.namespace}/{ev.pod_name} container={ev.container} memory={ev.memory // MIB}MiB "
                f"(was pod={ev.previous_pod_uid} container={ev.previous_container}; {ev.reason})")
    if isinstance(ev, AllocationRefused):
        return f"{ev.device_count} x {ev.resource}: {ev.reason}"
    if isinstance(ev, InventoryRecorded):
        return f"node={ev.node} backend={ev.backend} gpus={len(ev.gpus)} driver={ev.driver_version or '-'}"
    if isinstance(ev, GpuHealthChanged):  # GPU health
        return f"GPU{ev.index} {'healthy' if ev.healthy else 'UNHEALTHY'} reason={ev.reason}" + (
            f" xid={ev.xid}" if ev.xid else "") + (f" ({ev.detail})" if ev.detail else "")
    return ""


def _line(stored: StoredEvent, as_json: bool) -> str:
    if as_json:
        return msgspec.json.encode(to_record(stored)).decode()
    return f"{stored.seq:>7}  {format_time(stored.recorded_at)}  {stored.type:<18}  {summary(stored)}"


def _read(path: Path, after: int) -> Iterator[StoredEvent]:
    conn = open_reader(path, from_seq=after + 1)  # archive segments only when they hold seqs after ``after``
    try:
        yield from iter_events(conn, after_seq=after)
    finally:
        conn.close()


def last_seq(path: Path) -> int:
    """The log's last seq (0 when empty)."""
    import sqlite3

    from libs.store.replay import unreadable

    conn = open_reader(path, merged=False)  # the last seq is the live log's: no segment is read
    try:
        return max(int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0]),
                   getattr(conn, "archived", 0))
    except sqlite3.DatabaseError as exc:
        raise unreadable(path, exc) from exc
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
    """Follow the SQLite file itself: works with every service stopped."""
    last = print_events(path, since=since, as_json=as_json)
    while True:
        time.sleep(poll)
        last = print_events(path, since=last, as_json=as_json)


async def follow_stream(url: str, *, node: str | None, since: int, as_json: bool, durable: str | None = None,
                        out: TextIO = sys.stdout) -> None:
    """Follow the node's JetStream stream, from ``since + 1``, or from a durable consumer's position."""
    from libs.bus.client import Bus
    from libs.bus.follow import LogFollower
    from libs.logger import configure_logging

    configure_logging("events", fmt="console", level="warning")  # to stderr: stdout carries only the events
    bus = await Bus.connect(url, name="gpuledger-events", node=node or "-", wait=10)
    try:
        if node is None:
            bus = bus.for_node(await _only_node(bus))

        def show(stored: StoredEvent) -> None:
            print(_line(stored, as_json), file=out, flush=True)

        if durable:
            await _follow_durable(bus, durable, since, show)
        else:
            await LogFollower(bus, show, after_seq=since).run()
    finally:
        await bus.close()


async def _only_node(bus: Any) -> str:
    prefix = "GPULEDGER_"
    names = [info.config.name for info in await bus.js.streams_info()
             if (info.config.name or "").startswith(prefix)]
    if len(names) != 1:
        raise StoreError(f"{len(names)} gpuledger streams on this NATS server ({', '.join(names) or 'none'}): "
                         "name the node with --node-name")
    return unescape_token(names[0][len(prefix):])


async def _follow_durable(bus: Any, name: str, since: int, show: Any) -> None:
    """A durable pull consumer: the server keeps the position; an event is acked once it is printed."""
    import asyncio

    import nats.errors
    from nats.js import api
    from nats.js.errors import APIError

    from libs.bus.follow import raise_if_cancelling

    config = api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT, max_ack_pending=1024,
                                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE if since else api.DeliverPolicy.ALL,
                                opt_start_seq=since + 1 if since else None)
    while True:
        try:
            psub = await bus.js.pull_subscribe(f"{bus.subjects.prefix}.>", durable=name, stream=bus.subjects.stream,
                                               config=config)
            while True:
                try:
                    msgs = await psub.fetch(256, timeout=1)
                except nats.errors.TimeoutError as exc:
                    raise_if_cancelling(exc)  # Ctrl-C must stop it, even when nats-py loses the cancel
                    continue
                for msg in msgs:
                    show(decode_record(msg.data))
                    await msg.ack_sync(timeout=5)
        except (nats.errors.Error, APIError, OSError) as exc:
            raise_if_cancelling(exc)
            await asyncio.sleep(0.5)  # the broker is away: the consumer's position waits on the server


def replay_state(path: Path, *, at: int | None = None, seq: int | None = None) -> LedgerSnapshot:
    """The allocator's full state as of a time or seq (every field it folds, responses included)."""
    state = LedgerState()
    replay(path, state.apply, upto_seq=seq, upto_time=at)
    return state.snapshot()


def audit_view(path: Path, *, at: int | None = None, seq: int | None = None) -> AuditView:
    """Who held what as of a time or seq: what ``gpuledger replay`` prints (the fast, narrow fold)."""
    return audit_replay(path, upto_seq=seq, upto_time=at)


def _shares(shares: tuple[GpuShare, ...]) -> str:
    return ",".join(f"GPU{s.index}:{s.cores}c/{s.memory // MIB}MiB" for s in shares)


def print_snapshot(view: AuditView, *, as_json: bool, out: TextIO = sys.stdout) -> None:
    """Who held which GPU share, since when, granted by which request."""
    if as_json:
        print(json.dumps(replay_json(view)), file=out)
        return
    when = format_time(view.time) if view.time else "-"
    print(f"state at seq {view.seq} ({when}), node {view.node or '-'}", file=out)
    gpus = [(g.index, g.uuid, f"{g.cores_used}/100", f"{g.memory_used // MIB}/{g.memory_total // MIB}",
             len(g.holders), "healthy" if g.healthy else f"UNHEALTHY ({g.health_reason})") for g in view.gpus]
    for line in table(("GPU", "UUID", "CORES USED", "MEMORY USED (MiB)", "ALLOCATIONS", "HEALTH"), gpus,
                      right=("GPU", "CORES USED", "MEMORY USED (MiB)", "ALLOCATIONS")):
        print(line, file=out)
    if not view.allocations:
        print("no allocations", file=out)
        return
    rows = [(f"{a.namespace}/{a.pod_name}" if a.pod_name else a.pod_uid, a.container, _shares(a.shares),
             format_time(a.since), a.granted_seq, a.request_id, f"{a.event_id}{_notes(a)}") for a in view.allocations]
    print(file=out)
    for line in table(("POD", "CONTAINER", "SHARES", "SINCE", "SEQ", "REQUEST", "EVENT"), rows, right=("SEQ",)):
        print(line, file=out)


def replay_json(view: AuditView) -> dict[str, Any]:
    """``replay --json``: times as RFC 3339 strings, the unix nanoseconds beside them (``*_ns``);
    docs/schemas/cli/replay.json."""
    data = msgspec.to_builtins(view)
    data["time"] = format_time(view.time) if view.time else None
    data["time_ns"] = view.time
    for held in data["allocations"]:
        with_times(held, "since")
    return data


def with_times(item: dict[str, Any], *fields: str) -> dict[str, Any]:
    """Times as every ``--json`` gives them: RFC 3339 with nanoseconds, the unix nanoseconds beside
    them as ``<field>_ns`` (None stays None)."""
    for name in fields:
        raw = item.get(name)
        item[name], item[f"{name}_ns"] = (format_time(raw) if raw is not None else None), raw
    return item


def _notes(a: Holding) -> str:
    notes = []
    if a.corrected_seq:
        notes.append(f"corrected at seq {a.corrected_seq}")
    if not a.charged:
        notes.append("not charged: its devices went to a later container of the pod")
    return f"  ({'; '.join(notes)})" if notes else ""


def history_json(entry: Entry) -> dict[str, Any]:
    """One ``history --json`` line: the readable time, then the record's fields (``recorded_at``: the same
    instant in unix nanoseconds); docs/schemas/cli/history.json."""
    return {"time": entry.time, **msgspec.to_builtins(entry)}


def print_history(entries: list[Entry], *, as_json: bool, out: TextIO = sys.stdout) -> None:
    if as_json:
        for e in entries:
            print(json.dumps(history_json(e)), file=out)
        return
    if not entries:
        print("no events", file=out)
        return
    rows = [(e.seq, e.time, e.type, f"{e.namespace}/{e.pod_name}" if e.pod_name else e.pod_uid, e.container,
             _shares(e.shares), e.detail or (f"request {e.request_id}" if e.request_id else "")) for e in entries]
    for line in table(("SEQ", "TIME", "TYPE", "POD", "CONTAINER", "SHARES", "DETAIL"), rows, right=("SEQ",)):
        print(line, file=out)
