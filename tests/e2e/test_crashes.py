"""Services as separate processes.

A killed allocator replays to the same state; a frozen one never hangs the kubelet.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.builders import gpu_pod
from tests.e2e.helpers import Node, snapshot_when_back

pytestmark = pytest.mark.slow


def _proc(node: Node, name: str):  # type: ignore[no-untyped-def]
    assert node.launcher is not None
    return next(c for c in node.launcher.children if c.name == name)


async def test_allocator_killed_and_restarted_replays_the_same_state(node_processes: Node) -> None:
    node = node_processes
    for i, spec in enumerate([("a", 50, 4), ("b", 100, 0), ("c", 20, 1)]):
        pod = await node.run_pod(gpu_pod(f"p{i}", spec))
        assert pod["status"]["phase"] == "Running", pod["status"]
    await node.sim.delete_pod("default", "p1")
    await node.tap.wait("alloc.released", 1)
    before = await node.snapshot()
    assert len(before.allocations) == 2

    allocator = _proc(node, "allocator")
    old_pid = allocator.proc.pid
    os.kill(old_pid, signal.SIGKILL)
    await allocator.proc.wait()
    after = await snapshot_when_back(node, timeout=30)
    assert allocator.proc.pid != old_pid  # the launcher restarted it
    assert after == before

    # It keeps working after the restart, and every event reached NATS exactly once.
    pod = await node.run_pod(gpu_pod("p3", ("d", 50, 2)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    granted = await node.tap.wait("alloc.granted", 4)
    seqs = [r.seq for r in node.tap.records]
    assert seqs == sorted(set(seqs)) == list(range(1, len(seqs) + 1))
    assert len(granted) == 4
    info = await node.bus.js.stream_info(node.bus.subjects.stream)
    assert info.state.messages == info.state.last_seq == seqs[-1]


async def test_a_frozen_allocator_fails_the_pod_in_bounded_time(node_processes: Node) -> None:
    node = node_processes
    allocator = _proc(node, "allocator")
    os.kill(allocator.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        pod = await node.run_pod(gpu_pod("stuck", ("c", 50, 2)), timeout=30)
        waited = time.monotonic() - started
    finally:
        os.kill(allocator.proc.pid, signal.SIGCONT)
    assert pod["status"]["phase"] == "Failed"
    assert pod["status"]["reason"] == "UnexpectedAdmissionError"
    assert "did not answer within 5s" in pod["status"]["message"]
    assert waited < node.settings.allocate_timeout + 3
    # Once it thaws, nothing was granted for the failed pod (its deadline had passed), and it works again.
    snap = await snapshot_when_back(node, timeout=30)
    assert all(a.pod_name != "stuck" for a in snap.allocations)
    pod = await node.run_pod(gpu_pod("fine", ("c", 50, 2)))
    assert pod["status"]["phase"] == "Running", pod["status"]
