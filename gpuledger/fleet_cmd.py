"""``gpuledger fleet``: the fleet recorder and the fleet-wide queries (holdings at T, history, utilization)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import click
import msgspec

from gpuledger.inspect import with_times
from gpuledger.options import agent_options, settings_from
from libs.config import Settings
from libs.events.codec import format_time, parse_time

__all__ = ["fleet"]

MIB = 1 << 20


def _db_option(fn: Any) -> Any:
    fn = click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")(fn)
    fn = click.option("--state-dir", envvar="GPULEDGER_STATE_DIR", show_envvar=True,
                      default=lambda: Settings().state_dir, help="Where the default SQLite database lives.")(fn)
    return click.option("--db", envvar="GPULEDGER_FLEET_DB", show_envvar=True, default="",
                        help="The recorder's database URL [default: SQLite at STATE_DIR/fleet.sqlite].")(fn)


@contextlib.contextmanager
def _engine(db: str, state_dir: str) -> Iterator[Any]:
    """The recorder's database for one command, its connections closed after (a command run in
    another program's process, as the tests run them, leaves no session open on the server)."""
    from services.fleet.app import open_engine

    engine = open_engine(db or Settings(state_dir=state_dir).fleet_db_url)
    try:
        yield engine
    finally:
        engine.dispose()


def _when(text: str | None, default: int) -> int:
    if text is None:
        return default
    try:
        return parse_time(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def _json(value: object) -> None:
    print(msgspec.json.encode(value).decode())


@click.group()
def fleet() -> None:
    """The fleet ledger: every node's allocation history in one place (see docs/fleet.md)."""


@fleet.command()
@agent_options
def record(**values: Any) -> None:
    """Run the fleet recorder: the fleet stream of the central cluster (--nats-url, --fleet-credentials)
    into the SQL projection (--fleet-db), with /metrics on --metrics-port + 4."""
    from libs.runtime import run_service
    from services.fleet.app import service

    settings = settings_from(values, nats_url=values.get("nats_url") or "nats://127.0.0.1:4222")
    sys.exit(run_service("fleet", settings, service))


@fleet.command("at")
@click.argument("when")
@click.option("--node", default=None, help="Only this node.")
@_db_option
def at_(when: str, node: str | None, db: str, state_dir: str, as_json: bool) -> None:
    """Every holding on every node at WHEN (ISO-8601 or unix seconds), as each node's `replay --at` says."""
    from libs.fleet.queries import fleet_at

    with _engine(db, state_dir) as engine:
        states = fleet_at(engine, _when(when, 0), node=node)
    if as_json:  # times as `replay --json` gives them: RFC 3339, the unix nanoseconds beside them
        data = msgspec.to_builtins(states)
        for held in data:
            for out in held["allocations"]:
                with_times(out, "since")
        _json(data)
        return
    if not states:
        print("no holdings")
    for s in states:
        for a in s.allocations:
            shares = ",".join(f"{g.uuid}:{g.cores}c/{g.memory // MIB}MiB" for g in a.shares)
            print(f"{s.node:<24}{a.namespace}/{a.pod_name:<28}{a.container:<14}{shares:<48}{format_time(a.since)}")


@fleet.command("history")
@click.option("--node", default=None)
@click.option("--pod", default=None, help="Pod name or UID.")
@click.option("--namespace", default=None)
@click.option("--gpu", default=None, help="GPU UUID.")
@click.option("--since", default=None, help="Only states that lasted past this time.")
@click.option("--until", default=None, help="Only states that began by this time.")
@_db_option
def history_(node: str | None, pod: str | None, namespace: str | None, gpu: str | None, since: str | None,
             until: str | None, db: str, state_dir: str, as_json: bool) -> None:
    """Who held what, when: every state of the allocations matching the filters, oldest first."""
    from libs.fleet.queries import history

    with _engine(db, state_dir) as engine:
        rows = history(engine, node=node, pod=pod, namespace=namespace, gpu=gpu,
                       since=_when(since, 0) if since else None, until=_when(until, 0) if until else None)
    if as_json:
        out = []
        for row in msgspec.to_builtins(rows):
            with_times(row, "valid_from", "valid_to")
            with_times(row["holding"], "since")
            out.append(row)
        _json(out)
        return
    for r in rows:
        a = r.holding
        to = format_time(r.valid_to) if r.valid_to is not None else "(held)"
        shares = ",".join(f"{g.uuid}:{g.cores}c" for g in a.shares)
        print(f"{r.node:<24}{a.namespace}/{a.pod_name:<28}{a.container:<14}{shares:<40}"
              f"{format_time(r.valid_from)}  {to}")


@fleet.command("utilization")
@click.option("--since", default=None, help="Window start [default: one hour ago].")
@click.option("--until", default=None, help="Window end [default: now].")
@_db_option
def utilization_(since: str | None, until: str | None, db: str, state_dir: str, as_json: bool) -> None:
    """Share of vcuda-cores held per node and GPU model over a window."""
    from libs.fleet.queries import utilization

    now = time.time_ns()
    with _engine(db, state_dir) as engine:
        rows = utilization(engine, _when(since, now - 3600 * 10**9), _when(until, now))
    if as_json:
        _json(rows)
        return
    for u in rows:
        print(f"{u.node:<24}{u.model:<32}{u.gpus:>4} GPUs  {100 * u.utilization:6.1f}%")


@fleet.command("nodes")
@_db_option
def nodes_(db: str, state_dir: str, as_json: bool) -> None:
    """The nodes the recorder has heard of: last seq, last row hash, when."""
    from libs.fleet.queries import nodes

    with _engine(db, state_dir) as engine:
        rows = nodes(engine)
    if as_json:
        _json([with_times(row, "last_event_at") for row in msgspec.to_builtins(rows)])
        return
    for n in rows:
        print(f"{n.node:<24}seq {n.last_seq:<10}{n.events:>10} events  last {format_time(n.last_event_at)}")


@fleet.command("leaf-config")
@click.option("--node-name", envvar=["GPULEDGER_NODE_NAME", "NODE_NAME"], required=True)
@click.option("--fleet-url", envvar="GPULEDGER_FLEET_URL", required=True, help="The central leafnode URLs.")
@click.option("--fleet-credentials", envvar="GPULEDGER_FLEET_CREDENTIALS", required=True)
@click.option("--store-dir", default="/var/lib/gpuledger/nats", show_default=True)
@click.option("--port", type=int, default=4222, show_default=True)
def leaf_config_(node_name: str, fleet_url: str, fleet_credentials: str, store_dir: str, port: int) -> None:
    """Print the nats-server configuration of this node's broker as a leaf node of the fleet (for a
    DaemonSet's nats container; `gpuledger up --fleet-url` writes the same one itself)."""
    from pathlib import Path

    from libs.errors import GpuledgerError
    from libs.fleet.credentials import load_credentials
    from libs.fleet.natsconf import leaf_config

    try:
        creds = load_credentials(fleet_credentials)
    except GpuledgerError as exc:
        raise click.ClickException(str(exc)) from exc
    print(leaf_config(node_name, Path(store_dir), remote_urls=[u for u in fleet_url.split(",") if u.strip()],
                      user=creds.user, password=creds.password, port=port))


@fleet.command("join")
@click.argument("node", nargs=-1, required=True)
@click.option("--nats-url", envvar="GPULEDGER_NATS_URL", required=True, help="The central cluster's client URLs.")
@click.option("--fleet-credentials", envvar="GPULEDGER_FLEET_CREDENTIALS", default="",
              help="YAML user:/password: of an account admin (the recorder's).")
def join(node: tuple[str, ...], nats_url: str, fleet_credentials: str) -> None:
    """Source these nodes' streams into the fleet stream (one stream update for all of them)."""
    from libs.bus import Bus
    from libs.fleet.credentials import load_credentials, with_credentials
    from libs.fleet.naming import HUB_INBOX
    from libs.fleet.stream import ensure_fleet_stream

    async def go() -> None:
        creds = load_credentials(fleet_credentials) if fleet_credentials else None
        bus = await Bus.connect(with_credentials(nats_url, creds), name="fleet-join", node="fleet", wait=10,
                                inbox_prefix=HUB_INBOX)
        try:
            start = time.monotonic()
            info = await ensure_fleet_stream(bus.js, node)
            print(f"fleet stream sources {len(info.config.sources or [])} nodes "
                  f"({time.monotonic() - start:.3f}s)")
        finally:
            await bus.close()

    asyncio.run(go())


@fleet.command("restore")
@click.option("--node", required=True, help="The node whose ledger to rebuild from the fleet copy.")
@click.option("--state-dir", envvar="GPULEDGER_STATE_DIR", show_envvar=True, default=lambda: Settings().state_dir,
              help="The node's state dir to write (STATE_DIR/ledger.sqlite must not exist).")
@click.option("--nats-url", envvar="GPULEDGER_NATS_URL", required=True, help="The central cluster's client URLs.")
@click.option("--fleet-credentials", envvar="GPULEDGER_FLEET_CREDENTIALS", default="",
              help="YAML user:/password: that may read the fleet stream (the recorder's).")
@click.option("--recorder-dir", default="", metavar="DIR",
              help="The recorder's state dir: its SQLite database and witness.pub, unless --db/--witness-key say.")
@click.option("--db", envvar="GPULEDGER_FLEET_DB", show_envvar=True, default="",
              help="The recorder's database URL (its witness store) [default: SQLite at RECORDER_DIR/fleet.sqlite].")
@click.option("--witness-key", default=None, metavar="VKEY|@FILE",
              help="The witness's verifier key you trust [default: RECORDER_DIR/witness.pub].")
@click.option("--cluster-name", envvar="GPULEDGER_CLUSTER_NAME", show_envvar=True, default="default",
              show_default=True, help="The cluster in the node's checkpoint origin, gpuledger/<cluster>/<node>.")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON.")
def restore_(node: str, state_dir: str, nats_url: str, fleet_credentials: str, recorder_dir: str, db: str,
             witness_key: str | None, cluster_name: str, as_json: bool) -> None:
    """Rebuild NODE's ledger from the fleet stream, checked against the latest checkpoint the recorder
    cosigned for it; the node's allocator, started on STATE_DIR, goes on from there."""
    from pathlib import Path

    import nats.errors
    from sqlalchemy.exc import SQLAlchemyError

    from gpuledger.audit_cmd import _key_text
    from libs.errors import GpuledgerError
    from libs.witness.node import origin_of
    from libs.witness.note import NoteError, Verifier

    if not (db and witness_key) and not recorder_dir:
        raise click.UsageError("give --recorder-dir (or both --db and --witness-key)")
    try:
        key = Verifier.parse(_key_text(witness_key or f"@{Path(recorder_dir) / 'witness.pub'}"))
    except (NoteError, OSError) as exc:
        raise click.ClickException(f"no usable witness key: {exc}") from exc
    url = db or f"sqlite:///{Path(recorder_dir) / 'fleet.sqlite'}"
    if not db and not (Path(recorder_dir) / "fleet.sqlite").exists():
        raise click.ClickException(f"no recorder database at {Path(recorder_dir) / 'fleet.sqlite'} (give --db)")
    try:
        report, skipped = asyncio.run(_restore(node, Path(state_dir), nats_url, fleet_credentials, url, key,
                                               origin_of(cluster_name, node)))
    except (GpuledgerError, SQLAlchemyError, nats.errors.Error) as exc:
        raise click.ClickException(str(exc) or type(exc).__name__) from exc
    if as_json:
        _json({**msgspec.to_builtins(report), "skipped": skipped})
        return
    print(f"restored {report.events} events of {node} into {report.path}: the first {report.witnessed_size} match the "
          f"checkpoint the witness cosigned for {report.origin}"
          + (f", {report.events - report.witnessed_size} after it are not witnessed yet" if
             report.events > report.witnessed_size else ""))
    if skipped:
        print(f"skipped {skipped} messages on {node}'s subjects that did not come from its own stream")


async def _restore(node: str, state_dir: Any, nats_url: str, credentials: str, db_url: str, key: Any,
                   origin: str) -> tuple[Any, int]:
    from gpuledger.log_cmd import configured_response_settings
    from libs.bus import Bus
    from libs.fleet.credentials import load_credentials, with_credentials
    from libs.fleet.naming import HUB_INBOX
    from libs.fleet.restore import read_node_records, restore_node
    from libs.fleet.witness_store import SqlWitnessStore

    creds = load_credentials(credentials) if credentials else None
    bus = await Bus.connect(with_credentials(nats_url, creds), name="fleet-restore", node="fleet", wait=10,
                            inbox_prefix=HUB_INBOX)
    try:
        copy = await read_node_records(bus.js, node)
    finally:
        await bus.close()
    with _engine(db_url, "") as engine:
        # The node's response settings as its allocator builds them from this environment (GPULEDGER_*):
        # compact grants in the copy are rebuilt byte for byte under them.
        candidates = configured_response_settings(Settings(node_name=node, state_dir=str(state_dir)))
        report = await asyncio.to_thread(restore_node, copy, SqlWitnessStore(engine, create=False), origin,
                                         state_dir, witness_key=key, response_settings=candidates)
    return report, copy.skipped
