"""Every service's /metrics over real HTTP, parsed with the Prometheus text parser, on a running node."""

from __future__ import annotations

import asyncio
import json
import time

from libs.gpu.monitor import InjectReply, InjectRequest, ProcessSample, inject_subject
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY
from tests.builders import NODE, gpu_pod
from tests.e2e.helpers import Node
from tests.observability.helpers import http_get, scrape, scraped, value
from tests.polling import eventually

MIB = 1 << 20


async def _scrape(port: int) -> dict:
    return await asyncio.to_thread(scrape, port)


def _container_id(node: Node, name: str, container: str) -> str:
    pod = node.sim.get_pod("default", name)
    assert pod is not None
    status = next(s for s in pod["status"]["containerStatuses"] if s["name"] == container)
    return status["containerID"].split("://", 1)[1]


async def test_allocator_metrics_follow_an_allocation(obs_node: Node) -> None:
    node, base = obs_node, obs_node.settings.metrics_port
    pod = await node.run_pod(gpu_pod("train", ("main", 50, 4)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    snap = await node.snapshot()
    (alloc,) = snap.allocations
    gpu = alloc.shares[0].index
    total = next(g.memory_total for g in snap.gpus if g.index == gpu)

    m = await eventually(lambda: scraped(base, lambda s: value(s, "gpuledger_log_publication_lag_events") == 0),
                         timeout=15, interval=0.2, what="no publication lag on the allocator's /metrics")
    assert value(m, "gpuledger_gpu_cores_allocated", gpu=str(gpu)) == 50
    assert value(m, "gpuledger_gpu_cores_free", gpu=str(gpu)) == 50
    assert value(m, "gpuledger_gpu_memory_allocated_bytes", gpu=str(gpu)) == 4 * 256 * MIB
    assert value(m, "gpuledger_gpu_memory_free_bytes", gpu=str(gpu)) == total - 4 * 256 * MIB
    for other in (g.index for g in snap.gpus if g.index != gpu):
        assert value(m, "gpuledger_gpu_cores_free", gpu=str(other)) == 100
    assert {s.labels["uuid"] for s in m["gpuledger_gpu_healthy"]} == {g.uuid for g in snap.gpus}
    assert all(s.value == 1 for s in m["gpuledger_gpu_healthy"])
    assert value(m, "gpuledger_allocations", state="active") == 1
    assert value(m, "gpuledger_allocations", state="released") == 0
    assert value(m, "gpuledger_allocate_duration_seconds_count", outcome="granted") == 1
    assert value(m, "gpuledger_log_append_duration_seconds_count") >= 1
    # The per-hop breakdown of the grant, allocator side (each hop observed once, with a real time).
    for hop in ("decide", "append_fsync", "confirm", "reply"):
        assert value(m, "gpuledger_allocate_hop_duration_seconds_count", hop=hop) == 1
        # confirm is 0 when the kubelet's List had answered before the append was over
        assert value(m, "gpuledger_allocate_hop_duration_seconds_sum", hop=hop) > 0 or hop == "confirm"
    assert value(m, "gpuledger_log_last_seq") == snap.seq
    assert value(m, "gpuledger_log_published_seq") == snap.seq
    assert value(m, "gpuledger_log_publication_lag_seconds") == 0

    # gpu-manager's request metrics, with gpu-manager's labels.
    labels = {"pod_name": "train", "namespace": "default", "node": NODE, "container_name": "main"}
    assert value(m, "container_request_gpu_utilization", req_of_gpu="total", **labels) == 0.5
    assert value(m, "container_request_gpu_memory", req_of_gpu_memory="total", **labels) == 1024

    # Usage: a process of the pod's container appears on its GPU; the background sample maps it.
    cid = _container_id(node, "train", "main")
    proc = ProcessSample(pid=4242, sm_util=37.5, memory=512 * MIB, container_id=cid)
    stranger = ProcessSample(pid=4343, sm_util=10.0, memory=256 * MIB, container_id="f" * 64)
    await node.bus.request(inject_subject(node.bus.subjects.prefix), InjectRequest(gpu=gpu, processes=[proc, stranger]),
                           InjectReply, timeout=5)
    m = await eventually(lambda: scraped(base, lambda s: "container_gpu_utilization" in s),
                         timeout=15, interval=0.2, what="container_gpu_utilization on the allocator's /metrics")
    assert value(m, "container_gpu_utilization", gpu=f"gpu{gpu}", **labels) == 37.5
    assert value(m, "container_gpu_utilization", gpu="total", **labels) == 37.5
    assert value(m, "container_gpu_memory_total", gpu_memory=f"gpu{gpu}", **labels) == 512
    assert value(m, "container_gpu_memory_total", gpu_memory="total", **labels) == 512
    assert len(m["container_gpu_utilization"]) == 2  # the unknown container is not exported
    assert value(m, "gpuledger_gpu_utilization_percent", gpu=str(gpu)) == 47.5
    assert value(m, "gpuledger_gpu_memory_used_bytes", gpu=str(gpu)) == 768 * MIB
    assert value(m, "gpuledger_usage_sample_timestamp_seconds") > time.time() - 60

    # gpu-manager's scrape path answers too.
    content_type, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{base}/metric")
    assert content_type.startswith("text/plain") and "container_request_gpu_utilization" in text

    # The other three services, each on its own port.
    r = await _scrape(base + 1)
    assert value(r, "gpuledger_advertised_devices", resource=RESOURCE_VCORE, health="Healthy") == 400
    assert value(r, "gpuledger_advertised_devices", resource=RESOURCE_VCORE, health="Unhealthy") == 0
    assert value(r, "gpuledger_advertised_devices", resource=RESOURCE_VMEMORY, health="Healthy") == 256
    assert value(r, "gpuledger_kubelet_request_duration_seconds_count", method="Allocate",
                 resource=RESOURCE_VCORE, outcome="ok") == 1
    # The grant was checked with the kubelet's List, asked at its Allocate (none failed).
    assert value(r, "gpuledger_registrar_kubelet_lists_total", outcome="answered") == 1
    assert value(r, "gpuledger_registrar_kubelet_lists_total", outcome="failed") == 0
    for hop in ("registrar_total", "bus_round_trip"):  # registrar side of the breakdown
        assert value(r, "gpuledger_allocate_hop_duration_seconds_count", hop=hop) == 1
    assert (value(r, "gpuledger_allocate_hop_duration_seconds_sum", hop="registrar_total")
            >= value(r, "gpuledger_allocate_hop_duration_seconds_sum", hop="bus_round_trip") > 0)
    v = await eventually(lambda: scraped(base + 2, lambda s: value(s, "gpuledger_vmanager_followed_seq") >= snap.seq),
                         timeout=15, interval=0.2, what=f"the vmanager's /metrics following seq {snap.seq}")
    assert value(v, "gpuledger_vmanager_pod_sockets") == 1
    assert value(v, "gpuledger_vmanager_caught_up") == 1
    w = await _scrape(base + 3)
    assert value(w, "gpuledger_watchdog_pods", phase="Running") == 1
    assert value(w, "gpuledger_watchdog_synced") == 1
    for port in range(base, base + 4):
        assert "process_cpu_seconds_total" in await _scrape(port)


async def test_status_routes(obs_node: Node) -> None:
    node, base = obs_node, obs_node.settings.metrics_port
    pod = await node.run_pod(gpu_pod("infer", ("a", 30, 2)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    (alloc,) = (await node.snapshot()).allocations

    _, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{base}/graph")
    graph = json.loads(body)
    assert "default/infer:a" in graph["graph"]
    assert f"GPU{alloc.shares[0].index} (" in graph["graph"]
    assert graph["tree"]["kind"] == "ROOT" and graph["tree"]["gpus"] == [0, 1, 2, 3]
    held = next(g for g in graph["gpus"] if g["index"] == alloc.shares[0].index)
    assert held["cores_free"] == 70 and held["allocations"] == [alloc.alloc_id] and held["healthy"] is True

    _, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{base}/usage")
    usage = json.loads(body)["usage"]
    entry = usage[alloc.pod_uid]
    assert entry["project"] == "default"
    assert entry["spec"]["a"] == {"gpu": 0.3, "mem": 512.0}
    (dev,) = entry["stat"]["a"]["dev"]
    assert dev["card_idx"] == str(alloc.shares[0].index) and dev["device_mem"] == 16384

    _, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{base}/version")
    assert json.loads(body)["version"]
