"""Every committed event of every node reaches the one fleet stream, exactly once, in each node's order."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from pathlib import Path

from libs.events.subjects import Subjects
from libs.fleet.naming import FLEET_STREAM
from libs.fleet.stream import ensure_fleet_stream, remove_nodes, restart_sources
from libs.store.verify import verify_log
from services.fleet.app import service
from services.fleet.sources import RESTARTING_FILE
from tests.fleet.helpers import (
    HubCluster,
    fleet_count,
    per_node_seqs,
    read_fleet,
    recorder_settings,
    start_fleet_node,
)
from tests.polling import eventually


async def test_three_nodes_reach_the_fleet_stream_exactly_once_in_order(hub: HubCluster, short_dir: Path) -> None:
    nodes = [await start_fleet_node(hub, short_dir / f"n{i}", f"node-{i}.example.internal") for i in range(3)]
    bus = await hub.recorder_bus()
    try:
        info = await ensure_fleet_stream(bus.js, [n.name for n in nodes])
        assert info.config.num_replicas == 3
        for round_ in range(5):
            await asyncio.gather(*(n.ledger.grant(pod_name=f"p{round_}") for n in nodes))
        await nodes[1].ledger.release()
        want = sum(n.ledger.event_log.last_seq for n in nodes)  # type: ignore[union-attr]
        await eventually(lambda: _is(fleet_count(bus), want), timeout=30, interval=0.2, what=f"{want} fleet events")
        records = await read_fleet(bus)
        seqs = per_node_seqs(records)
        for n in nodes:
            assert seqs[n.name] == list(range(1, n.ledger.event_log.last_seq + 1))  # type: ignore[union-attr]
        # every event carries the node's row hash: the last one is the head of the node's chain
        for n in nodes:
            head = verify_log(n.ledger.log_path).head_hash
            mine = [h for s, _seq, h in records if s.split(".")[1] == n.ledger.bus.subjects.token]  # type: ignore[union-attr]
            assert all(len(h) == 64 for h in mine) and mine[-1] == head
        info = await bus.js.stream_info(FLEET_STREAM)
        assert info.state.messages == want
    finally:
        await bus.close()
        for n in nodes:
            await n.stop()


async def _is(count: object, want: int) -> bool:
    return await count == want  # type: ignore[misc]


async def test_a_restarted_source_resumes_after_the_last_event_the_stream_holds(
    hub: HubCluster, short_dir: Path
) -> None:
    """``restart_sources`` (the recorder's remedy for a source NATS left without a consumer) sources
    nothing twice; and a restart cut off between its two updates is finished by the next recorder."""
    nodes = [await start_fleet_node(hub, short_dir / f"n{i}", f"node-{i}") for i in range(2)]
    bus = await hub.recorder_bus()
    async with AsyncExitStack() as stack:
        stack.push_async_callback(bus.close)
        for n in nodes:
            stack.push_async_callback(n.stop)
        await ensure_fleet_stream(bus.js, [n.name for n in nodes])

        async def grants_arrive(rounds: int) -> None:
            for _ in range(rounds):
                await asyncio.gather(*(n.ledger.grant() for n in nodes))
            want = sum(n.ledger.event_log.last_seq for n in nodes)  # type: ignore[union-attr]
            await eventually(lambda: _is(fleet_count(bus), want), timeout=30, interval=0.2, what=f"{want} fleet events")

        await grants_arrive(5)
        await restart_sources(bus.js, {Subjects(nodes[0].name).stream})
        await grants_arrive(5)
        # a recorder died between the two updates: node-1's source is out, the intent names it
        rec = short_dir / "rec"
        rec.mkdir()
        (rec / RESTARTING_FILE).write_text(json.dumps([nodes[1].name]))
        await remove_nodes(bus.js, [nodes[1].name])
        for n in nodes:  # node-1's event waits in its own stream
            await n.ledger.grant()
        await stack.enter_async_context(service(recorder_settings(hub, rec)))
        await grants_arrive(3)
        assert not (rec / RESTARTING_FILE).exists()
        seqs = per_node_seqs(await read_fleet(bus))
        for n in nodes:
            assert seqs[n.name] == list(range(1, n.ledger.event_log.last_seq + 1))  # type: ignore[union-attr]
