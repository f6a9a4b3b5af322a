"""Pod start through a real container runtime: a GPU pod through gpuledger against a pod without GPUs.

Measured: from ``create_pod`` on the simulator's API to a running container that has done its first
work, on the same emulated kubelet and the same private containerd + runc (simulator/runtime), in one
run, GPU and plain pods interleaved. The GPU pod (10 cores + 1 x 256 MiB) goes through admission
(Allocate for both resources: registrar -> allocator, log append), PreStartContainer (allocator check,
vmanager prepares the pod's vcuda.sock), CreateContainer with the response's devices and mounts,
StartContainer; its container then registers through the mounted vcuda.sock (vcuda-register, from
its own PID namespace: the vmanager checks the caller's cgroup, writes vcuda.config) and reads its
vcuda.config; then it touches a file in a hostPath directory, which ends the measurement. The plain
pod's container touches the file at once. Each pod is deleted before the next one (teardown not
timed).
The floor, a third kind in the same run (``--no-floor`` leaves it out): the same GPU pod through
bench/echo_gpu.py, a bare plugin for two resources of its own and a bare vcuda.sock that do none of
gpuledger's work, answering with gpuledger's own Allocate response to a warm-up pod. Its start minus
the plain pod's is what the contract itself costs (two Allocates, PreStartContainer, the devices and
mounts, the registration from inside); the GPU pod's minus the floor's is gpuledger's own work. Pods
run as GPU i, plain i, floor i, so the GPU pod's teardown still overlaps the plain pod's start, as
before the floor was added.

The durable floor, a fourth kind with ``--durable-floor``: the floor whose core Allocate first makes
one NATS request answered after one fsync'd SQLite append (bench/echo_ledger.py), the least that
gpuledger's promise adds to the floor. It runs last (GPU i, plain i, floor i, durable i).
The four services run as their own processes (``gpuledger up``'s way), or in this process with
``--services in-process`` (as in tests/runtime); needs root + containerd, and cgroup v1 or hybrid: on
cgroup v2 the GPU container's own /proc/self/cgroup hides its ids (docs/limit-delivery.md).
Printed with the p50 overhead: its 95 % bootstrap interval over the run's pairs of pods, since one
run's p50 moves by a few percent from run to run on a busy machine.

    python -m bench.pod_start [--pods 100] [--no-floor] [--durable-floor] [--cpu] [--cpu-steps]
                              [--no-runtime-endpoint] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from bench.allocate_rtt import percentile, start_helper, stop_helpers, summary
from bench.echo_gpu import resources
from bench.echo_plugin import DEVICES as FLOOR_DEVICES
from bench.machine import interpreter
from bench.pod_start_cpu import CpuMeter
from bench.pod_start_trace import Trace, install
from gpuledger.launcher import Launcher
from libs.bus.server import NatsServer
from libs.cgroups import unified_only
from libs.config import Settings
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY
from libs.logger import configure_logging
from simulator import NodeSimulator, SimConfig
from simulator.runtime import runtime_unavailable_reason
from simulator.runtime.fakegpus import FakeGpus, fake_gpus_on_host
from simulator.runtime.hostlock import RuntimeBusy

# What a CUDA interception library does at its first call, in one process as the library does it:
# its ids from /proc/self/cgroup, RegisterVDevice through the mounted vcuda.sock, then its own
# 8240-byte vcuda.config read (vcuda-register --self, simulator/runtime/csrc/vcuda_register.c). The
# same process then says it is running (the marker file), as the plain pod's one process does: each
# pod's shell starts exactly one program, so the GPU pod's time holds no process the plain pod's lacks
# beyond what the registration itself needs.
GPU_SCRIPT = (
    "/bin/vcuda-register --self /etc/vcuda/vcuda.sock /out/$POD_NAME; "
    "trap 'exit 0' TERM; sleep 2147483647 & wait"
)
PLAIN_SCRIPT = "touch /out/$POD_NAME; trap 'exit 0' TERM; sleep 2147483647 & wait"


_SHARE = ("10", "1")  # cores, 256 MiB blocks
LIMITS = {  # kind -> what its container asks for; the floors: bench/echo_gpu.py's resources, the same share
    "gpu": dict(zip((RESOURCE_VCORE, RESOURCE_VMEMORY), _SHARE, strict=True)),
    "floor": dict(zip(resources(durable=False), _SHARE, strict=True)),
    "durable": dict(zip(resources(durable=True), _SHARE, strict=True)),
    "plain": {},
}


def manifest(name: str, out: Path, kind: str) -> dict[str, Any]:
    limits = LIMITS[kind]
    script = PLAIN_SCRIPT if kind == "plain" else GPU_SCRIPT
    container = {"name": "c", "image": "bench", "command": ["/bin/sh", "-c", script],
                 "env": [{"name": "POD_NAME", "value": name}],
                 "resources": {"limits": limits, "requests": dict(limits)},
                 "volumeMounts": [{"name": "out", "mountPath": "/out"}]}
    return {"metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": [container], "volumes": [{"name": "out", "hostPath": {"path": str(out)}}],
                     "terminationGracePeriodSeconds": 5}}


async def start_one(sim: NodeSimulator, out: Path, name: str, kind: str, timeout: float = 60,
                    trace: Trace | None = None, cpu: CpuMeter | None = None) -> float:
    marker = out / name
    if trace is not None:
        trace.begin()
    if cpu is not None:
        cpu.begin()
    started = time.perf_counter()
    await sim.create_pod(manifest(name, out, kind))
    deadline = started + timeout
    while not marker.exists():  # written by the container itself
        if time.perf_counter() > deadline:
            pod = sim.get_pod("default", name)
            raise TimeoutError(f"{name} did not start within {timeout}s: {pod and pod.get('status')}")
        await asyncio.sleep(0.002)
    elapsed = time.perf_counter() - started
    if cpu is not None:
        cpu.end(kind)
    if trace is not None:
        trace.end(kind)
    # Not timed: let the kubelet finish reporting the start, then delete.
    await sim.wait_for_pod("default", name, lambda p: p["status"].get("phase") == "Running", timeout)
    await sim.delete_pod("default", name)
    return elapsed


async def run(pods: int, breakdown: bool = False, services: str = "processes",
              runtime_endpoint: bool = True, cpu: bool = False, floor: bool = True,
              durable: bool = False, cpu_steps: bool = False) -> dict[str, Any]:
    trace = install() if breakdown else None
    meter = CpuMeter() if cpu or cpu_steps else None
    if meter is not None and cpu_steps:
        count_steps(meter)
    root = Path(tempfile.mkdtemp(prefix="glps", dir="/tmp"))
    try:
        with fake_gpus_on_host(root) as gpus:
            times, containerd_start = await _measure(root, gpus, pods, services, trace, runtime_endpoint, meter,
                                                     floor, durable)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gpu, plain = summary(NAMES["gpu"], times["gpu"]), summary(NAMES["plain"], times["plain"])
    result = {
        "machine": f"{platform.machine()} {platform.system()} {platform.release()}, {interpreter()}",
        "services": services,
        "container_runtime_endpoint": runtime_endpoint,
        "containerd_start_s": containerd_start,
        "p50_overhead_ci95_pct": list(overhead_interval(times["gpu"], times["plain"])),
        "gpu": gpu, "plain": plain,
        "p50_overhead_pct": round(100 * (gpu["p50_ms"] / plain["p50_ms"] - 1), 1),
        "p99_overhead_pct": round(100 * (gpu["p99_ms"] / plain["p99_ms"] - 1), 1),
        # GPU pod i and plain pod i start back to back: their difference drifts less with the machine
        "paired_extra_ms": paired_median_ms(times["gpu"], times["plain"]),
    }
    for floor_kind in ("floor", "durable"):
        if floor_kind not in times:
            continue
        fl = result[floor_kind] = summary(NAMES[floor_kind], times[floor_kind])
        result[f"{floor_kind}_p50_overhead_pct"] = round(100 * (fl["p50_ms"] / plain["p50_ms"] - 1), 1)
        result[f"{floor_kind}_p50_overhead_ci95_pct"] = list(overhead_interval(times[floor_kind], times["plain"]))
        result[f"{floor_kind}_paired_extra_ms"] = paired_median_ms(times[floor_kind], times["plain"])
        result[f"gpu_over_{floor_kind}_paired_ms"] = paired_median_ms(times["gpu"], times[floor_kind])
    if trace:
        result["breakdown_median_ms"] = trace.table()
    if meter:
        result["cpu_mean_ms"] = meter.table()
        if cpu_steps:
            result["cpu_steps_mean_ms"] = meter.step_table()
    return result


# The emulated kubelet's steps of a pod start, in their order (the names sort so), for --cpu-steps.
# StartContainer's step holds the container's own start: the GPU pod's registration from inside.
def count_steps(meter: CpuMeter) -> None:
    from simulator.devicemanager import DeviceManager
    from simulator.runtime import pods
    from simulator.runtime.cri import CriClient

    meter.wrap_step(DeviceManager, "allocate", "1 admission (Allocates)")
    meter.wrap_step(pods.PodRuntime, "ensure_sandbox", "2 RunPodSandbox")
    meter.wrap_step(DeviceManager, "run_container_options", "3 PreStart + options")
    meter.wrap_step(CriClient, "create_container", "4 CreateContainer")
    meter.wrap_step(CriClient, "start_container", "5 StartContainer")


def paired_median_ms(a: list[float], b: list[float]) -> float:
    return round(1000 * statistics.median(x - y for x, y in zip(a, b, strict=True)), 2)


NAMES = {"gpu": "gpu pod (gpuledger)", "floor": "gpu pod (bare floor)", "durable": "gpu pod (durable floor)",
         "plain": "pod without GPUs"}


def floor_response(answered: dict[str, Any], vcuda_dir: Path) -> dict[str, Any]:
    """The one container response of ``answered`` (an AllocateResponse as the simulator's call log
    keeps it: proto field names), its ``/etc/vcuda`` mount's source replaced by ``vcuda_dir``;
    ``answered`` is left as it was. ValueError when it holds other than one container response or no
    such mount."""
    responses = answered.get("container_responses", [])
    if len(responses) != 1:
        raise ValueError(f"expected one container response, got {len(responses)}")
    container = copy.deepcopy(responses[0])
    for mount in container.get("mounts", []):
        if mount.get("container_path") == "/etc/vcuda":
            mount["host_path"] = str(vcuda_dir)
            return container
    raise ValueError(f"the response mounts nothing at /etc/vcuda: {container}")


async def start_floor(root: Path, sim: NodeSimulator, out: Path, started: list[asyncio.subprocess.Process],
                      bus_url: str | None = None) -> None:
    """bench/echo_gpu.py (appended to ``started``), answering with gpuledger's own Allocate response to
    the last warm-up GPU pod (its vcuda directory replaced by the floor's), registered, and three
    warm-up floor pods started. With ``bus_url``: the durable floor, bench/echo_ledger.py started first."""
    kind = "durable" if bus_url else "floor"
    answered = next(c for c in reversed(sim.calls)
                    if c.method == "Allocate" and c.resource == RESOURCE_VCORE and c.ok)
    vcuda_dir = root / f"{kind}-vcuda"
    response_file = root / f"{kind}-response.json"
    response_file.write_text(json.dumps(floor_response(answered.response, vcuda_dir)))
    extra: tuple[str, ...] = ()
    if bus_url:
        await start_helper("bench.echo_ledger", str(root / "durable.db"), bus_url, started=started)
        extra = ("--bus", bus_url)
    await start_helper("bench.echo_gpu", str(root / "dp"), str(vcuda_dir), str(response_file), *extra,
                       started=started)
    await sim.wait_for_resource(resources(durable=bus_url is not None)[0], FLOOR_DEVICES, timeout=60)
    for i in range(3):  # warm-up, not counted
        await start_one(sim, out, f"warm-{kind}-{i}", kind)


async def _measure(root: Path, gpus: FakeGpus, pods: int, services: str, trace: Trace | None,
                   runtime_endpoint: bool, cpu: CpuMeter | None = None, floor: bool = True,
                   durable: bool = False) -> tuple[dict[str, list[float]], float]:
    """Each kind's start times (s), in the order run (gpu i, plain i, floor i, durable i), and containerd's
    start (s)."""
    from services.allocator import app as allocator_app
    from services.registrar import app as registrar_app
    from services.vmanager import app as vmanager_app
    from services.watchdog import app as watchdog_app

    out = root / "out"
    out.mkdir()
    nats = NatsServer(root / "nats")
    await nats.start()
    try:
        settings = Settings(
            node_name="bench-node", state_dir=str(root / "state"), device_plugin_dir=str(root / "dp"),
            pod_resources_socket=str(root / "pr" / "kubelet.sock"), kubeconfig=str(root / "kubeconfig"),
            nats_url=nats.url, gpus=f"fake:{gpus.profile}", cgroup_root="/sys/fs/cgroup", proc_root="/proc",
            driver_volumes=False, log_level="warning")
        async with AsyncExitStack() as stack:
            sim = NodeSimulator(SimConfig(
                node_name="bench-node", device_plugin_dir=root / "dp",
                pod_resources_socket=root / "pr" / "kubelet.sock", kubeconfig_path=root / "kubeconfig",
                runtime="containerd", runtime_dir=root / "rt"))
            await sim.start()
            stack.push_async_callback(sim.stop)
            if runtime_endpoint:  # the vmanager names registering containers through the runtime's CRI
                settings = settings.replace(container_runtime_endpoint=str(sim.runtime.containerd.socket))
            if services == "processes":  # gpuledger up's way: each service its own process
                launcher = Launcher(settings, embedded_nats=False, log_dir=root / "logs")
                stack.push_async_callback(launcher.stop)
                await launcher.start_services()
            else:
                for app in (allocator_app, watchdog_app, vmanager_app, registrar_app):
                    await stack.enter_async_context(app.service(settings))
            await sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=60)
            containerd_start = sim.runtime.containerd.start_seconds
            for i in range(3):  # warm-up, not counted
                await start_one(sim, out, f"warm-gpu-{i}", "gpu")
                await start_one(sim, out, f"warm-plain-{i}", "plain")
            kinds = ["gpu", "plain"]
            helpers: list[asyncio.subprocess.Process] = []
            stack.push_async_callback(stop_helpers, helpers)
            if floor:
                await start_floor(root, sim, out, helpers)
                kinds.append("floor")  # last: its teardown, not the GPU pod's, overlaps the next GPU pod's start
            if durable:
                await start_floor(root, sim, out, helpers, bus_url=nats.url)
                kinds.append("durable")
            if cpu is not None:
                cpu.watch("broker", nats.pid)
                cpu.watch("containerd", sim.runtime.containerd.pid)
                cpu.watch("bench+kubelet", os.getpid())  # the simulator, its kubelet, in-process services
                for child in launcher.children if services == "processes" else []:
                    cpu.watch(child.name, child.pid)
                if floor:
                    cpu.watch("floor plugin", helpers[0].pid)
                if durable:
                    cpu.watch("durable ledger", helpers[-2].pid)
                    cpu.watch("durable plugin", helpers[-1].pid)
            times: dict[str, list[float]] = {kind: [] for kind in kinds}
            for i in range(pods):
                for kind in kinds:
                    times[kind].append(await start_one(sim, out, f"{kind}-{i}", kind, trace=trace, cpu=cpu))
    finally:
        await nats.stop()
    return times, round(containerd_start, 3)


def overhead_interval(gpu: list[float], plain: list[float], *, rounds: int = 2000,
                      seed: int = 1) -> tuple[float, float]:
    """The p50 overhead's 95 % bootstrap interval, in %: the pairs (GPU pod i, plain pod i, started
    back to back) resampled with replacement ``rounds`` times. One run's p50 over 100 pods moves by
    several milliseconds from run to run; the interval says how far that run's figure can be trusted
    against the goal."""
    if len(gpu) != len(plain) or not gpu:
        raise ValueError(f"need as many GPU pods as plain pods, at least one: {len(gpu)} and {len(plain)}")
    rng = random.Random(seed)
    n = len(gpu)
    overheads = []
    for _ in range(rounds):
        picks = [rng.randrange(n) for _ in range(n)]
        overheads.append(100 * (percentile([gpu[i] for i in picks], 0.5)
                                / percentile([plain[i] for i in picks], 0.5) - 1))
    return round(percentile(overheads, 0.025), 1), round(percentile(overheads, 0.975), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=100, help="pods of each kind (default 100)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--services", choices=("processes", "in-process"), default="processes",
                        help="the four services as their own processes (gpuledger up's way, default) or "
                             "in the bench's process")
    parser.add_argument("--no-runtime-endpoint", dest="runtime_endpoint", action="store_false",
                        help="do not give the vmanager containerd's socket: container names come from the "
                             "pod's status through the watchdog (the fallback)")
    parser.add_argument("--breakdown", action="store_true",
                        help="time each step of a pod start (bench/pod_start_trace.py) and print the medians")
    parser.add_argument("--cpu", action="store_true",
                        help="CPU time each process (and the whole machine) spent inside each pod's timed "
                             "window, means per kind of pod (bench/pod_start_cpu.py)")
    parser.add_argument("--cpu-steps", action="store_true",
                        help="--cpu, and each pod's CPU split by the step of its start it fell in (admission, "
                             "RunPodSandbox, PreStart and options, CreateContainer, StartContainer); its reads "
                             "take the bench's own time, so the start times of such a run are not the goal's")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="leave out the third kind of pod: a GPU pod through bench/echo_gpu.py, a bare plugin "
                             "and vcuda.sock that do none of gpuledger's work (the floor of what the contract costs)")
    parser.add_argument("--durable-floor", dest="durable", action="store_true",
                        help="add a fourth kind of pod: the floor whose Allocate makes one NATS request answered "
                             "after one fsync'd append (bench/echo_ledger.py), what gpuledger's promise costs at least")
    args = parser.parse_args()
    reason = runtime_unavailable_reason()
    if reason:
        raise SystemExit(f"bench.pod_start needs the real runtime: {reason}")
    if unified_only():
        raise SystemExit("bench.pod_start needs cgroup v1 or hybrid: on cgroup v2 its GPU container cannot find "
                         "its own ids in /proc/self/cgroup (a cgroup namespace of its own; docs/limit-delivery.md)")
    configure_logging("bench", fmt="console", level="warning")
    try:
        result = asyncio.run(run(args.pods, args.breakdown, args.services, args.runtime_endpoint, args.cpu,
                                 args.floor, args.durable, args.cpu_steps))
    except RuntimeBusy as exc:
        raise SystemExit(f"bench.pod_start: {exc}") from None
    for key in ("gpu", "floor", "durable", "plain"):
        if key not in result:
            continue
        r = result[key]
        print(f"{r['name']:<22} n={r['n']} p50={r['p50_ms']:.1f} ms p99={r['p99_ms']:.1f} ms "
              f"mean={r['mean_ms']:.1f} ms")
    low, high = result["p50_overhead_ci95_pct"]
    print(f"gpuledger adds {result['p50_overhead_pct']}% at p50 (95 % bootstrap interval {low} to {high} %), "
          f"{result['p99_overhead_pct']}% at p99, "
          f"{result['paired_extra_ms']} ms per pod (median of GPU pod i - plain pod i) "
          f"(containerd start {result['containerd_start_s']} s; {result['machine']})")
    for floor_kind, what, beyond in (("floor", "the bare floor (bench/echo_gpu.py)", "gpuledger's own work"),
                                     ("durable", "the durable floor (bench/echo_gpu.py --bus)", "gpuledger beyond it")):
        if floor_kind in result:
            low, high = result[f"{floor_kind}_p50_overhead_ci95_pct"]
            print(f"{what} adds {result[f'{floor_kind}_p50_overhead_pct']}% at p50 (95 % interval {low} to {high} %), "
                  f"{result[f'{floor_kind}_paired_extra_ms']} ms per pod (median of {floor_kind} pod i - plain pod i); "
                  f"{beyond}: {result[f'gpu_over_{floor_kind}_paired_ms']} ms per pod "
                  f"(median of GPU pod i - {floor_kind} pod i)")
    for kind, steps in (result.get("breakdown_median_ms") or {}).items():
        print(f"-- {kind}: median ms per step (@step: ms after create_pod when it began)")
        for step, ms in steps.items():
            print(f"   {step:<45} {ms:8.2f}")
    cpu_table = result.get("cpu_mean_ms")
    if cpu_table:
        print("-- CPU ms inside each pod's window (means): " + ", ".join(cpu_table["gpu"]))
        for kind in cpu_table:
            print(f"   {kind:<6} " + "  ".join(f"{v:7.2f}" for v in cpu_table[kind].values()))
    step_table = result.get("cpu_steps_mean_ms")
    if step_table:
        names = next(iter(next(iter(step_table.values())).values()))
        print("-- CPU ms inside each step of the start (means per pod; the reads slowed these starts): "
              + ", ".join(names))
        for kind, steps in step_table.items():
            for step, spent in steps.items():
                print(f"   {kind:<8} {step:<26} " + "  ".join(f"{v:7.2f}" for v in spent.values()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
