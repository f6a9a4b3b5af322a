"""Recovery after a SIGKILL, per process: the launcher's restart delay, then the start until the probe answers.

``gpuledger up``'s launcher runs the embedded nats-server and the four services as processes (as in
bench/chaos.py, with the simulator's kubelet and API server in this process, and no pods). Each
process in turn is SIGKILLed ``--rounds`` times; for each kill:
- ``respawn``: from the SIGKILL until the launcher has started the new process (its restart delay);
- ``ready``: from that start until ``gpuledger health``'s probe answers (for the broker: the broker
  and the allocator answer, i.e. the services are connected again), polled every 20 ms;
- ``started``: from that start until the service logged "service started" (its start sequence done).
Kills are spaced so that no restart counts as a crash loop (the restart delay stays the first one).

    python -m bench.start_times [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

from gpuledger.health_cmd import check as health_check
from gpuledger.launcher import BROKER, QUICK_EXIT_S, SERVICES, Launcher
from libs.config import Settings
from libs.kube.pods import RESOURCE_VCORE
from libs.logger import configure_logging
from simulator import NodeSimulator, SimConfig

NODE = "start-node"
POLL_S = 0.02


def _pid(launcher: Launcher, name: str) -> int | None:
    if name == BROKER:
        return launcher.nats.pid if launcher.nats else None
    return next(c.pid for c in launcher.children if c.name == name)


def _started_at(log: Path, after: float) -> float | None:
    """Wall-clock time of the first "service started" line logged after ``after``."""
    if not log.exists():
        return None
    for line in log.read_text().splitlines():
        if '"service started"' not in line:
            continue
        at = datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00")).timestamp()
        if at >= after:
            return at
    return None


async def _healthy(name: str, settings: Settings) -> bool:
    probes = ["nats", "allocator"] if name == BROKER else [name]
    results = await asyncio.gather(*(health_check(p, settings, 1.0) for p in probes))
    return all(r is None for r in results)


async def measure(root: Path, rounds: int) -> dict[str, dict[str, list[float]]]:
    sim = NodeSimulator(SimConfig(node_name=NODE, device_plugin_dir=root / "dp",
                                  pod_resources_socket=root / "pr" / "kubelet.sock",
                                  kubeconfig_path=root / "kubeconfig", seed=1))
    await sim.start()
    settings = Settings(node_name=NODE, state_dir=str(root / "state"), device_plugin_dir=str(root / "dp"),
                        pod_resources_socket=str(root / "pr" / "kubelet.sock"), kubeconfig=str(root / "kubeconfig"),
                        gpus="fake", log_format="json", cgroup_root=str(root / "cgroup"),
                        proc_root=str(root / "proc"), driver_volumes=False)
    launcher = Launcher(settings, embedded_nats=True, log_dir=root / "logs")
    results: dict[str, dict[str, list[float]]] = {}
    try:
        await launcher.start_nats()
        await launcher.start_services()
        settings = launcher.settings
        await sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=90)
        last_kill: dict[str, float] = {}
        for _ in range(rounds):
            for name in (BROKER, *SERVICES):
                # no crash loop: the previous kill of this process is QUICK_EXIT_S behind
                await asyncio.sleep(max(0.0, last_kill.get(name, 0) + QUICK_EXIT_S + 0.5 - time.monotonic()))
                await asyncio.sleep(1.0)  # the others settle (a broker restart reconnects them all)
                old = _pid(launcher, name)
                assert old is not None
                os.kill(old, signal.SIGKILL)
                t0, wall0 = time.monotonic(), time.time()
                while _pid(launcher, name) in (old, None):  # noqa: ASYNC110 (the launcher's own record)
                    await asyncio.sleep(POLL_S / 4)
                t1 = time.monotonic()
                while not await _healthy(name, settings):
                    if time.monotonic() - t0 > 60:
                        raise TimeoutError(f"{name} not back within 60 s")
                    await asyncio.sleep(POLL_S)
                t2 = time.monotonic()
                last_kill[name] = t0
                r = results.setdefault(name, {"respawn": [], "ready": [], "started": []})
                r["respawn"].append(t1 - t0)
                r["ready"].append(t2 - t1)
                logged = _started_at(root / "logs" / f"{name}.log", wall0) if name != BROKER else None
                if logged is not None:
                    r["started"].append(logged - wall0 - (t1 - t0))
                print(f"  {name}: respawn {t1 - t0:.2f} s, ready {t2 - t1:.2f} s after", flush=True)
    finally:
        await launcher.stop()
        await sim.stop()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the run's directory (service logs)")
    args = ap.parse_args()
    configure_logging("start-times", level="warning")
    root = Path(tempfile.mkdtemp(prefix="start-times-"))
    load = os.getloadavg()[0]
    try:
        results = asyncio.run(measure(root, args.rounds))
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print(f"{'process':<12} {'respawn p50':>12} {'ready p50':>10} {'ready max':>10} {'started p50':>12}")
    for name, r in results.items():
        started = f"{statistics.median(r['started']):.2f}" if r["started"] else "-"
        print(f"{name:<12} {statistics.median(r['respawn']):>12.2f} {statistics.median(r['ready']):>10.2f} "
              f"{max(r['ready']):>10.2f} {started:>12}")


if __name__ == "__main__":
    main()
