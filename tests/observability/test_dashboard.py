"""Every metric the Grafana dashboard queries is exported by a running node (scraped over HTTP)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from libs.gpu.monitor import InjectReply, InjectRequest, ProcessSample, inject_subject
from tests.builders import gpu_pod
from tests.e2e.helpers import Node
from tests.observability.helpers import scrape
from tests.polling import eventually

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "gpuledger-dashboard.json"
_NAME = re.compile(r"\b((?:gpuledger|container|process)_[a-z0-9_]+)")


def dashboard_metrics() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dash["templating"]["list"] if v.get("type") == "query"]
    return {m for e in exprs for m in _NAME.findall(e)}


def test_the_dashboard_queries_metrics() -> None:
    names = dashboard_metrics()
    assert len(names) >= 20
    assert {"container_gpu_utilization", "container_request_gpu_memory",
            "gpuledger_allocate_duration_seconds_bucket", "gpuledger_gpu_healthy"} <= names


async def test_every_dashboard_metric_is_exported(obs_node: Node) -> None:
    node, base = obs_node, obs_node.settings.metrics_port
    pod = await node.run_pod(gpu_pod("dash", ("main", 50, 4)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    (alloc,) = (await node.snapshot()).allocations
    cid = next(s for s in node.sim.get_pod("default", "dash")["status"]["containerStatuses"])["containerID"]
    proc = ProcessSample(pid=1, sm_util=5, memory=1 << 20, container_id=cid.split("://", 1)[1])
    await node.bus.request(inject_subject(node.bus.subjects.prefix),
                           InjectRequest(gpu=alloc.shares[0].index, processes=[proc]), InjectReply, timeout=5)

    async def exported_with_usage() -> set[str] | None:
        exported: set[str] = set()
        for port in range(base, base + 4):
            exported |= set(await asyncio.to_thread(scrape, port))
        return exported if "container_gpu_utilization" in exported else None

    exported = await eventually(exported_with_usage, timeout=20, interval=0.2,
                                what="container_gpu_utilization among the exported metrics")
    missing = dashboard_metrics() - exported
    assert not missing, f"the dashboard queries metrics nobody exports: {sorted(missing)}"
