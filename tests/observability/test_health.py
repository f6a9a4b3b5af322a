"""GPU health end to end with fake GPUs: injected XID/ECC events and failing probes mark a GPU unhealthy in
the log, the kubelet (simulator) sees its device IDs Unhealthy, placement avoids it, and it recovers."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import pytest

from gpuledger.inspect import replay_state
from libs.gpu.monitor import InjectReply, InjectRequest, inject_subject
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY
from tests.builders import NODE, gpu_pod
from tests.e2e.helpers import Node
from tests.observability.helpers import scrape, value


async def _inject(node: Node, **fields: Any) -> list[str]:
    reply = await node.bus.request(inject_subject(node.bus.subjects.prefix), InjectRequest(**fields), InjectReply,
                                   timeout=5)
    return reply.done


@pytest.mark.parametrize("obs_overrides", [{"health_recovery_seconds": 3.0}])
async def test_xid_marks_unhealthy_placement_avoids_it_and_it_recovers(obs_node: Node) -> None:
    node = obs_node
    await _inject(node, gpu=1, xid=13)  # an application error: says nothing about the GPU
    await _inject(node, gpu=1, xid=79)  # fallen off the bus
    (rec,) = await node.tap.wait("gpu.health", 1)
    # Keep it unhealthy while we place (a failing probe also stops recovery); well inside the 3 s.
    await _inject(node, gpu=1, probe_error="GPU is lost")
    assert rec.data["index"] == 1 and rec.data["healthy"] is False
    assert (rec.data["reason"], rec.data["xid"]) == ("xid", 79)
    snap = await node.snapshot()
    assert [g.healthy for g in snap.gpus] == [True, False, True, True]
    assert snap.gpus[1].health_reason == "xid 79"

    # The kubelet sees GPU 1's slice of IDs Unhealthy: allocatable drops by one GPU.
    await node.sim.wait_for_resource(RESOURCE_VCORE, 300, timeout=10)
    await node.sim.wait_for_resource(RESOURCE_VMEMORY, 192, timeout=10)

    placed = []
    for i in range(3):
        pod = await node.run_pod(gpu_pod(f"whole-{i}", ("main", 100, 0)))
        assert pod["status"]["phase"] == "Running", pod["status"]
    for alloc in (await node.snapshot()).allocations:
        placed += [s.index for s in alloc.shares]
    assert sorted(placed) == [0, 2, 3]
    assert len(node.tap.of("gpu.health")) == 1  # the probe failure on an unhealthy GPU is no new transition

    m = await asyncio.to_thread(scrape, node.settings.metrics_port)
    assert value(m, "gpuledger_gpu_healthy", gpu="1") == 0
    r = await asyncio.to_thread(scrape, node.settings.metrics_port + 1)
    assert value(r, "gpuledger_advertised_devices", resource=RESOURCE_VCORE, health="Unhealthy") == 100

    # Recovery: probes pass again; after the quiet period and two clean probes the GPU is back.
    await _inject(node, gpu=1, probe_error="")
    recs = await node.tap.wait("gpu.health", 2, timeout=20)
    assert recs[1].data["index"] == 1 and recs[1].data["healthy"] is True
    assert recs[1].data["reason"] == "recovered"
    await node.sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=10)
    pod = await node.run_pod(gpu_pod("after", ("main", 100, 0)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    last = max((await node.snapshot()).allocations, key=lambda a: a.granted_seq)
    assert [s.index for s in last.shares] == [1]


@pytest.mark.parametrize("obs_overrides", [{"health_recovery_seconds": 600.0}])  # nothing recovers here
async def test_probe_failure_and_ecc_are_in_the_log_and_the_cli(obs_node: Node) -> None:
    node = obs_node
    await _inject(node, gpu=0, ecc="single-bit")  # corrected: reported, not critical
    await _inject(node, gpu=2, probe_error="GPU is lost")
    (rec,) = await node.tap.wait("gpu.health", 1)
    assert (rec.data["index"], rec.data["reason"], rec.data["detail"]) == (2, "query-failed", "GPU is lost")
    await _inject(node, gpu=3, ecc="double-bit")
    recs = await node.tap.wait("gpu.health", 2)
    assert (recs[1].data["index"], recs[1].data["reason"]) == (3, "ecc-double-bit")

    # The CLI: inject an XID on GPU 0 the way an operator would, then look at the status view.
    env = {**os.environ, "GPULEDGER_NATS_URL": node.settings.nats_url, "GPULEDGER_NODE_NAME": NODE}
    out = await _cli(env, "gpu", "inject-xid", "0", "48")
    assert "injected: XID 48 on GPU 0" in out
    await node.tap.wait("gpu.health", 3)
    out = await _cli(env, "status")
    lines = {line.split("(")[0].strip(" ├└─│"): line for line in out.splitlines() if "GPU" in line and "(" in line}
    assert "UNHEALTHY (xid 48)" in lines["GPU0"]
    assert "UNHEALTHY (query-failed)" in lines["GPU2"]
    assert "UNHEALTHY (ecc-double-bit)" in lines["GPU3"]
    assert "UNHEALTHY" not in lines["GPU1"]
    bad = await _cli(env, "gpu", "inject-xid", "9", "79", code=1)
    assert "no GPU 9 on this node" in bad

    # The transitions are in the log: a replay of the SQLite file folds the same health.
    await node.services["allocator"].relay.wait_published((await node.snapshot()).seq, timeout=10)
    replayed = await asyncio.to_thread(replay_state, node.settings.log_path)
    assert [g.healthy for g in replayed.gpus] == [False, True, False, False]


async def _cli(env: dict[str, str], *args: str, code: int = 0) -> str:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gpuledger", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == code, out.decode()
    return out.decode()
