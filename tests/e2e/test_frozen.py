"""Issue 13, item 4: frozen, not dead.

The broker or the allocator stopped with SIGSTOP for ``FREEZE_S`` seconds (a few here; 30 in the
issue's wording: ``GPULEDGER_FREEZE_S=30`` runs that) and then continued costs failed Allocates while
it is frozen, each with a clear error in bounded time, and nothing else: nothing granted for a pod
the kubelet failed, no double grant, no lost event (the node's stream equals the log, each event
once), a pod deleted meanwhile released after the thaw, and the next pod admitted at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import pytest

from libs.bus.server import NatsServer
from libs.errors import BusError
from libs.ledger.state import LedgerSnapshot
from libs.store.replay import iter_events, open_reader
from tests.builders import gpu_pod, settings_for
from tests.e2e.helpers import Node, start_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FREEZE_S = float(os.environ.get("GPULEDGER_FREEZE_S", "4"))
ALLOCATE_TIMEOUT_S = 2.0  # the registrar's bound on one Allocate, shorter than the freeze


@pytest.fixture
async def node(nats_server: NatsServer, short_dir: Path) -> AsyncIterator[Node]:
    settings = msgspec.structs.replace(settings_for(short_dir, nats_server.url, log_format="json"),
                                       allocate_timeout=ALLOCATE_TIMEOUT_S, request_timeout=1.0)
    async with AsyncExitStack() as stack:
        node = await start_processes(stack, short_dir, nats_server.url, settings)
        node.services["nats"] = nats_server
        yield node


def _pid(node: Node, name: str) -> int:
    if name == "broker":
        pid = node.services["nats"].pid
        assert pid is not None
        return int(pid)
    assert node.launcher is not None
    return next(c.pid for c in node.launcher.children if c.name == name)


async def _snapshot_when_back(node: Node, timeout: float = 30) -> LedgerSnapshot:
    async with asyncio.timeout(timeout):
        while True:
            try:
                return await node.snapshot()
            except BusError:
                await asyncio.sleep(0.2)


def _log_seq(node: Node) -> int:
    conn = open_reader(node.settings.log_path)
    try:
        return max((e.seq for e in iter_events(conn)), default=0)
    finally:
        conn.close()


@pytest.mark.parametrize("frozen", ["broker", "allocator"])
async def test_a_frozen_process_costs_failed_allocates_and_nothing_else(node: Node, frozen: str) -> None:
    before = await node.run_pod(gpu_pod("before", ("c", 50, 2)))
    assert before["status"]["phase"] == "Running", before["status"]
    pid = _pid(node, frozen)
    os.kill(pid, signal.SIGSTOP)
    thawed_at = time.monotonic() + FREEZE_S
    try:
        # A pod deleted while frozen: its release waits for the thaw.
        await node.sim.delete_pod("default", "before")
        # Allocates fail, each with a clear error, in bounded time, as long as the freeze lasts.
        failed = 0
        while time.monotonic() + ALLOCATE_TIMEOUT_S + 1 < thawed_at or not failed:
            started = time.monotonic()
            pod = await node.run_pod(gpu_pod(f"frozen-{failed}", ("c", 20, 1)), timeout=ALLOCATE_TIMEOUT_S + 10)
            assert pod["status"]["phase"] == "Failed", pod["status"]
            assert time.monotonic() - started < ALLOCATE_TIMEOUT_S + 3, pod["status"]
            message = pod["status"]["message"]
            assert "allocator did not answer within" in message or "cannot reach the allocator" in message, message
            failed += 1
        await asyncio.sleep(max(0.0, thawed_at - time.monotonic()))
    finally:
        os.kill(pid, signal.SIGCONT)

    # Not stuck: the next pod is admitted and runs, without waiting for any period.
    started = time.monotonic()
    after = await node.run_pod(gpu_pod("after", ("c", 30, 2)), timeout=30)
    assert after["status"]["phase"] == "Running", after["status"]
    assert time.monotonic() - started < 10

    # The deleted pod's grant is released; none of the failed pods holds anything; no double grant.
    async with asyncio.timeout(15):
        snap = await _snapshot_when_back(node)
        while {a.pod_name for a in snap.allocations} != {"after"}:
            await asyncio.sleep(0.1)
            snap = await _snapshot_when_back(node)
    assert len(snap.allocations) == 1
    assert all(g.cores_used <= 100 and g.memory_used <= g.memory_total for g in snap.gpus)

    # No lost event: every event of the log reached the node's stream, once and in order.
    last = _log_seq(node)
    assert last == snap.seq
    async with asyncio.timeout(15), node.tap.arrived:
        await node.tap.arrived.wait_for(lambda: bool(node.tap.records) and node.tap.records[-1].seq >= last)
    seqs = [r.seq for r in node.tap.records]
    assert seqs == list(range(1, last + 1))
    info = await node.bus.js.stream_info(node.bus.subjects.stream)
    assert info.state.messages == info.state.last_seq == last
    granted = [r for r in node.tap.records if r.type == "alloc.granted"]
    assert [r.data["pod_name"] for r in granted] == ["before", "after"], "a frozen pod was granted"
