"""Chaos: pod lifecycles through the simulator while a seeded schedule kills and freezes the agent.

``gpuledger up``'s launcher runs the five processes (the embedded nats-server, allocator, watchdog,
vmanager, registrar) as in production; the simulator (kubelet + API server) runs in this process.
Workers walk pods through their lifecycle (shares, whole GPUs, two GPUs, two-container pods, pods
with an init container): create, wait until Running or Failed, delete. A chaos task, seeded, picks a
process (round-robin over a shuffled order, so every one is hit) at random moments, half of them
just after a pod was created (mid-Allocate), and SIGKILLs it or freezes it (SIGSTOP for ``--freeze``
seconds, then SIGCONT). Recovery time = from the kill (or the SIGCONT) until the process runs again
and answers its health probe (``gpuledger health``'s checks; for the broker, the allocator answers too).

Checked from outside the agent, every ``CHECK_EVERY_S`` and at the end, on the log folded event by
event from the SQLite file:
- no lost grant: every container of a Running pod holds an allocation on the devices the kubelet gave it;
- no GPU overcommitted (cores <= 100, memory <= total; a whole GPU is 100 cores);
- no allocation outlives its pod by more than ``--bound`` seconds after the node was whole again;
- no pod refused for room while the kubelet's own view (the pods it still runs) had room for it
  (judged at the refusal; ``--no-room-check`` reports these without failing);
and at the end: the fold equals ``gpuledger replay --json``, ``gpuledger audit verify`` passes, every
killed process is back. A failing run prints its seed: ``--seed N`` repeats the schedule.

    python -m bench.chaos [--lifecycles 1000] [--seed N] [--disrupt-every 8] [--freeze 3] [--bound 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuledger.health_cmd import check as health_check
from gpuledger.launcher import BROKER, SERVICES, Launcher
from libs.config import MEMORY_BLOCK, Settings
from libs.events.schema import AllocationRefused
from libs.kube.pods import RESOURCE_VCORE
from libs.ledger.state import LedgerSnapshot, LedgerState
from libs.lifeline import process_alive
from libs.logger import configure_logging
from libs.store.replay import iter_events, open_reader
from simulator import NodeSimulator, SimConfig

NODE = "chaos-node"
PROCESSES = (BROKER, *SERVICES)
CHECK_EVERY_S = 1.0
PROBE_NAMES = {BROKER: "nats"}
UNAVAILABLE = ("did not answer", "no service answers", "timed out", "timeout", "deadline", "cannot", "unavailable",
               "not found", "connection")


@dataclass
class Report:
    seed: int
    lifecycles: int = 0
    running: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    freezes: Counter[str] = field(default_factory=Counter)
    recovery: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    failed: Counter[str] = field(default_factory=Counter)  # failed admissions by cause
    violations: list[str] = field(default_factory=list)
    room_refusals: list[str] = field(default_factory=list)  # refused while the kubelet had room
    seconds: float = 0.0

    def violation(self, text: str) -> None:
        if text not in self.violations:
            self.violations.append(text)

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else 0.0

        return {
            "seed": self.seed, "lifecycles": self.lifecycles, "running": self.running,
            "seconds": round(self.seconds, 1),
            "kills": dict(self.kills), "freezes": dict(self.freezes),
            "recovery_s": {p: {"n": len(xs), "p50": round(statistics.median(xs), 2), "p99": pct(xs, 0.99),
                               "max": round(max(xs), 2)} for p, xs in sorted(self.recovery.items()) if xs},
            "failed_admissions": dict(self.failed),
            "room_refusals": len(self.room_refusals),
            "violations": self.violations,
        }


def _container(name: str, cores: int, mem: int) -> dict[str, Any]:
    limits = {"tencent.com/vcuda-core": str(cores)}
    if mem:
        limits["tencent.com/vcuda-memory"] = str(mem)
    return {"name": name, "image": "cuda", "resources": {"limits": limits, "requests": dict(limits)}}


def random_pod(rng: random.Random, name: str) -> dict[str, Any]:
    kind = rng.choice(["share", "share", "whole", "two", "two-containers", "init"])
    spec: dict[str, Any]
    if kind == "share":
        spec = {"containers": [_container("c", rng.choice([10, 20, 30, 50]), rng.randint(1, 4))]}
    elif kind == "whole":
        spec = {"containers": [_container("c", 100, 0)]}
    elif kind == "two":
        spec = {"containers": [_container("c", 200, 0)]}
    elif kind == "two-containers":
        spec = {"containers": [_container("a", 20, 2), _container("b", 30, 1)]}
    else:
        spec = {"initContainers": [_container("init", 20, 1)], "containers": [_container("c", 20, 1)]}
    return {"metadata": {"name": name, "namespace": "default", "labels": {"kind": kind}}, "spec": spec}


class Chaos:
    def __init__(self, root: Path, *, lifecycles: int, seed: int, disrupt_every: float, freeze: float,
                 bound: float, room_check: bool, freeze_share: float = 0.2, workers: int = 3,
                 log: Any = print) -> None:
        self.root = root
        self.lifecycles = lifecycles
        self.rng = random.Random(seed)
        # the schedule draws from its own generator, so that a seed names the same disruptions
        # however the workers' draws interleave with it
        self.chaos_rng = random.Random(seed * 7919 + 1)
        self.due = float("inf")                   # lifecycles at which the next disruption is due
        self.disrupt_every = disrupt_every
        self.freeze_share = freeze_share
        self.freeze = freeze
        self.bound = bound
        self.room_check = room_check
        self.workers = workers
        self.log = log
        self.report = Report(seed=seed)
        self.deleted_at: dict[str, float] = {}  # pod uid -> when its deletion was asked
        self.deleted_wall: dict[str, int] = {}  # the same, unix nanoseconds (the log's clock)
        self.whole_since = time.monotonic()      # the node was last whole (no process down) since then
        self.disrupted = 0                        # processes down or frozen now
        self.whole = asyncio.Event()              # set while none is
        self.whole.set()
        self.created = asyncio.Event()           # pulses on each pod creation (mid-Allocate kills)
        self.done = False
        self.sim: NodeSimulator | None = None
        self.launcher: Launcher | None = None
        self.settings: Settings | None = None

    # --- set-up ---
    async def start(self) -> None:
        r = self.root
        self.sim = NodeSimulator(SimConfig(
            node_name=NODE, device_plugin_dir=r / "dp", pod_resources_socket=r / "pr" / "kubelet.sock",
            kubeconfig_path=r / "kubeconfig", seed=self.rng.randrange(1 << 30)))
        await self.sim.start()
        settings = Settings(
            node_name=NODE, state_dir=str(r / "state"), device_plugin_dir=str(r / "dp"),
            pod_resources_socket=str(r / "pr" / "kubelet.sock"), kubeconfig=str(r / "kubeconfig"),
            gpus="fake", allocate_timeout=5.0, request_timeout=3.0, log_format="json",
            cgroup_root=str(r / "cgroup"), proc_root=str(r / "proc"), driver_volumes=False)
        self.launcher = Launcher(settings, embedded_nats=True, log_dir=r / "logs")
        await self.launcher.start_nats()
        await self.launcher.start_services()
        self.settings = self.launcher.settings
        await self.sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=90)

    async def stop(self) -> None:
        if self.launcher is not None:
            await self.launcher.stop()
        if self.sim is not None:
            await self.sim.stop()

    def _pid(self, name: str) -> int | None:
        assert self.launcher is not None
        if name == BROKER:
            return self.launcher.nats.pid if self.launcher.nats else None
        return next(c.pid for c in self.launcher.children if c.name == name)

    # --- the lifecycles ---
    async def worker(self, queue: asyncio.Queue[int]) -> None:
        assert self.sim is not None
        while True:
            await self.paced()
            try:
                n = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            rng = random.Random(self.rng.randrange(1 << 30))
            manifest = random_pod(rng, f"p{n}")
            created = await self.sim.create_pod(manifest)
            self.created.set()
            self.created.clear()
            uid = created["metadata"]["uid"]
            try:
                pod = await self.sim.wait_for_pod(
                    "default", f"p{n}", lambda p: p["status"].get("phase") in ("Running", "Failed"), 60)
            except TimeoutError as exc:  # e.g. admitted, but PreStartContainer finds no allocation
                self.report.violation(f"p{n} ({manifest['metadata']['labels']['kind']}) stuck: {str(exc)[-400:]}")
                pod = self.sim.get_pod("default", f"p{n}") or created
            if pod["status"]["phase"] == "Running":
                self.report.running += 1
                await asyncio.sleep(rng.uniform(0, 0.5))
            else:
                self._refused(pod, manifest)
            self.deleted_wall[uid] = time.time_ns()  # just before: the kubelet lets go from here on
            await self.sim.delete_pod("default", f"p{n}")
            self.deleted_at[uid] = time.monotonic()
            self.report.lifecycles += 1
            if pod["status"]["phase"] != "Running":  # do not burn the lifecycles while a process is away
                await asyncio.wait_for(self.whole.wait(), 90)
                # ...nor while the node is full: a refused pod's worker pauses as a real controller's
                # backoff would, so that running pods end and the lifecycles meet the disruptions
                await asyncio.sleep(rng.uniform(0.2, 0.5))

    def _refused(self, pod: dict[str, Any], manifest: dict[str, Any]) -> None:
        message = pod["status"].get("message", "")
        if "requested number of devices unavailable" in message:
            cause = "no room in the kubelet's own view"  # the kubelet refused before asking us
        elif "no free node" in message:
            cause = "no room"
            if self._kubelet_had_room(pod["metadata"]["uid"], manifest):
                self.report.room_refusals.append(f"{pod['metadata']['name']}: {message}")
                cause = "no room (the kubelet had room)"
        elif "no healthy devices" in message:
            cause = "the device plugin away (the kubelet refused)"
        elif any(w in message.lower() for w in UNAVAILABLE):
            cause = "a process away (bounded error)"
        else:
            cause = message[:80]
        self.report.failed[cause] += 1

    def _kubelet_had_room(self, uid: str, manifest: dict[str, Any]) -> bool:
        """Would the pod have fit, when it was refused, if only the pods the kubelet ran then held GPUs?

        Judged at the refusal (its ``alloc.refused`` event), not when the worker sees the pod failed:
        meanwhile other workers delete their pods, and their room, free now, was not free then. The
        kubelet ran then what it runs now and what was deleted after the refusal."""
        assert self.sim is not None
        snap, refused_at = self.fold_until_refusal(uid)
        active = self.sim.kubelet.active_pod_uids() | {
            u for u, at in self.deleted_wall.items() if refused_at is not None and at > refused_at}
        active -= {uid}
        cores: dict[int, int] = {g.index: 0 for g in snap.gpus}
        memory: dict[int, int] = {g.index: 0 for g in snap.gpus}
        total = {g.index: g.memory_total for g in snap.gpus}
        for a in snap.allocations:
            if a.pod_uid in active and a.charged:
                for s in a.shares:
                    cores[s.index] += s.cores
                    memory[s.index] += s.memory
        for c in manifest["spec"]["containers"]:
            limits = c["resources"]["limits"]
            want, mem = int(limits["tencent.com/vcuda-core"]), int(limits.get("tencent.com/vcuda-memory", 0))
            if want >= 100:
                free = [i for i in cores if cores[i] == 0]
                if len(free) < want // 100:
                    return False
                for i in free[: want // 100]:
                    cores[i], memory[i] = 100, total[i]
            else:
                fit = [i for i in cores if cores[i] + want <= 100 and memory[i] + mem * MEMORY_BLOCK <= total[i]]
                if not fit:
                    return False
                cores[fit[0]] += want
                memory[fit[0]] += mem * MEMORY_BLOCK
        return True

    # --- the chaos ---
    async def chaos(self) -> None:
        """A disruption every ``disrupt_every`` lifecycles on average (spacing 0.5x..1.5x), at a random
        moment: half just after a pod was created (mid-Allocate), half up to a second later."""
        rng = self.chaos_rng
        order: list[str] = []
        self.due = rng.uniform(0.5, 1.5) * self.disrupt_every
        while not self.done:
            if self.report.lifecycles < self.due:
                await asyncio.sleep(0.05)
                continue
            self.due += rng.uniform(0.5, 1.5) * self.disrupt_every
            if not order:
                order = list(PROCESSES)
                rng.shuffle(order)
            name = order.pop()
            freeze = rng.random() < self.freeze_share
            if rng.random() < 0.5:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.created.wait(), 5)
                await asyncio.sleep(rng.uniform(0, 0.05))
            else:
                await asyncio.sleep(rng.uniform(0, 1.0))
            await self.disrupt(name, freeze)

    async def paced(self) -> None:
        """Wait while the lifecycles run more than one spacing ahead of the disruptions: a disruption
        waits for its recovery, and on a slow machine the pods would otherwise finish before the schedule
        had made its disruptions (CI once ran 150 lifecycles with 14 kills where 20 were due)."""
        for _ in range(600):  # 30 s at most: a schedule stuck in a recovery must not stop the pods
            if self.done or self.report.lifecycles < self.due + self.disrupt_every:
                return
            await asyncio.sleep(0.05)

    async def disrupt(self, name: str, freeze: bool) -> None:
        pid = self._pid(name)
        if pid is None:
            return
        self.disrupted += 1
        self.whole.clear()
        try:
            if freeze:
                self.report.freezes[name] += 1
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(self.freeze)
                os.kill(pid, signal.SIGCONT)
            else:
                self.report.kills[name] += 1
                os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            took = await self.recovered(name, pid if freeze else None, t0, killed=None if freeze else pid)
            if took is None:
                self.report.violation(f"{name} not back within 60 s after {'SIGCONT' if freeze else 'SIGKILL'}")
            else:
                self.report.recovery[name].append(took)
                self.log(f"  {'froze' if freeze else 'killed'} {name}: back in {took:.2f} s")
        finally:
            self.disrupted -= 1
            if not self.disrupted:
                self.whole_since = time.monotonic()
                self.whole.set()

    async def recovered(self, name: str, same_pid: int | None, t0: float, *, killed: int | None = None) -> float | None:
        """Seconds until the process runs (``same_pid`` after a freeze; not ``killed`` after a kill: until
        the launcher has reaped it, the killed process's subscriptions may still take the probe's
        request, which then times out) and answers its probe."""
        assert self.settings is not None
        while time.monotonic() - t0 < 60:
            pid = self._pid(name)
            if (pid is not None and pid != killed and (same_pid is None or pid == same_pid)
                    and process_alive(pid)):
                probes = [PROBE_NAMES.get(name, name)] + (["allocator"] if name == BROKER else [])
                results = await asyncio.gather(*(health_check(p, self.settings, 1.0) for p in probes))
                if all(r is None for r in results):
                    return time.monotonic() - t0
            await asyncio.sleep(0.05)
        return None

    # --- the checks ---
    def fold(self) -> LedgerSnapshot:
        assert self.settings is not None
        state = LedgerState()
        conn = open_reader(self.settings.log_path)
        try:
            for stored in iter_events(conn):
                state.apply(stored)
        finally:
            conn.close()
        return state.snapshot()

    def fold_until_refusal(self, uid: str) -> tuple[LedgerSnapshot, int | None]:
        """The ledger just before the pod's last refusal, and that refusal's time (None: no refusal
        logged, the ledger now)."""
        assert self.settings is not None
        state, before, refused_at = LedgerState(), None, None
        conn = open_reader(self.settings.log_path)
        try:
            for stored in iter_events(conn):
                if isinstance(stored.event, AllocationRefused) and stored.event.pod_uid == uid:
                    before, refused_at = state.snapshot(), stored.recorded_at
                state.apply(stored)
        finally:
            conn.close()
        return (before if before is not None else state.snapshot()), refused_at

    def check(self) -> None:
        assert self.sim is not None
        snap = self.fold()
        for g in snap.gpus:
            if g.cores_used > 100 or g.memory_used > g.memory_total:
                self.report.violation(f"GPU {g.index} overcommitted: {g.cores_used} cores, {g.memory_used} bytes")
        held: dict[tuple[str, str], set[str]] = defaultdict(set)
        for a in snap.allocations:
            held[(a.pod_uid, a.container)] |= set(a.device_ids)
        for pod in self.sim.store.list():
            if pod["status"].get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
                continue
            uid = pod["metadata"]["uid"]
            for c in pod["spec"]["containers"]:
                given = set(self.sim.allocated_device_ids(uid, c["name"], RESOURCE_VCORE))
                if given and not given <= held.get((uid, c["name"]), set()):
                    self.report.violation(f"lost grant: {pod['metadata']['name']}/{c['name']} runs on devices "
                                          f"the ledger does not hold for it")
        if not self.disrupted:
            now = time.monotonic()
            for a in snap.allocations:
                gone = self.deleted_at.get(a.pod_uid)
                if gone is not None and now - max(gone, self.whole_since) > self.bound:
                    self.report.violation(f"allocation {a.alloc_id} of {a.pod_name} outlived its pod by "
                                          f"{now - gone:.1f} s ({now - self.whole_since:.1f} s since recovery)")

    async def checker(self) -> None:
        while not self.done:
            await asyncio.sleep(CHECK_EVERY_S)
            self.check()

    async def final_checks(self) -> None:
        assert self.settings is not None and self.launcher is not None
        for name in PROCESSES:  # every killed process is back
            if await self.recovered(name, None, time.monotonic()) is None:
                self.report.violation(f"{name} is not running at the end")
        deadline = time.monotonic() + self.bound + 5
        while self.fold().allocations and time.monotonic() < deadline:  # noqa: ASYNC110 (a file another process writes)
            await asyncio.sleep(0.2)
        self.check()
        left = self.fold().allocations
        if left:
            self.report.violation(f"{len(left)} allocations left after every pod was deleted")
        state_dir = self.settings.state_dir
        replayed = json.loads(_gpuledger("replay", "--json", "--state-dir", state_dir))
        folded = self.fold()
        ours = sorted((a.alloc_id, a.pod_uid, a.container) for a in folded.allocations)
        theirs = sorted((a["alloc_id"], a["pod_uid"], a["container"]) for a in replayed["allocations"])
        if replayed["seq"] != folded.seq or ours != theirs:
            self.report.violation(f"the log folded (seq {folded.seq}) differs from gpuledger replay "
                                  f"(seq {replayed['seq']})")
        verify = subprocess.run(  # noqa: ASYNC221 (at the end, nothing else runs)
            [sys.executable, "-m", "gpuledger", "audit", "verify", "--state-dir", state_dir],
                                capture_output=True, text=True, timeout=120)
        if verify.returncode != 0:
            self.report.violation(f"audit verify failed: {(verify.stdout + verify.stderr).strip()[-300:]}")
        if self.room_check and self.report.room_refusals:
            self.report.violation(f"{len(self.report.room_refusals)} pods refused while the kubelet had room: "
                                  f"{self.report.room_refusals[:3]}")

    async def run(self) -> Report:
        started = time.monotonic()
        await self.start()
        try:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for n in range(self.lifecycles):
                queue.put_nowait(n)
            chaos = asyncio.create_task(self.chaos())
            checker = asyncio.create_task(self.checker())
            try:
                await asyncio.gather(*(self.worker(queue) for _ in range(self.workers)))
            finally:
                self.done = True
                for task in (chaos, checker):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                for name in PROCESSES:  # nothing stays frozen
                    pid = self._pid(name)
                    if pid:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGCONT)
            self.disrupted = 0
            await self.final_checks()
        finally:
            await self.stop()
        self.report.seconds = time.monotonic() - started
        return self.report


def _gpuledger(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "gpuledger", *args], capture_output=True, text=True,
                          timeout=120, check=True).stdout


async def run_chaos(*, lifecycles: int, seed: int, disrupt_every: float, freeze: float, bound: float,
                    room_check: bool, root: Path | None = None, keep: bool = False, log: Any = print) -> Report:
    """``keep``: leave the run's directory (state dir, service logs) in place and name it, to read after."""
    tmp = Path(tempfile.mkdtemp(prefix="chaos-", dir=None if root is None else root))
    try:
        chaos = Chaos(tmp, lifecycles=lifecycles, seed=seed, disrupt_every=disrupt_every, freeze=freeze,
                      bound=bound, room_check=room_check, log=log)
        return await chaos.run()
    finally:
        if keep:
            log(f"chaos: the run's state and logs are kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lifecycles", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--disrupt-every", type=float, default=8.0, help="mean lifecycles between disruptions")
    ap.add_argument("--freeze", type=float, default=3.0, help="seconds a frozen process stays stopped")
    ap.add_argument("--bound", type=float, default=5.0, help="recovery bound for a dead pod's allocation (s)")
    ap.add_argument("--keep", action="store_true", help="keep the run's state dir and service logs")
    ap.add_argument("--no-room-check", dest="room_check", action="store_false",
                    help="report, without failing, pods refused while the kubelet had room")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    print(f"chaos: seed {seed}, {args.lifecycles} lifecycles", flush=True)
    configure_logging("chaos", level="warning")  # the simulator and the launcher, in this process
    report = asyncio.run(run_chaos(lifecycles=args.lifecycles, seed=seed, disrupt_every=args.disrupt_every,
                                   freeze=args.freeze, bound=args.bound, room_check=args.room_check,
                                   keep=args.keep, log=lambda s: print(s, flush=True)))
    print(json.dumps(report.summary(), indent=1))
    if report.violations:
        print(f"FAILED: seed {seed} (repeat with --seed {seed})", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
