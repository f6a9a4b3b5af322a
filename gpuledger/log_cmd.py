"""``gpuledger log restore``: replace a damaged event log with the events of the node's JetStream stream
(every event is published there with stream seq == log seq, see libs/bus/outbox.py) or of a backup.

Run it with the allocator stopped (it takes the log's writer lock, so it is refused otherwise); the
damaged file is kept beside the new one. The restored log passes ``gpuledger audit verify``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
from pathlib import Path

import click

from gpuledger.options import OptionConflict
from libs.config import Settings
from libs.errors import GpuledgerError, StoreError

__all__ = ["log_group", "restore"]


@click.group("log")
def log_group() -> None:
    """The event log file itself: restore a damaged one."""


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
    from libs.store.restore import set_aside, swap_in, write_restored
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
                write_restored(fresh, events)  # type: ignore[arg-type]
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
