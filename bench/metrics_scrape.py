"""Cost of one scrape of the allocator's /metrics, by number of active allocations, next to a floor.

The allocator's collector reads the folded state in memory (NVML is sampled in the background, never on
a scrape), so a scrape should cost little more than the HTTP exchange itself. Measured in one run:
- floor: a scrape over HTTP of a registry holding one counter (the services' endpoint,
  libs/http_endpoint.py, and an aiohttp client on the same loop; the client asks for gzip, as Prometheus does);
- scrape: the same server with the allocator's collector over a state with N active allocations on an
  8-GPU node (each allocation also with a usage sample, so every gpu-manager container metric is out);
- loop held: the part of a scrape that runs on the allocator's event loop (collection; the text is
  formatted and compressed in the server's thread), i.e. how long a scrape can delay an Allocate.

    python -m bench.metrics_scrape [--allocations 0,100,1000] [--scrapes 300]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
import uuid
from types import SimpleNamespace

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from libs.events.codec import StoredEvent
from libs.events.schema import AllocationGranted, ContainerResponse, GpuInfo, GpuShare, InventoryRecorded
from libs.ledger.state import LedgerState
from libs.metrics import MetricsServer
from services.allocator.metrics import AllocatorCollector, CommitTimes

GPUS = 8
GIB = 1 << 30


def _state(n: int) -> LedgerState:
    state = LedgerState()
    gpus = tuple(GpuInfo(index=i, minor=i, uuid=f"GPU-{i:08d}", memory=80 * GIB) for i in range(GPUS))
    events = [InventoryRecorded(node="bench", backend="fake", gpus=gpus)]
    for k in range(n):
        g = k % GPUS
        events.append(AllocationGranted(
            alloc_id=uuid.uuid4().hex, request_id=uuid.uuid4().hex, pod_uid=str(uuid.uuid4()), namespace="ns",
            pod_name=f"pod-{k}", container="main", container_index=0, cores=1, memory=1 << 20,
            device_ids=(f"tencent.com/vcuda-core-{k}",), shares=(GpuShare(index=g, uuid=f"GPU-{g:08d}", minor=g,
                                                                         cores=1, memory=1 << 20),),
            response=ContainerResponse()))
    for seq, ev in enumerate(events, 1):
        state.apply(StoredEvent(seq=seq, recorded_at=seq, stream_id="s", version=1, event_id=uuid.uuid4().hex,
                                event=ev))
    return state


def _registry(n: int) -> CollectorRegistry:
    state = _state(n)
    usage = SimpleNamespace(gpus=(), sampled_at=0.0, containers={}, names={})
    for a in state.allocations.values():
        usage.containers[(a.pod_uid, a.container)] = {a.shares[0].index: (12.5, 1 << 20, (1,))}
        usage.names[(a.pod_uid, a.container)] = (a.namespace, a.pod_name)
    registry = CollectorRegistry()
    log = SimpleNamespace(last_seq=state.seq, on_commit=lambda cb: None)
    registry.register(AllocatorCollector("bench", state, log, SimpleNamespace(published=state.seq),  # type: ignore[arg-type]
                                         CommitTimes(log), usage))  # type: ignore[arg-type]
    return registry


async def _scrapes(registry: CollectorRegistry, count: int) -> tuple[list[float], int]:
    server = MetricsServer("bench", registry, host="127.0.0.1", port=0)
    server.port = _free_port()
    assert await server.start()
    times = []
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(count + 20):
                start = time.perf_counter()
                async with session.get(f"http://127.0.0.1:{server.port}/metrics") as resp:
                    body = await resp.read()
                if i >= 20:  # warm-up
                    times.append(time.perf_counter() - start)
    finally:
        await server.stop()
    return times, len(body)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ms(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if q < 100 else max(values) * 1000


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--allocations", default="0,100,1000")
    parser.add_argument("--scrapes", type=int, default=300)
    args = parser.parse_args()
    print(f"python {platform.python_version()}, {platform.machine()}, {args.scrapes} scrapes each")
    floor_registry = CollectorRegistry()
    Counter("bench_floor", "one counter", registry=floor_registry).inc()
    floor, size = await _scrapes(floor_registry, args.scrapes)
    print(f"floor (one counter)      p50 {_ms(floor, 50):6.2f} ms  p99 {_ms(floor, 99):6.2f} ms  {size:>8} bytes")
    for n in (int(x) for x in args.allocations.split(",")):
        registry = _registry(n)
        times, size = await _scrapes(registry, args.scrapes)
        held = []  # the part of a scrape that runs on the event loop (collection; formatting is in the server's thread)
        for _ in range(min(args.scrapes, 100)):
            start = time.perf_counter()
            list(registry.collect())
            held.append(time.perf_counter() - start)
        print(f"allocator, {n:>5} allocs  p50 {_ms(times, 50):6.2f} ms  p99 {_ms(times, 99):6.2f} ms  {size:>8} bytes"
              f"  ({_ms(times, 50) / _ms(floor, 50):.1f}x floor)  loop held p50 {_ms(held, 50):.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())
