"""Allocate as the kubelet sees it: gpuledger next to a bare device plugin, in one run, idle and loaded.

Three kinds of processes, none sharing an interpreter with another:
- the kubelet (bench/kubelet_driver.py): the node simulator's API server and kubelet device manager,
  its own gRPC client timing each Allocate from call to reply, pods admitted one at a time;
- gpuledger: the embedded-style NATS server and the four services as separate processes, as
  ``gpuledger up`` runs them (log on disk, ``synchronous=FULL``);
- the floor: the repo's bare echo device plugin (bench/echo_plugin.py), which answers Allocate at once
  with a response of the same shape, registered with the same kubelet;
- the durable floor, what the product's promise costs at least: the same echo plugin making one NATS
  request first, answered by bench/echo_ledger.py after one fsync'd SQLite append (a bare plugin plus
  one bus round trip and one durable append, the issue's "about 1.3x").

Each phase runs the same request sequence against all three: pods take turns (ours, echo, ours,
durable echo, ours, ...), so whatever the machine does meanwhile falls on all; ours are timed twice
as often as each floor. Phases: ``idle`` (nothing added), ``loaded``
(one busy-looping process per CPU core, started by this benchmark, each in a scheduling group of its own
like every process here: see start_burners). After each phase the registrar's
and the allocator's ``/metrics`` are scraped and the per-hop histograms (registrar total, bus round
trip, allocator decide, append+fsync, reply) are printed as the phase's difference, and the slowest 2 %
of our Allocates are split leg by leg from the services' own log lines (bench/allocate_tail.py). The
p99 ratio to the bare plugin comes with its 95 % interval over the run (``ratio_interval``). The
fsync'd append of each grant, as the allocator timed it, is set beside the durable floor's own append,
as its ledger timed it: what a durable append takes on this machine in this phase, whoever makes it.

    python -m bench.allocate_rtt [--pods 2000] [--warmup 50] [--load both|idle|loaded] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import nats
from prometheus_client.parser import text_string_to_metric_families

from bench.allocate_tail import log_size, phase_tail
from bench.echo_ledger import APPENDS_SUBJECT
from bench.machine import describe
from gpuledger.launcher import Launcher
from libs.bus.server import NatsServer
from libs.config import Settings
from libs.lifeline import start_in_own_session, with_lifeline
from libs.logger import configure_logging
from libs.metrics import PORT_OFFSETS

NODE = "bench-node"
HOP_METRIC = "gpuledger_allocate_hop_duration_seconds"
HOPS = ("registrar_total", "bus_round_trip", "check", "decide", "append_fsync", "confirm", "reply")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(name: str, seconds: list[float]) -> dict[str, float | str | int]:
    ms = [s * 1000 for s in seconds]
    return {"name": name, "n": len(ms), "p50_ms": round(percentile(ms, 0.50), 3),
            "p99_ms": round(percentile(ms, 0.99), 3), "p999_ms": round(percentile(ms, 0.999), 3),
            "mean_ms": round(sum(ms) / len(ms), 3)}


def ratios(row: dict[str, float | str | int], floor: dict[str, float | str | int]) -> dict[str, float]:
    return {q: round(row[f"{q}_ms"] / floor[f"{q}_ms"], 2) for q in ("p50", "p99", "p999")}  # type: ignore[operator]


def ratio_interval(ours: list[float], floor: list[float], *, q: float = 0.99, block: int = 50,
                   rounds: int = 1000, seed: int = 1) -> tuple[float, float]:
    """The 95 % interval of ours' ``q`` percentile over the floor's, by a block bootstrap over the run.

    The Allocates come in sequence (two of ours to each floor's, kubelet_driver.run_phase), and the
    machine's pace drifts through a phase: the loaded p99 ratio moved by 0.2-0.3 between runs. So
    blocks of ``block`` consecutive floor Allocates, each with the ``2 * block`` of ours made
    beside them, are resampled whole with replacement: the interval shows how far one run's figure
    stands from the goal given the ups and downs inside that run (not how another day would go)."""
    if len(ours) != 2 * len(floor) or len(floor) < block:
        raise ValueError(f"need two of ours per floor Allocate and at least {block} of the floor's: "
                         f"{len(ours)} and {len(floor)}")
    blocks = len(floor) // block
    rng = random.Random(seed)
    found = []
    for _ in range(rounds):
        picks = [rng.randrange(blocks) for _ in range(blocks)]
        mine = [v for b in picks for v in ours[2 * b * block:2 * (b + 1) * block]]
        theirs = [v for b in picks for v in floor[b * block:(b + 1) * block]]
        found.append(percentile(mine, q) / percentile(theirs, q))
    return round(percentile(found, 0.025), 2), round(percentile(found, 0.975), 2)


# --- the per-hop histograms ---------------------------------------------------------------------

Buckets = dict[str, dict[float, float]]  # hop -> upper bound -> cumulative count (sum under "sum")


async def scrape_hops(ports: list[int]) -> Buckets:
    out: Buckets = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for port in ports:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
            for fam in text_string_to_metric_families(text):
                if fam.name != HOP_METRIC:
                    continue
                for s in fam.samples:
                    hop = out.setdefault(s.labels["hop"], {})
                    if s.name.endswith("_bucket"):
                        hop[float(s.labels["le"])] = s.value
                    elif s.name.endswith("_sum"):
                        hop[-1.0] = s.value  # the sum, kept under a bound no bucket has
    return out


async def wait_for_metrics(ports: list[int], timeout: float) -> None:
    """Until every service's /metrics answers (they serve it once started)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while True:
        try:
            await scrape_hops(ports)
            return
        except aiohttp.ClientError:
            if loop.time() > until:
                raise
            await asyncio.sleep(0.2)


def hop_rows(before: Buckets, after: Buckets) -> list[dict[str, object]]:
    """Per hop, the phase's count, mean and bucket-bound p50/p99 (the difference of two scrapes)."""
    rows = []
    for hop in HOPS:
        a, b = after.get(hop, {}), before.get(hop, {})
        diff = {le: a[le] - b.get(le, 0.0) for le in a}
        total = diff.get(float("inf"), 0.0)
        if total <= 0:
            continue

        def quantile(q: float, diff: dict[float, float] = diff, total: float = total) -> float:
            for le in sorted(k for k in diff if k >= 0):
                if diff[le] >= q * total:
                    return le
            return float("inf")

        rows.append({"hop": hop, "n": int(total), "mean_ms": round(diff.get(-1.0, 0.0) / total * 1000, 3),
                     "p50_le_ms": round(quantile(0.5) * 1000, 3), "p99_le_ms": round(quantile(0.99) * 1000, 3)})
    return rows


async def floor_appends(url: str) -> list[float]:
    """The durable floor's appends (ms) since the last call, as its ledger timed them."""
    client = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        reply = await client.request(APPENDS_SUBJECT, b"", timeout=10)
    finally:
        await client.close()
    return [float(ms) for ms in json.loads(reply.data)]


def append_rows(ours_ms: list[float], floor_ms: list[float]) -> list[dict[str, float | str | int]]:
    """The summary of each durable append: ours (the allocator's grants) and the durable floor's."""
    return [summary(name, [ms / 1000 for ms in values])
            for name, values in (("gpuledger's allocator, each grant (its `granted` lines)", ours_ms),
                                 ("the durable floor's ledger, each append", floor_ms)) if values]


# --- load ---------------------------------------------------------------------------------------

# Every process this benchmark starts runs in a session of its own, as gpuledger's services and broker
# do (gpuledger/launcher.py), and dies with the benchmark. Linux schedules a session as one group
# (autogroup, on by default): sharing the benchmark's session, the busy loops held the simulated kubelet
# and the floors' plugins to a third of one group's CPU, where on a node the load runs in pods' cgroups
# and the kubelet in its own. Each in its own group, the result is also that of a kernel without
# autogroup (docs/benchmarks.md, fourth round). The others start through start_in_own_session.
def start_burners() -> list[subprocess.Popen[bytes]]:
    """One busy-looping process per CPU core (the load of the ``loaded`` phase)."""
    return [subprocess.Popen(with_lifeline([sys.executable, "-c", "while True: pass"]), start_new_session=True)
            for _ in range(os.cpu_count() or 1)]


def stop_burners(burners: list[subprocess.Popen[bytes]]) -> None:
    for b in burners:
        b.terminate()
    for b in burners:
        b.wait(5)


def free_base_port() -> int:
    """A base port with the three after it free too (the services' metrics ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base > 65500:
            continue
        try:
            for off in range(1, 4):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
        except OSError:
            continue
        return base
    raise RuntimeError("no four consecutive free ports")


# --- the run ------------------------------------------------------------------------------------

async def start_helper(module: str, *args: str, started: list[asyncio.subprocess.Process]) -> None:
    """``python -m module args`` (a floor: bench/echo_*.py), dying with this process, appended to
    ``started`` at once (the caller stops it), once it has printed "ready"."""
    helper = await start_in_own_session([sys.executable, "-m", module, *args], stdout=subprocess.PIPE)
    started.append(helper)
    assert helper.stdout
    if (await asyncio.wait_for(helper.stdout.readline(), 60)).strip() != b"ready":
        raise RuntimeError(f"{module} {' '.join(args)} did not start")


async def stop_helpers(started: list[asyncio.subprocess.Process]) -> None:
    """SIGTERM each helper still running; SIGKILL one that has not ended 10 s later."""
    for helper in started:
        if helper.returncode is None:
            helper.terminate()
            try:
                await asyncio.wait_for(helper.wait(), 10)
            except TimeoutError:
                helper.kill()
                await helper.wait()


async def run(pods: int, warmup: int, phases: list[str], workdir: Path, log_level: str) -> dict[str, object]:
    driver = await start_in_own_session(
        [sys.executable, "-m", "bench.kubelet_driver", str(workdir), NODE],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=1 << 24)  # a phase's times are one long line
    assert driver.stdin and driver.stdout
    nats = NatsServer(workdir / "nats")
    base = free_base_port()
    launcher: Launcher | None = None
    helpers: list[asyncio.subprocess.Process] = []  # the echo ledger and the two echo plugins
    results: dict[str, object] = {}
    try:
        if (await asyncio.wait_for(driver.stdout.readline(), 60)).strip() != b"ready":
            raise RuntimeError("the kubelet driver did not start")
        await nats.start()
        settings = Settings(node_name=NODE, state_dir=str(workdir / "state"), device_plugin_dir=str(workdir / "dp"),
                            pod_resources_socket=str(workdir / "pr" / "kubelet.sock"),
                            kubeconfig=str(workdir / "kubeconfig"), nats_url=nats.url, gpus="fake",
                            log_format="json", log_level=log_level, metrics_port=base, metrics_host="127.0.0.1")
        launcher = Launcher(settings, embedded_nats=False, log_dir=workdir / "logs")
        await launcher.start_services()
        for module, *args in (("bench.echo_ledger", str(workdir / "echo.db"), nats.url),
                              ("bench.echo_plugin", str(workdir / "dp")),
                              ("bench.echo_plugin", str(workdir / "dp"), "--bus", nats.url)):
            await start_helper(module, *args, started=helpers)
        ports = [base + PORT_OFFSETS["registrar"], base + PORT_OFFSETS["allocator"]]
        await wait_for_metrics(ports, 60)
        for phase in phases:
            print(f"phase {phase}: {pods} + {warmup} warm-up Allocates per floor, twice that of ours",
                  file=sys.stderr, flush=True)
            burners = start_burners() if phase == "loaded" else []
            logs = {svc: workdir / "logs" / f"{svc}.log" for svc in ("registrar", "allocator")}
            try:
                starts = {svc: log_size(path) for svc, path in logs.items()}
                before = await scrape_hops(ports)
                driver.stdin.write(json.dumps({"pods": pods, "warmup": warmup}).encode() + b"\n")
                await driver.stdin.drain()
                line = await asyncio.wait_for(driver.stdout.readline(), 3600)
                after = await scrape_hops(ports)
                marks = {svc: (starts[svc], log_size(path)) for svc, path in logs.items()}
            finally:
                stop_burners(burners)
            if not line:
                raise RuntimeError("the kubelet driver stopped (see its stderr above)")
            times = json.loads(line)
            ours = summary("gpuledger (registrar -> NATS -> allocator -> fsync -> reply)", times["ours"])
            bare = summary("bare echo device plugin (floor)", times["bare"])
            durable = summary("echo plugin + one NATS round trip + one fsync'd append (durable floor)",
                              times["durable"])
            tail = phase_tail(workdir / "logs", marks)
            appends = append_rows(tail.pop("appends_ms"), await floor_appends(nats.url))  # type: ignore[arg-type]
            results[phase] = {"rows": [ours, bare, durable], "to_bare": ratios(ours, bare),
                              "to_bare_p99_interval": ratio_interval(times["ours"], times["bare"]),
                              "to_durable": ratios(ours, durable), "durable_to_bare": ratios(durable, bare),
                              "hops": hop_rows(before, after), "tail": tail, "appends": appends}
    finally:
        driver.stdin.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(driver.wait(), 20)
        if driver.returncode is None:
            driver.kill()
            await driver.wait()
        await stop_helpers(helpers)
        if launcher is not None:
            await launcher.stop()
        await nats.stop()
    return results


def report(results: dict[str, object]) -> None:
    for phase, res in results.items():
        if phase == "machine":
            continue
        assert isinstance(res, dict)
        print(f"\n## {phase}\n\n| Allocate as the kubelet sees it | n | p50 ms | p99 ms | p99.9 ms | mean ms |")
        print("|---|---:|---:|---:|---:|---:|")
        for row in res["rows"]:
            print(f"| {row['name']} | {row['n']} | {row['p50_ms']} | {row['p99_ms']} | {row['p999_ms']} "
                  f"| {row['mean_ms']} |")
        low, high = res["to_bare_p99_interval"]  # the goal's figure: its spread within the run
        for label, key, within in (
                ("gpuledger to the bare plugin", "to_bare", f" (95 % interval over the run's blocks {low}-{high}x)"),
                ("gpuledger to the durable floor", "to_durable", ""),
                ("the durable floor to the bare plugin", "durable_to_bare", "")):
            r = res[key]
            print(f"{label}: p50 {r['p50']}x, p99 {r['p99']}x{within}, p99.9 {r['p999']}x")
        print("\n| hop (from /metrics) | n | mean ms | p50 <= ms | p99 <= ms |\n|---|---:|---:|---:|---:|")
        for h in res["hops"]:
            print(f"| {h['hop']} | {h['n']} | {h['mean_ms']} | {h['p50_le_ms']} | {h['p99_le_ms']} |")
        if res["appends"]:
            print("\n| the fsync'd append, as the appender timed it | n | p50 ms | p99 ms | mean ms |"
                  "\n|---|---:|---:|---:|---:|")
            for row in res["appends"]:
                print(f"| {row['name']} | {row['n']} | {row['p50_ms']} | {row['p99_ms']} | {row['mean_ms']} |")
        tail = res["tail"]
        if tail["legs"]:
            print(f"\n| the slowest {tail['share']:.0%} of ours, leg by leg ({tail['joined']} joined log lines) "
                  "| faster half, mean ms | slowest, mean ms | added ms |\n|---|---:|---:|---:|")
            for leg in tail["legs"]:
                print(f"| {leg['leg']} | {leg['fast_half_ms']} | {leg['slowest_ms']} | {leg['added_ms']} |")
    print(f"\n({results['machine']})")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=2000,
                        help="measured Allocates per floor and phase (twice as many of ours)")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--load", choices=("both", "idle", "loaded"), default="both",
                        help="idle: nothing added; loaded: one busy process per core; both: idle, then loaded")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--log-level", default="info",
                        help="the services' log level (info, as deployed; their logs stay in the work dir)")
    args = parser.parse_args()
    configure_logging("bench", fmt="console", level="warning")
    phases = ["idle", "loaded"] if args.load == "both" else [args.load]
    workdir = Path(tempfile.mkdtemp(prefix="glb", dir="/tmp"))
    results = await run(args.pods, args.warmup, phases, workdir, args.log_level)
    for entry in workdir.iterdir():  # keep only the services' logs (the ledger, stores, sockets go)
        if entry.name == "logs":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    print(f"services' logs: {workdir / 'logs'}", file=sys.stderr)
    load = os.getloadavg()
    results["machine"] = (f"{describe()}, "
                          f"load average at the end {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}")
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
