"""The allocator's own CPU per Allocate and per release, in one process, one request at a time.

A diagnostic beside the goal benchmark (bench/allocate_rtt.py), not a goal figure. Under load, the
loaded Allocate follows the allocator's CPU per Allocate (docs/benchmarks.md, twenty-eighth round), but
that figure (the ratio to the bare plugin) moves by about 0.3 from run to run, and a change of a few
percent in the allocator does not show in it. Here the allocator's real handlers run against a real
nats-server, a real SQLite log with ``synchronous=FULL`` (each append fsynced) and the services'
logging (JSON lines to a file). The pod cache holds each pod, as a watchdog notification would, so no
request waits on another process. CPU is the loop thread's (``time.thread_time``), which includes the
kernel's share of the append's ``fdatasync``. One grant is an Allocate as the registrar sends it
(``check_admission``: the registrar checks the grant with its own List), then its reply's
bookkeeping, then the pod's release.

Run alone in a loop, this code is two to three times faster than in place among the other
processes (the twenty-sixth round). So this figure is for comparing two versions of the allocator on
one machine, not for predicting a latency.

    python -m bench.allocator_cpu [--allocates 3000] [--warmup 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from bench.allocate_rtt import percentile
from bench.machine import describe
from libs.bus.client import Bus
from libs.bus.server import NatsServer
from libs.commands import AllocateRequest, ReleaseRequest
from libs.config import Settings
from libs.gpu.backends import load_inventory
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY, Container, ObjectMeta, Pod, PodSpec, Resources
from libs.ledger.snapshot import load_state
from libs.logger import configure_logging
from libs.placement.recorded import ResponseSettings
from libs.store.log import EventLog
from services.allocator.extraconfig import default_devices
from services.allocator.handlers import Allocator
from services.allocator.inventory import record_inventory
from services.allocator.ledger import Ledger
from services.allocator.metrics import AllocatorMetrics
from services.allocator.podcache import PodCache

NODE = "bench-node"
CORES = 10  # a pod of bench.allocate_rtt: 10 vcuda-core, 1 vcuda-memory block


def _pod(i: int) -> Pod:
    return Pod(metadata=ObjectMeta(name=f"bench-{i}", namespace="default", uid=str(uuid.uuid4()),
                                   creation_timestamp="2026-12-01T00:00:00Z"),
               spec=PodSpec(node_name=NODE, containers=[Container(name="c", resources=Resources(
                   limits={RESOURCE_VCORE: str(CORES), RESOURCE_VMEMORY: "1"}))]))


async def run(allocates: int, warmup: int, workdir: Path) -> dict[str, object]:
    nats = NatsServer(workdir / "nats")
    await nats.start()
    try:
        settings = Settings(node_name=NODE, state_dir=str(workdir / "state"), gpus="fake", nats_url=nats.url)
        recorded = ResponseSettings.for_node(settings, default_devices(settings.extra_config))
        events = await EventLog.open(settings.log_path, response_settings=recorded, inline=True)
        bus = await Bus.connect(nats.url, name="allocator", node=NODE)
        try:
            metrics = AllocatorMetrics()
            ledger = Ledger(events, load_state(settings.log_path).state, observer=metrics)
            await record_inventory(ledger, NODE, load_inventory("fake"))
            cache = PodCache(bus)
            allocator = Allocator(settings, ledger, bus, pod_cache=cache, observer=metrics, responses=recorded)
            capacity = 100 * len(ledger.state.gpus)
            grant_cpu, reply_cpu, release_cpu, grant_wall = [], [], [], []
            for i in range(allocates + warmup):
                pod = _pod(i)
                cache.pods[pod.uid] = pod
                req = AllocateRequest(
                    request_id=uuid.uuid4().hex, resource=RESOURCE_VCORE, check_admission=True,
                    device_ids=[f"{RESOURCE_VCORE}-{(i * CORES + k) % capacity}" for k in range(CORES)])
                cpu, wall = time.thread_time(), time.perf_counter()
                reply = await allocator._observed_allocate(req)
                allocator._replied(req)  # what the bus does once the reply is out
                answered = time.thread_time()
                await asyncio.sleep(0)  # the grant's work left for after the reply
                granted, granted_wall = time.thread_time(), time.perf_counter()
                if reply.pod_uid != pod.uid:
                    raise RuntimeError(f"the grant went to {reply.pod_uid}, not {pod.uid}")
                del cache.pods[pod.uid]
                released = await allocator.release(ReleaseRequest(pod_uid=pod.uid, reason="deleted"))
                if not released.released:
                    raise RuntimeError(f"pod {pod.uid} released nothing")
                if i >= warmup:
                    grant_cpu.append(granted - cpu)
                    reply_cpu.append(answered - cpu)
                    grant_wall.append(granted_wall - wall)
                    release_cpu.append(time.thread_time() - granted)
                if (i + 1) % 1000 == 0:
                    print(f"  {i + 1} of {allocates + warmup}", flush=True)
            await allocator.close()
        finally:
            await bus.close()
            await events.close()
    finally:
        await nats.stop()
    return {"allocates": allocates, "allocate_cpu": _summary(grant_cpu), "reply_cpu": _summary(reply_cpu),
            "allocate_wall": _summary(grant_wall),
            "release_cpu": _summary(release_cpu), "machine": describe()}


def _summary(seconds: list[float]) -> dict[str, float]:
    return {"p50_us": round(percentile(seconds, 0.5) * 1e6, 1), "p90_us": round(percentile(seconds, 0.9) * 1e6, 1),
            "mean_us": round(statistics.fmean(seconds) * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--allocates", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="glb-cpu-", dir="/tmp"))
    try:
        import uvloop  # the allocator's loop (gpuledger/agent.py)

        with (workdir / "allocator.log").open("w") as log:  # its lines, as a service writes them
            configure_logging("allocator", fmt="json", level="info", stream=log, cache=True)
            results = uvloop.run(run(args.allocates, args.warmup, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n| the allocator, in process | p50 µs | p90 µs | mean µs |\n|---|---:|---:|---:|")
    for key, label in (("allocate_cpu", "Allocate, CPU (the handler, its reply and the work after it; the fsync'd "
                                        "append included)"),
                       ("reply_cpu", "Allocate, CPU to its reply (the work after it left out)"),
                       ("allocate_wall", "Allocate, wall"), ("release_cpu", "release, CPU")):
        row = results[key]
        assert isinstance(row, dict)
        print(f"| {label} | {row['p50_us']} | {row['p90_us']} | {row['mean_us']} |")
    print(f"\n({results['machine']}, {args.allocates} Allocates after {args.warmup} warm-up)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
