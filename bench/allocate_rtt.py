"""Allocate round trip, next to a bare gRPC echo measured in the same run.

Path measured: the simulated kubelet's Allocate RPC for tencent.com/vcuda-core, timed by the simulator
from call to reply: kubelet -> registrar (gRPC, unix socket) -> allocator (NATS request) -> watchdog
(pending pods, NATS) -> placement -> event log append (fsync, synchronous=FULL) -> reply back.
The four services run as separate processes, as in production; the simulator runs in this process.

Floors, measured in the same run: (1) a bare device plugin (bench/echo_plugin.py, a child process)
that answers Allocate at once with a fixed response; its pods are interleaved with ours and go
through the same simulated kubelet, so the ratio to it is what gpuledger costs; (2) a grpc.aio unary
echo (16 bytes) over a unix socket to a child process, the cheapest possible exchange.

    python -m bench.allocate_rtt [--pods 200] [--echo 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.echo_plugin import RESOURCE as ECHO_RESOURCE
from gpuledger.launcher import Launcher
from libs.bus.server import NatsServer
from libs.config import Settings
from libs.kube.pods import RESOURCE_VCORE
from libs.logger import configure_logging
from simulator import NodeSimulator, SimConfig

ECHO_METHOD = "/bench.Echo/Echo"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(name: str, seconds: list[float]) -> dict[str, float | str | int]:
    ms = [s * 1000 for s in seconds]
    return {"name": name, "n": len(ms), "p50_ms": round(percentile(ms, 0.50), 3),
            "p99_ms": round(percentile(ms, 0.99), 3), "mean_ms": round(statistics.fmean(ms), 3)}


# --- the floor: a bare gRPC echo in a child process -----------------------------------------------

def _echo_server(path: str) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(_echo)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),))
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


async def _echo(req: bytes, _context: grpc.aio.ServicerContext) -> bytes:
    return req


async def grpc_echo(n: int, workdir: Path) -> list[float]:
    sock = str(workdir / "echo.sock")
    code = f"from bench.allocate_rtt import _echo_server; _echo_server({sock!r})"
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=subprocess.PIPE)
    try:
        assert child.stdout and (await child.stdout.readline()).strip() == b"ready"
        async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
            call = ch.unary_unary(ECHO_METHOD)
            for _ in range(200):
                await call(b"x" * 16)
            out = []
            for _ in range(n):
                t = time.perf_counter()
                await call(b"x" * 16, timeout=5)
                out.append(time.perf_counter() - t)
            return out
    finally:
        child.terminate()
        await asyncio.wait_for(child.wait(), 5)


# --- the real path ----------------------------------------------------------------------------

def pod(i: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"bench-{i}", "namespace": "bench"},
            "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": {
                "tencent.com/vcuda-core": "10", "tencent.com/vcuda-memory": "1"}}}]}}


def echo_pod(i: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"echo-{i}", "namespace": "bench"},
            "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": {ECHO_RESOURCE: "1"}}}]}}


async def run_pod(sim: NodeSimulator, manifest: dict) -> None:
    created = await sim.create_pod(manifest)
    name = created["metadata"]["name"]
    done = await sim.wait_for_pod("bench", name, lambda p: p["status"].get("phase") in ("Running", "Failed"), 30)
    if done["status"]["phase"] != "Running":
        raise RuntimeError(f"{name} failed: {done['status'].get('message')}")
    await sim.delete_pod("bench", name)


def allocator_profile(log: Path, warmup: int) -> dict[str, object]:
    """p50/p99 of the allocator's own step timings, from its "granted" log lines."""
    rows = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "granted" and "lookup_ms" in rec:
            rows.append(rec)
    rows = rows[warmup:]
    out: dict[str, object] = {"n": len(rows)}
    for key in ("lookup_ms", "append_ms", "total_ms"):
        values = [float(r[key]) for r in rows if key in r]
        if values:
            out[key] = {"p50": round(percentile(values, 0.5), 3), "p99": round(percentile(values, 0.99), 3)}
    out["lookups"] = {k: sum(1 for r in rows if r["lookups"] == k) for k in sorted({r["lookups"] for r in rows})}
    return out


async def allocate_path(
    n: int, warmup: int, workdir: Path, *, profile: bool = False
) -> tuple[list[float], list[float]]:
    """Allocate times of gpuledger's vcore plugin and of the bare echo plugin, interleaved pod by pod."""
    nats = NatsServer(workdir / "nats")
    await nats.start()
    sim = NodeSimulator(SimConfig(node_name="bench-node", device_plugin_dir=workdir / "dp",
                                  pod_resources_socket=workdir / "pr" / "kubelet.sock",
                                  kubeconfig_path=workdir / "kubeconfig", seed=1))
    await sim.start()
    settings = Settings(node_name="bench-node", state_dir=str(workdir / "state"), device_plugin_dir=str(workdir / "dp"),
                        pod_resources_socket=str(workdir / "pr" / "kubelet.sock"),
                        kubeconfig=str(workdir / "kubeconfig"), nats_url=nats.url, gpus="fake",
                        log_format="json", log_level="info" if profile else "warning")
    launcher = Launcher(settings, embedded_nats=False, log_dir=workdir / "logs")
    await launcher.start_services()
    echo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.echo_plugin", str(workdir / "dp"), stdout=subprocess.PIPE)
    try:
        assert echo.stdout and (await echo.stdout.readline()).strip() == b"ready"
        await sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=60)
        await sim.wait_for_resource(ECHO_RESOURCE, 1000, timeout=60)
        for i in range(n + warmup):
            await run_pod(sim, pod(i))
            await run_pod(sim, echo_pod(i))
            if (i + 1) % 50 == 0:
                print(f"  {i + 1}/{n + warmup} pods", file=sys.stderr, flush=True)

        def times(resource: str) -> list[float]:
            calls = [c for c in sim.calls if c.method == "Allocate" and c.resource == resource and c.ok]
            return [c.end - c.start for c in calls][warmup:]  # type: ignore[operator]

        return times(RESOURCE_VCORE), times(ECHO_RESOURCE)
    finally:
        echo.terminate()
        await asyncio.wait_for(echo.wait(), 5)
        await launcher.stop()
        if profile:
            print(json.dumps({"allocator": allocator_profile(workdir / "logs" / "allocator.log", warmup)}),
                  file=sys.stderr)
        await sim.stop()
        await nats.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--echo", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="log at info and print the allocator's own step timings (adds logging cost)")
    args = parser.parse_args()
    configure_logging("bench", fmt="console", level="warning")
    workdir = Path(tempfile.mkdtemp(prefix="glb", dir="/tmp"))
    floor = summary("grpc echo over a unix socket (floor)", await grpc_echo(args.echo, workdir))
    print("  floor measured", file=sys.stderr, flush=True)
    ours, bare = await allocate_path(args.pods, args.warmup, workdir, profile=args.profile)
    path = summary("Allocate: sim -> registrar -> allocator -> log -> reply", ours)
    plugin = summary("Allocate: sim -> bare echo device plugin (floor)", bare)
    results = {"machine": f"{platform.machine()} {os.cpu_count()} cpu, Python {platform.python_version()}",
               "rows": [path, plugin, floor],
               "ratio_p50": round(path["p50_ms"] / plugin["p50_ms"], 1),  # type: ignore[operator]
               "ratio_p99": round(path["p99_ms"] / plugin["p99_ms"], 1)}  # type: ignore[operator]
    print("| measurement | n | p50 ms | p99 ms | mean ms |\n|---|---:|---:|---:|---:|")
    for row in results["rows"]:  # type: ignore[attr-defined]
        print(f"| {row['name']} | {row['n']} | {row['p50_ms']} | {row['p99_ms']} | {row['mean_ms']} |")
    print(f"\nratio to the bare device plugin: p50 {results['ratio_p50']}x, p99 {results['ratio_p99']}x"
          f"   ({results['machine']})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
