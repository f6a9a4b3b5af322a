"""RegisterVDevice round trip through a pod's vcuda.sock, next to the same call without the gate (the floor).

The vmanager runs in this process with its real parts (nats-server, the SQLite log and its relay, the
gRPC backend, the SO_PEERCRED gate); this process plays a container process through a fake
``proc/<pid>/cgroup`` and cgroup tree, as the tests do. Each call opens a new connection, as
gpu-manager's gpu-client (one process per CUDA process) does:

- measured: ``register_vdevice`` on ``<vm>/<pod>/vcuda.sock`` by container name: accept, SO_PEERCRED,
  /proc/<pid>/cgroup, the call parsed and answered in the gate (grpcwire.py), cgroup search, pid walk,
  two file comparisons (unchanged files are not rewritten);
- floor: the same call on a new connection to a grpcio server in this process that answers at once
  (no gate, no registration work): what any gRPC server costs.

    python -m bench.register_rtt [--calls 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from libs.bus import Bus, NatsServer, Relay, ensure_stream
from libs.cgroups import container_cgroup_paths
from libs.commands import PrepareReply, PrepareRequest
from libs.config import Settings
from libs.events.schema import AllocationGranted, ContainerResponse, GpuInfo, GpuShare, InventoryRecorded
from libs.store import EventLog
from libs.vcuda import api_pb2 as pb
from libs.vcuda import api_pb2_grpc as pb_grpc
from libs.vcuda import register_vdevice
from services.vmanager.app import service

GIB = 1 << 30


class _AnswersAtOnce(pb_grpc.VCUDAServiceServicer):
    async def RegisterVDevice(self, request: pb.VDeviceRequest, context: grpc.aio.ServicerContext
                              ) -> pb.VDeviceResponse:
        return pb.VDeviceResponse()


def _fake_container(root: Path, pod_uid: str, others: int) -> None:
    rel = container_cgroup_paths(pod_uid, uuid.uuid4().hex * 2, "Burstable")[2]
    (root / "cgroup").mkdir(parents=True)
    (root / "cgroup" / "cgroup.controllers").write_text("memory pids\n")
    (root / "cgroup" / rel).mkdir(parents=True)
    pids = [os.getpid(), *range(100_000, 100_000 + others)]
    (root / "cgroup" / rel / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    proc = root / "proc" / str(os.getpid())
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(f"0::/{rel}\n")


async def _timed(calls: int, warmup: int, call: Callable[[], Awaitable[None]]) -> list[float]:
    for _ in range(warmup):
        await call()
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        await call()
        out.append((time.perf_counter() - t) * 1000)
    return out


def _stats(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {"p50": ms[len(ms) // 2], "p99": ms[int(len(ms) * 0.99)], "mean": statistics.fmean(ms)}


async def main(calls: int, warmup: int) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="breg", dir="/tmp"))
    nats = NatsServer(root / "nats")
    url = await nats.start()
    try:
        settings = Settings(node_name="bench", state_dir=str(root / "s"), vm_dir=str(root / "vm"), nats_url=url,
                            cgroup_root=str(root / "cgroup"), proc_root=str(root / "proc"), driver_volumes=False)
        event_log = await EventLog.open(settings.log_path)
        bus = await Bus.connect(url, name="bench", node="bench")
        await ensure_stream(bus)
        relay = Relay(bus, event_log)
        relay_task = asyncio.create_task(relay.run())
        uid = str(uuid.uuid4())
        _fake_container(root, uid, others=20)
        share = GpuShare(index=0, uuid="GPU-0", minor=0, cores=30, memory=GIB)
        stored = await event_log.append([
            InventoryRecorded(node="bench", backend="fake", driver_version="550.54.15",
                              gpus=(GpuInfo(index=0, minor=0, uuid="GPU-0", memory=80 * GIB),)),
            AllocationGranted(alloc_id=uuid.uuid4().hex, request_id="r", pod_uid=uid, namespace="b", pod_name="p",
                              container="main", container_index=0, cores=30, memory=GIB,
                              device_ids=("d",), shares=(share,), response=ContainerResponse()),
        ])
        await relay.wait_published(stored[-1].seq, 10)
        async with service(settings) as svc:
            await asyncio.wait_for(svc.tracker.caught_up.wait(), 30)
            reply = await bus.request(bus.subjects.prepare, PrepareRequest(pod_uid=uid, alloc_seq=stored[-1].seq),
                                      PrepareReply, timeout=10)

            async def through_gate() -> None:
                await register_vdevice(reply.socket, pod_uid=uid, container_name="main", timeout=10)

            bare = grpc.aio.server()
            pb_grpc.add_VCUDAServiceServicer_to_server(_AnswersAtOnce(), bare)
            bare_socket = root / "bare.sock"
            bare.add_insecure_port(f"unix://{bare_socket}")
            await bare.start()

            async def floor() -> None:
                await register_vdevice(str(bare_socket), pod_uid=uid, container_name="main", timeout=10)

            try:
                floor_ms = await _timed(calls, warmup, floor)
            finally:
                await bare.stop(None)
            gate_ms = await _timed(calls, warmup, through_gate)
            assert (settings.vm_root / uid / "main" / "pids.config").stat().st_size == 21 * 4
        relay_task.cancel()
        await bus.close()
        await event_log.close()
    finally:
        await nats.stop()
        shutil.rmtree(root, ignore_errors=True)
    g, f = _stats(gate_ms), _stats(floor_ms)
    return {
        "calls": calls, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "register_ms": g, "floor_ms": f, "p50_ratio": g["p50"] / f["p50"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = asyncio.run(main(args.calls, args.warmup))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
