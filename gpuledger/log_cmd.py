"""``gpuledger log``: the event log's archive (``archive`` asks the running allocator; ``segments`` reads
the catalog from the file)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import click

from libs.config import Settings

__all__ = ["log"]


@click.group()
def log() -> None:
    """Bounded growth of the event log: archive older events, list the archive segments."""


async def _ask(nats_url: str, node: str, before: int, keep: int, timeout: float) -> Any:
    from libs.bus.client import Bus
    from libs.commands import ArchiveReply, ArchiveRequest

    bus = await Bus.connect(nats_url, name="gpuledger-log", node=node, wait=min(timeout, 10))
    try:
        return await bus.request(bus.subjects.archive, ArchiveRequest(before=before, keep_events=keep), ArchiveReply,
                                 timeout=timeout)
    finally:
        await bus.close()


@log.command()
@click.option("--before", default=None, help="Archive the events recorded before this time (ISO-8601 or unix seconds).")
@click.option("--keep-events", type=click.IntRange(1), default=None,
              help="Archive all but the newest N events (with --before: whichever archives fewer).")
@click.option("--nats-url", envvar="GPULEDGER_NATS_URL", show_envvar=True, default="nats://127.0.0.1:4222",
              show_default=True)
@click.option("--node-name", envvar=["GPULEDGER_NODE_NAME", "NODE_NAME"], show_envvar=True,
              default=socket.gethostname, help="The node whose allocator to ask [default: the host name].")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="Seconds to wait for the allocator to finish (compressing takes about a second per 100k events).")
def archive(before: str | None, keep_events: int | None, nats_url: str, node_name: str, timeout: float) -> None:
    """Move older events into a compressed, read-only archive segment (the running allocator does it).

    The segment's hash chain continues the live log's; replay, events, history and audit verify read
    segments and the live log as one. The newest snapshot's events and events not yet published on the
    node's stream always stay live.
    """
    from libs.errors import GpuledgerError
    from libs.events.codec import parse_time

    if before is None and keep_events is None:
        raise click.UsageError("give --before TIME and/or --keep-events N")
    try:
        before_ns = parse_time(before) if before else 0
        reply = asyncio.run(_ask(nats_url, node_name, before_ns, keep_events or 0, timeout))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--before") from exc
    except GpuledgerError as exc:
        raise click.ClickException(f"{exc} (is the allocator running for node {node_name!r}?)") from exc
    if reply.archived:
        click.echo(f"archived {reply.archived:,} events (seq {reply.first_seq}..{reply.last_seq}) into {reply.file}; "
                   f"the live log starts at seq {reply.live_first_seq}")
    else:
        click.echo(f"nothing archived; the live log starts at seq {reply.live_first_seq}")
    if reply.note and reply.note != "nothing to archive":
        click.echo(f"note: {reply.note}")


@log.command()
@click.option("--state-dir", envvar="GPULEDGER_STATE_DIR", show_envvar=True, default=lambda: Settings().state_dir,
              help="The agent's state directory.")
def segments(state_dir: str) -> None:
    """List the archive segments recorded in the live log's catalog, and what the live log holds."""
    import sqlite3

    from libs.errors import GpuledgerError
    from libs.events.codec import format_time
    from libs.store.archive import archive_dir, catalog, live_bounds
    from libs.store.replay import open_reader

    path = Settings(state_dir=state_dir).log_path
    try:
        conn = open_reader(path, archives=False)
    except GpuledgerError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        found, (first, last) = catalog(conn), live_bounds(conn)
    except sqlite3.DatabaseError as exc:
        raise click.ClickException(f"cannot read {path}: {exc}") from exc
    finally:
        conn.close()
    folder = archive_dir(path)
    click.echo(f"{'SEQ':<27}{'EVENTS':>10}  {'RECORDED FROM':<32}{'TO':<32}{'BYTES':>12}  FILE")
    for s in found:
        file = folder / s.file
        size = f"{file.stat().st_size:,}" if file.exists() else "MISSING"
        click.echo(f"{f'{s.first_seq}..{s.last_seq}':<27}{s.events:>10,}  {format_time(s.first_at):<32}"
                   f"{format_time(s.last_at):<32}{size:>12}  {s.file}")
    live = f"{first}..{last}" if last else "-"
    click.echo(f"{live:<27}{(last - first + 1 if last else 0):>10,}  (live log {path}, {path.stat().st_size:,} bytes)")
