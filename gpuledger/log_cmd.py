"""``gpuledger log``: the event log file itself.

``restore`` replaces a damaged event log with the events of the node's JetStream stream (every event is
published there with stream seq == log seq, see libs/bus/outbox.py) or of a backup. ``archive`` asks the
running allocator to move older events into compressed segments; ``segments`` lists the catalog.

Run ``restore`` with the allocator stopped (it takes the log's writer lock, so it is refused otherwise); the
damaged file is kept beside the new one. The restored log passes ``gpuledger audit verify``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sqlite3
from pathlib import Path
from typing import Any

import click

from gpuledger.options import OptionConflict
from libs.config import Settings
from libs.errors import GpuledgerError, StoreError

__all__ = ["archive", "log_group", "restore", "segments"]


@click.group("log")
def log_group() -> None:
    """The event log file itself: restore a damaged one, archive older events, list the segments."""


async def _stream_events(nats_url: str, node: str, timeout: float) -> list[object]:
    from nats.js.errors import NotFoundError

    from gpuledger.agent_file import served_nodes, wrong_node
    from libs.bus.client import Bus
    from libs.bus.follow import LogFollower

    bus = await Bus.connect(nats_url, name="gpuledger-log-restore", node=node, wait=timeout)
    try:
        try:
            info = await bus.js.stream_info(bus.subjects.stream)
        except NotFoundError:
            problem = wrong_node(f"NATS at {nats_url}", await served_nodes(bus), node)
            raise StoreError(problem or f"NATS at {nats_url} holds no event stream of node {node!r}") from None
        last = info.state.last_seq
        if last and info.state.first_seq != 1:
            raise StoreError(f"stream {bus.subjects.stream} starts at seq {info.state.first_seq}, not 1")
        got: list[object] = []
        follower = LogFollower(bus, got.append)
        task = asyncio.create_task(follower.run())
        try:
            await follower.wait_for(last, timeout=timeout + last / 2000)  # ~10k events/s read back, with room
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return got[:last]
    finally:
        await bus.close()


def _copy_backup(backup: Path, fresh: Path) -> None:
    from libs.store.restore import readable
    from libs.store.verify import verify_log

    if not backup.is_file() or not readable(backup):
        raise StoreError(f"{backup} is not a readable gpuledger event log")
    report = verify_log(backup)
    if not report.ok:
        raise StoreError(f"the backup {backup} is not intact either (seq {report.first_bad_seq}: {report.problem})")
    fresh.unlink(missing_ok=True)
    src = sqlite3.connect(f"file:{backup}?mode=ro", uri=True)
    dst = sqlite3.connect(fresh)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()


@log_group.command()
@click.option("--state-dir", envvar="GPULEDGER_STATE_DIR", show_envvar=True,
              default=lambda: Settings().state_dir, help="The agent's state directory (its ledger.sqlite).")
@click.option("--from", "backup", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A backup copy of ledger.sqlite to restore instead of the stream (checked first).")
@click.option("--nats-url", envvar="GPULEDGER_NATS_URL", show_envvar=True, default=None,
              help="The node's NATS server [default: the running `up`'s (agent.json), else nats://127.0.0.1:4222].")
@click.option("--node-name", envvar=["GPULEDGER_NODE_NAME", "NODE_NAME"], default=None,
              help="Whose stream [default: the running `up`'s node, else the host name].")
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds to reach NATS and read.")
def restore(state_dir: str, backup: Path | None, nats_url: str | None, node_name: str | None, timeout: float) -> None:
    """Replace a damaged ledger.sqlite with the node's JetStream stream (or --from a backup).

    The damaged file is kept beside it as ledger.sqlite.damaged-<time>. Stop the allocator first."""
    from gpuledger.agent_file import locate
    from libs.ledger.snapshot import read_header, snapshot_path
    from libs.store.log import writer_lock
    from libs.store.restore import recorded_settings, set_aside, swap_in, write_restored
    from libs.store.verify import verify_log

    if backup is not None and nats_url is not None:
        raise OptionConflict("give --from or --nats-url, not both")
    path = Settings(state_dir=state_dir).log_path
    fresh = path.with_name(f"{path.name}.restoring")
    try:
        lock = writer_lock(path)  # the allocator must not write meanwhile
        try:
            if backup is not None:
                source = f"backup {backup}"
                _copy_backup(backup, fresh)
            else:
                target = locate(nats_url=nats_url, node_name=node_name, state_dir=state_dir)
                source = f"stream of node {target.node!r} on {target.nats_url}"
                events = asyncio.run(_stream_events(target.nats_url, target.node, timeout))
                # The grants' compact form names the response settings they were written under: the
                # damaged log's own record of them where it can still be read, else this node's.
                known = [*recorded_settings(path), *configured_response_settings(Settings(state_dir=state_dir))]
                write_restored(fresh, events, list(dict.fromkeys(known)))  # type: ignore[arg-type]
            report = verify_log(fresh)
            if not report.ok:
                raise StoreError(f"the restored log is not intact at seq {report.first_bad_seq}: {report.problem}")
            try:
                header = read_header(path)
            except Exception:  # a damaged snapshot says nothing either way
                header = None
            kept = set_aside(path, snapshot_path(path)) if path.exists() else []
            swap_in(fresh, path)
        finally:
            os.close(lock)
            fresh.unlink(missing_ok=True)
    except GpuledgerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"restored {report.events:,} events (seq 1..{report.last_seq}) from the {source} into {path}; "
               f"head hash {report.head_hash or '-'}")
    if header is not None and header[0].seq <= report.last_seq:
        # the fold snapshot's header pins the hash the damaged log had at its seq
        check = verify_log(path, expect=(header[0].seq, bytes.fromhex(header[0].hash)))
        click.echo(f"the hash at seq {header[0].seq} {'matches' if check.ok else 'DIFFERS from'} the one the "
                   f"snapshot of the damaged log recorded")
    for old in kept:
        click.echo(f"kept: {old}")


def configured_response_settings(settings: Settings) -> list[Any]:
    """The response settings the allocator builds with under ``settings`` ([] when its --extra-config
    cannot be read: the restore then relies on the log's record, or keeps the responses)."""
    from libs.placement.recorded import ResponseSettings
    from services.allocator.extraconfig import default_devices

    try:
        extra = default_devices(settings.extra_config)
    except GpuledgerError:
        return []
    return [ResponseSettings.for_node(settings, extra)]


async def _ask(nats_url: str, node: str, before: int, keep: int, timeout: float) -> Any:
    from libs.bus.client import Bus
    from libs.commands import ArchiveReply, ArchiveRequest

    bus = await Bus.connect(nats_url, name="gpuledger-log", node=node, wait=min(timeout, 10))
    try:
        return await bus.request(bus.subjects.archive, ArchiveRequest(before=before, keep_events=keep), ArchiveReply,
                                 timeout=timeout)
    finally:
        await bus.close()


@log_group.command()
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


@log_group.command()
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
