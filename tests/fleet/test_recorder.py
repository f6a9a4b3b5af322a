"""The fleet recorder: the fleet stream into SQL, exactly once across restarts; ``fleet at T`` equals the
union of every node's own ``replay --at T``; history and utilization queries; forged events refused."""

from __future__ import annotations

import asyncio
import io
import json
import time
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
from click.testing import CliRunner
from sqlalchemy import func, select

from gpuledger.cli import main
from gpuledger.inspect import audit_view, print_snapshot
from libs.config import Settings
from libs.events.codec import format_time, parse_time
from libs.fleet.queries import fleet_at, history, utilization
from libs.fleet.stream import ensure_fleet_stream
from libs.fleet.tables import fleet_events
from libs.ledger.holdings import audit_replay
from services.fleet.app import FleetService, open_engine, service
from tests.fleet.helpers import FleetNode, HubCluster, PostgresServer, start_fleet_node
from tests.polling import eventually


def recorder_settings(hub: HubCluster, root: Path, db: str) -> Settings:
    return Settings(node_name="fleet-recorder", state_dir=str(root), nats_url=hub.client_urls(), fleet_db=db,
                    metrics_port=0)


def union_of_replays(nodes: list[FleetNode], at: int) -> dict[str, list[bytes]]:
    out = {}
    for n in nodes:
        view = audit_replay(n.ledger.log_path, upto_time=at)
        if view.allocations:
            out[n.name] = sorted(msgspec.json.encode(h) for h in view.allocations)
    return out


def fleet_view(engine: object, at: int) -> dict[str, list[bytes]]:
    return {s.node: sorted(msgspec.json.encode(h) for h in s.allocations) for s in fleet_at(engine, at)}  # type: ignore[arg-type]


async def recorded(svc: FleetService, nodes: list[FleetNode]) -> bool:
    want = {n.name: n.ledger.event_log.last_seq for n in nodes}  # type: ignore[union-attr]
    stored = svc.projection.last_seqs()  # committed: what the queries below read
    return all(stored.get(k) == v for k, v in want.items())


async def test_fleet_at_t_is_the_union_of_every_nodes_replay(hub: HubCluster, short_dir: Path) -> None:
    await check_fleet_at_t(hub, short_dir, f"sqlite:///{short_dir / 'fleet.sqlite'}")


async def test_the_recorder_on_postgresql(hub: HubCluster, short_dir: Path, postgres: PostgresServer) -> None:
    await check_fleet_at_t(hub, short_dir, postgres.url)


async def check_fleet_at_t(hub: HubCluster, short_dir: Path, fleet_db: str) -> None:
    nodes = [await start_fleet_node(hub, short_dir / f"n{i}", f"gpu-{i}", model=("A100" if i < 2 else "H100"))
             for i in range(3)]
    settings = recorder_settings(hub, short_dir / "rec", fleet_db)
    (short_dir / "rec").mkdir()
    bus = await hub.recorder_bus()
    marks: list[int] = []
    async with AsyncExitStack() as stack:
        stack.push_async_callback(bus.close)
        for n in nodes:
            stack.push_async_callback(n.stop)
        await ensure_fleet_stream(bus.js, [n.name for n in nodes])
        svc = await stack.enter_async_context(service(settings, source_interval=0.5))
        for step in range(6):
            for i, n in enumerate(nodes):
                await n.ledger.grant(namespace=f"team-{i % 2}", pod_name=f"job-{step}-{i}", cores=10 * (i + 1),
                                     gpu=step % 2)
                if step % 2 and n.ledger.live:
                    await n.ledger.release()
            marks.append(time.time_ns())
            await asyncio.sleep(0.01)
        await eventually(lambda: recorded(svc, nodes), timeout=30, interval=0.2, what="every event recorded")
        engine = svc.projection.engine
        for at in (marks[0], marks[2], marks[-1], time.time_ns()):
            assert fleet_view(engine, at) == union_of_replays(nodes, at)
        # the same through the commands: `gpuledger fleet at T --json` against each node's `replay --at T --json`
        when = format_time(marks[3])
        fleet_out = CliRunner().invoke(main, ["fleet", "at", when, "--json", "--db", settings.fleet_db_url])
        assert fleet_out.exit_code == 0, fleet_out.output
        from_fleet = {s["node"]: sorted(map(repr, s["allocations"])) for s in json.loads(fleet_out.output)}
        from_nodes = {}
        for n in nodes:  # what `replay --at T --json` prints (print_snapshot binds sys.stdout: call it here)
            out = io.StringIO()
            print_snapshot(audit_view(n.ledger.log_path, at=parse_time(when)), as_json=True, out=out)
            if allocations := json.loads(out.getvalue())["allocations"]:
                from_nodes[n.name] = sorted(map(repr, allocations))
        assert from_fleet == from_nodes and len(from_fleet) == 3
        # history by pod, namespace, node, GPU
        rows = history(engine, pod="job-1-2")
        assert len(rows) == 1 and rows[0].valid_to is not None and rows[0].node == "gpu-2"  # granted, then released
        assert {r.holding.namespace for r in history(engine, namespace="team-1")} == {"team-1"}
        assert {r.node for r in history(engine, node="gpu-0")} == {"gpu-0"}
        assert {s.uuid for r in history(engine, gpu="GPU-gpu-1-1") for s in r.holding.shares} == {"GPU-gpu-1-1"}
        use = utilization(engine, marks[0] - 10**9, time.time_ns())
        assert {(u.node, u.model) for u in use} == {("gpu-0", "A100"), ("gpu-1", "A100"), ("gpu-2", "H100")}
        assert all(0 < u.utilization < 1 for u in use)
    # a restarted recorder refolds, receives everything again or not, and stores each event once
    settings_again = settings
    async with AsyncExitStack() as stack:
        bus = await hub.recorder_bus()
        stack.push_async_callback(bus.close)
        svc = await stack.enter_async_context(service(settings_again, source_interval=0.5))
        assert set(svc.projection.folds) == {n.name for n in nodes}
        engine = open_engine(settings.fleet_db_url)
        stack.callback(engine.dispose)  # no session left open on the server
        with engine.connect() as conn:
            total = conn.execute(select(func.count()).select_from(fleet_events)).scalar_one()
        assert total == sum(n.ledger.event_log.last_seq for n in nodes)  # type: ignore[union-attr]
