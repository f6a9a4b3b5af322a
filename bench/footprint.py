"""Idle footprint of the agent: RSS and PSS of each process, and idle CPU, as ``gpuledger up`` runs it.

Starts the node simulator (``gpuledger sim``: a kubelet to register with, an API server to watch) and
then ``gpuledger up`` with its embedded nats-server and fake GPUs, against it, with metrics on, and with a
container runtime endpoint, as deploy/ gives the vmanager one (its runtime client is made at start;
the socket need not exist: nothing is asked until a container registers). Once
every service serves /metrics and the registrar has registered both resources with the kubelet, it
waits ``--settle`` seconds, reads ``/proc/<pid>/smaps_rollup`` (Rss, Pss) of the broker and each
service, and the CPU time (utime + stime from ``/proc/<pid>/stat``) each spends over ``--seconds``.
It does so twice on the same state directory: the first start creates the log (over
``--first-seconds``), the second is a node's steady state (the report's table; the first start's
total is printed below it). The second's window is 60 s by default: CPU time is counted in 10 ms
ticks, and the idle services use a few ticks a second between them, so a 20 s window moves in
coarse steps and a passing disturbance weighs three times as much (one ``make bench`` run read
1.25 % over 20 s right after the Allocate benchmark, every process about twice its usual, the
simulator too; alone, 0.6 %).
The launcher (``gpuledger up`` itself, which only supervises) and the simulator are listed apart and
not counted in the total: the total is what a node pays for the agent, the four services and the broker.

    python -m bench.footprint [--settle 5] [--seconds 60] [--first-seconds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.allocate_rtt import free_base_port
from bench.machine import describe

SERVICES = ("allocator", "registrar", "vmanager", "watchdog")
TICKS = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out.extend(int(p) for p in text)
    return out


def role(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    words = [a.decode() for a in argv if a]
    if any("nats-server" in w for w in words):
        return "nats-server (broker)"
    for svc in SERVICES:
        if svc in words:
            return svc
    return " ".join(words)[:60]


def memory(pid: int) -> tuple[int, int]:
    """(Rss, Pss) in kB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return fields["Rss"], fields["Pss"]


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    after = stat.rsplit(")", 1)[1].split()
    return (int(after[11]) + int(after[12])) / TICKS  # utime, stime


def wait_until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    until = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > until:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def serves(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def registered(api: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api}/simulator/v1/resources", timeout=2) as resp:
            found = json.loads(resp.read())
    except OSError:
        return False
    text = json.dumps(found)
    return "tencent.com/vcuda-core" in text and "tencent.com/vcuda-memory" in text


def stop(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure(gpuledger: str, work: Path, api: str, sim_pid: int, *, settle: float, seconds: float
            ) -> list[dict[str, object]]:
    """Start ``gpuledger up``, wait until idle, measure, stop it; one row per process."""
    quiet = {"stdout": subprocess.DEVNULL, "stderr": open(work / "logs.txt", "ab")}  # noqa: SIM115
    up: subprocess.Popen[bytes] | None = None
    try:
        base = free_base_port()
        up = subprocess.Popen([gpuledger, "up", "--node-name", "fp-node", "--state-dir", str(work / "state"),
                               "--device-plugin-dir", str(work / "dp"), "--pod-resources-socket",
                               str(work / "pr.sock"), "--kubeconfig", str(work / "kubeconfig"), "--gpus", "fake",
                               "--metrics-port", str(base), "--log-level", "info",
                               "--container-runtime-endpoint", "/run/containerd/containerd.sock"],
                              **quiet)  # type: ignore[call-overload]
        wait_until(lambda: all(serves(base + i) for i in range(4)), 90, "every service's /metrics")
        wait_until(lambda: registered(api), 60, "the registrar's registration with the kubelet")
        time.sleep(settle)
        pids = {role(p): p for p in children(up.pid)}
        pids_all = {**pids, "gpuledger up (launcher, not counted)": up.pid, "simulator (not counted)": sim_pid}
        start = {name: cpu_seconds(pid) for name, pid in pids_all.items()}
        t0 = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        rows = []
        for name, pid in pids_all.items():
            rss, pss = memory(pid)
            cpu = (cpu_seconds(pid) - start[name]) / elapsed * 100
            rows.append({"process": name, "pid": pid, "rss_mb": round(rss / 1024, 1),
                         "pss_mb": round(pss / 1024, 1), "cpu_percent": round(cpu, 2), "counted": name in pids})
    finally:
        if up is not None:
            stop(up, signal.SIGINT)
    return rows


def totals(rows: list[dict[str, object]]) -> dict[str, float]:
    counted = [r for r in rows if r["counted"]]
    return {"rss_mb": round(sum(r["rss_mb"] for r in counted), 1),  # type: ignore[misc]
            "pss_mb": round(sum(r["pss_mb"] for r in counted), 1),  # type: ignore[misc]
            "cpu_percent": round(sum(r["cpu_percent"] for r in counted), 2)}  # type: ignore[misc]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds to wait once started, before measuring")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="seconds over which idle CPU is measured at the second start (the steady state)")
    parser.add_argument("--first-seconds", type=float, default=20.0,
                        help="the same at the first start")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="glfp", dir="/tmp"))
    gpuledger = str(Path(sys.executable).with_name("gpuledger"))
    quiet = {"stdout": subprocess.DEVNULL, "stderr": open(work / "logs.txt", "wb")}  # noqa: SIM115
    sim = subprocess.Popen([gpuledger, "sim", "--node-name", "fp-node", "--device-plugin-dir", str(work / "dp"),
                            "--pod-resources-socket", str(work / "pr.sock"), "--kubeconfig-out",
                            str(work / "kubeconfig"), "--log-level", "warning"], **quiet)  # type: ignore[call-overload]
    try:
        wait_until(lambda: (work / "kubeconfig").exists(), 60, "the simulator's kubeconfig")
        api = next(line.split("server:", 1)[1].strip() for line in (work / "kubeconfig").read_text().splitlines()
                   if "server:" in line)
        first = measure(gpuledger, work, api, sim.pid, settle=args.settle, seconds=args.first_seconds)
        rows = measure(gpuledger, work, api, sim.pid, settle=args.settle, seconds=args.seconds)
    except BaseException:
        print(f"the services' logs: {work / 'logs.txt'}", file=sys.stderr)  # kept for a failed run only
        raise
    finally:
        stop(sim, signal.SIGTERM)
        quiet["stderr"].close()
    shutil.rmtree(work, ignore_errors=True)
    total, first_total = totals(rows), totals(first)
    load = os.getloadavg()
    print("Second start (the log exists: the steady state of a node; the first start is below)\n")
    print(f"| process | RSS MB | PSS MB | idle CPU % of one core ({args.seconds:g} s) |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['process']} | {r['rss_mb']} | {r['pss_mb']} | {r['cpu_percent']} |")
    print(f"| **total: four services + broker** | **{total['rss_mb']}** | **{total['pss_mb']}** "
          f"| **{total['cpu_percent']}** |")
    print(f"\nFirst start (creates the log): four services + broker RSS {first_total['rss_mb']} MB, "
          f"PSS {first_total['pss_mb']} MB, idle CPU {first_total['cpu_percent']}% of one core "
          f"({args.first_seconds:g} s)")
    print(f"\n({describe()}, "
          f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f})")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "total": total, "first_start": first_total}, indent=2))


if __name__ == "__main__":
    main()
