"""NodePrepareResources latency as the kubelet sees it: gRPC over the DRA unix socket, one claim per call.

The allocator and registrar run in this process with their real parts (nats-server, the SQLite log,
the DRA plugin, a real HTTP API serving the ResourceClaims, CDI spec files on a tmpfs as /var/run/cdi
is on a node). Each measured call: ResourceClaim GET, NATS request to the allocator, decision + durable
append of claim.prepared (fsync), CDI spec written atomically, reply. Each claim is unprepared after
it was measured (not timed) so the GPU never fills. Floor: the plugin watcher's GetInfo on the same
process (one gRPC round trip).

Logging is set up as a service process sets it up (``libs.runtime.run_service``): JSON lines at the
production level, info (``--log-level`` changes it), written to ``services.log`` in the bench's work
directory rather than the terminal (the DaemonSet's stderr goes to a file as well). Without that set-up
structlog's default prints every debug line (one per NATS request) to stdout, which is not what a node
pays.

With ``--steps`` the steps of each measured call are timed too (by wrapping the methods that do them,
only while a measured call is in flight): the ResourceClaim GET, the NATS request to the allocator
(which includes the allocator's handler, which includes the log append) and the CDI spec write.

    python -m bench.dra_prepare [--claims 1000] [--steps] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import grpc

from libs.bus import NatsServer
from libs.config import Settings
from libs.kubelet.dra.v1 import api_pb2 as v1
from libs.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from libs.kubelet.pluginregistration.v1 import api_pb2 as reg
from libs.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from libs.logger import configure_logging
from services.allocator import app as allocator_app
from services.registrar import app as registrar_app
from tests.dra.helpers import ClaimApi

MIB = 1 << 20
SHM = "/dev/shm"


class StepTimes:
    """Times of the steps inside the measured calls: each method wrapped in place, restored on exit."""

    def __init__(self) -> None:
        self.measuring = False
        self.ms: dict[str, list[float]] = defaultdict(list)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: type, method: str, step: str, *, is_async: bool = True) -> None:
        original = getattr(owner, method)
        times = self.ms[step]

        def record(t0: float) -> None:
            if self.measuring:
                times.append((time.perf_counter() - t0) * 1000)

        async def timed_async(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                record(t0)

        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                record(t0)

        setattr(owner, method, timed_async if is_async else timed)
        self._undo.append(lambda: setattr(owner, method, original))

    def __enter__(self) -> StepTimes:
        from libs.bus.client import Bus
        from libs.kube.claims import ClaimSource
        from libs.store.log import EventLog
        from services.allocator.claims import ClaimHandlers
        from services.registrar.cdispecs import CdiSpecs

        self.wrap(ClaimSource, "get", "1 ResourceClaim GET (HTTP)")
        self.wrap(Bus, "request", "2 NATS request to the allocator, reply decoded")
        self.wrap(ClaimHandlers, "prepare", "2a allocator handler (decision, append, reply built)")
        self.wrap(EventLog, "append", "2b log append of claim.prepared (fsync)")
        self.wrap(CdiSpecs, "write", "3 CDI spec written", is_async=False)
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()

    def summary(self) -> dict[str, dict[str, float]]:
        return {step: _stats(ms) for step, ms in sorted(self.ms.items()) if ms}


def _stats(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {"p50": round(ms[len(ms) // 2], 3), "p99": round(ms[int(len(ms) * 0.99)], 3),
            "max": round(ms[-1], 3)}


async def main(claims: int, warmup: int, log_level: str = "info", steps: StepTimes | None = None,
               ) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="bdra", dir="/tmp"))
    log_file = (root / "services.log").open("w")
    # A node's CDI directory (/var/run/cdi) is on a tmpfs; so is this one where the machine has one.
    cdi_root = Path(tempfile.mkdtemp(prefix="bdra", dir=SHM)) if os.path.isdir(SHM) else root
    configure_logging("bench", fmt="json", level=log_level, stream=log_file)
    nats = NatsServer(root / "nats")
    url = await nats.start()
    try:
        with ClaimApi() as api:
            settings = Settings(node_name="bench", state_dir=str(root / "s"), device_plugin_dir=str(root / "dp"),
                                nats_url=url, gpus="fake", kubeconfig=api.kubeconfig(root / "kubeconfig"),
                                dra_gpus="all", kubelet_plugins_dir=str(root / "plugins"),
                                plugins_registry_dir=str(root / "reg"), cdi_dir=str(cdi_root / "cdi"),
                                health_checks=False, log_level=log_level, log_format="json",
                                driver_volumes=False)
            (root / "dp").mkdir()
            total = claims + warmup
            for i in range(total):
                api.put("bench", f"c{i}", f"claim-{i:06d}", node="bench", devices=[(f"gpu-{i % 4}", 10, 256 * MIB)],
                        pods=[(f"p{i}", f"00000000-0000-0000-0000-{i:012d}")])
            async with AsyncExitStack() as stack:
                await stack.enter_async_context(allocator_app.service(settings))
                await stack.enter_async_context(registrar_app.service(settings))
                prepare_ms: list[float] = []
                floor_ms: list[float] = []
                async with grpc.aio.insecure_channel(f"unix://{settings.dra_plugin_socket}") as ch, \
                        grpc.aio.insecure_channel(f"unix://{settings.dra_registration_socket}") as rch:
                    stub, rstub = v1_grpc.DRAPluginStub(ch), reg_grpc.RegistrationStub(rch)
                    for i in range(total):
                        claim = v1.Claim(namespace="bench", uid=f"claim-{i:06d}", name=f"c{i}")
                        if steps is not None:
                            steps.measuring = i >= warmup
                        t0 = time.perf_counter()
                        resp = await stub.NodePrepareResources(v1.NodePrepareResourcesRequest(claims=[claim]),
                                                               timeout=45)
                        took = (time.perf_counter() - t0) * 1000
                        if steps is not None:
                            steps.measuring = False
                        if resp.claims[claim.uid].error:
                            raise SystemExit(f"prepare failed: {resp.claims[claim.uid].error}")
                        t0 = time.perf_counter()
                        await rstub.GetInfo(reg.InfoRequest(), timeout=1)
                        floor = (time.perf_counter() - t0) * 1000
                        await stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(claims=[claim]), timeout=45)
                        if i >= warmup:
                            prepare_ms.append(took)
                            floor_ms.append(floor)
        log_file.flush()
        with (root / "services.log").open() as written:
            log_lines = sum(1 for _ in written)
        return {"claims": claims, "prepare_ms": _stats(prepare_ms), "floor_getinfo_ms": _stats(floor_ms),
                "cdi_dir": settings.cdi_dir, "log_level": log_level, "service_log_lines": log_lines,
                **({"steps_ms": steps.summary()} if steps is not None else {}),
                "loadavg": os.getloadavg(), "cpus": os.cpu_count(), "python": platform.python_version()}
    finally:
        await nats.stop()
        log_file.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(cdi_root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--log-level", default="info", help="the services' log level (production: info)")
    parser.add_argument("--steps", action="store_true", help="time the steps inside each measured call")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.steps:
        with StepTimes() as step_times:
            result = asyncio.run(main(args.claims, args.warmup, args.log_level, step_times))
    else:
        result = asyncio.run(main(args.claims, args.warmup, args.log_level))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
