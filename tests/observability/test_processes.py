"""The four services as separate processes with JSON logs: one Allocate's request id is in the log lines of
every service it touched, and each process serves its own /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from libs.bus.server import NatsServer
from libs.kube.pods import RESOURCE_VCORE
from tests.builders import gpu_pod, settings_for
from tests.e2e.helpers import Node, start_processes
from tests.observability.helpers import HEALTH, free_port_base, scrape, value
from tests.polling import eventually

pytestmark = pytest.mark.slow


@pytest.fixture
async def processes(nats_server: NatsServer, short_dir: Path) -> AsyncIterator[Node]:
    settings = settings_for(short_dir, nats_server.url, log_format="json", log_level="debug",
                            metrics_port=free_port_base(), metrics_host="127.0.0.1", **HEALTH)
    async with AsyncExitStack() as stack:
        yield await start_processes(stack, short_dir, nats_server.url, settings)


def _lines(log_dir: Path, service: str) -> list[dict[str, Any]]:
    out = []
    for raw in (log_dir / f"{service}.log").read_text().splitlines():
        if raw.startswith("{"):
            out.append(json.loads(raw))
    return out


async def test_one_request_id_across_the_four_services(processes: Node) -> None:
    node = processes
    pod = await node.run_pod(gpu_pod("traced", ("main", 40, 2)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    (alloc,) = (await node.snapshot()).allocations
    log_dir = node.launcher.log_dir  # type: ignore[union-attr]

    def lines_of(service: str, pred: Any) -> list[dict[str, Any]]:
        return [ln for ln in _lines(log_dir, service) if pred(ln)]

    async def logged(service: str, pred: Any) -> list[dict[str, Any]]:
        # A line may still be on its way to the file.
        return await eventually(lambda: lines_of(service, pred), timeout=10, interval=0.1,
                                what=f"the line in the {service} log")

    # Admission: the kubelet's Allocate through the registrar, the allocator and the vmanager share the
    # request id the registrar started.
    by_request = {s: await logged(s, lambda ln: ln.get("request_id") == alloc.request_id)
                  for s in ("registrar", "allocator", "vmanager")}
    assert all(by_request.values()), {s: len(v) for s, v in by_request.items()}
    for service, lines in by_request.items():
        assert {ln["service"] for ln in lines} == {service}
    registrar = next(ln for ln in by_request["registrar"] if ln["event"] == "allocated")
    assert (registrar["alloc_id"], registrar["pod"], registrar["container"]) == (
        alloc.alloc_id, "default/traced", "main")
    granted = next(ln for ln in by_request["allocator"] if ln["event"] == "granted")
    assert (granted["pod"], granted["container"]) == ("default/traced", "main")
    assert any(ln.get("pod_uid") == alloc.pod_uid and ln.get("alloc_id") == alloc.alloc_id
               for ln in by_request["vmanager"])

    # Each process serves its own /metrics.
    base = node.settings.metrics_port
    m = await asyncio.to_thread(scrape, base)
    assert value(m, "gpuledger_allocations", state="active") == 1
    r = await asyncio.to_thread(scrape, base + 1)
    assert value(r, "gpuledger_kubelet_request_duration_seconds_count", method="Allocate",
                 resource=RESOURCE_VCORE, outcome="ok") == 1
    assert value(await asyncio.to_thread(scrape, base + 2), "gpuledger_vmanager_pod_sockets") == 1
    assert value(await asyncio.to_thread(scrape, base + 3), "gpuledger_watchdog_pods", phase="Running") == 1

    # The status view over the allocator's HTTP endpoint.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpuledger", "status", "--url", f"http://127.0.0.1:{base}", env=os.environ,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, out.decode()
    text = out.decode()
    assert "default/traced:main" in text and "cores 60/100 free" in text

    # Recycling: the watchdog sees the pod go and asks for the release; its request id reaches the
    # allocator's line for the same allocation.
    await node.sim.delete_pod("default", "traced")
    (released,) = await logged(
        "watchdog", lambda ln: ln["event"] == "released" and alloc.alloc_id in ln.get("alloc_ids", ()))
    assert released["pod_uid"] == alloc.pod_uid and released.get("request_id")
    assert await logged("allocator", lambda ln: ln["event"] == "released"
                            and ln.get("request_id") == released["request_id"]
                            and ln.get("alloc_ids") == [alloc.alloc_id])
