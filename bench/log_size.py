"""Log size: bytes per event of a ledger the real allocator wrote, and of the benchmark mix, in both row formats.

Two logs are measured:
- the allocator's: the services (``gpuledger.launcher``) on a simulated node (``simulator``: API server,
  kubelet, fake GPUs), driven pod after pod (created, admitted, Running, deleted; ``bench.kubelet_driver``)
  through a mixed workload: shares of 10-90 cores, whole GPUs, two GPUs, two-container pods and pods
  with an init container. Every event in it was written by the allocator's ``Ledger``;
- the benchmark mix (``bench.make_log``: one inventory, then grants and releases, 2:1).

Each is measured as written (format 2) and as format 1 would store the same rows (every row copied
into a file with format 1's schema and its bodies, version 2 (``bench.make_log.as_format_1``): the bytes
the release before format 2 wrote for the same events). Size = the SQLite file's pages in use after a
checkpoint, less those of an empty log of the same format, over the events.

    python -m bench.log_size [--pods 300] [--events 100000] [--json OUT] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.allocate_rtt import free_base_port
from bench.kubelet_driver import NAMESPACE, run_pod
from bench.make_log import as_format_1, synthetic, write_log
from gpuledger.launcher import Launcher
from libs.bus.server import NatsServer
from libs.config import Settings
from libs.kube.pods import RESOURCE_VCORE
from libs.logger import configure_logging
from libs.store.log import create_schema
from simulator import NodeSimulator, SimConfig

NODE = "log-size"
GPUS = 4  # the fake backend's GPUs: 400 vcore

# The workload, in turn: (containers, init containers), each container (name, cores, memory in GiB).
Container = tuple[str, int, int]
MIX: list[tuple[list[Container], list[Container]]] = [
    ([("main", 10, 1)], []),
    ([("main", 35, 4)], []),
    ([("main", 90, 12)], []),
    ([("main", 100, 0)], []),                       # a whole GPU
    ([("main", 200, 0)], []),                       # two GPUs
    ([("a", 30, 2), ("b", 60, 6)], []),             # two containers
    ([("app", 50, 4)], [("setup", 20, 2)]),         # an init container first
    ([("main", 75, 8)], []),
]


def manifest(i: int) -> dict[str, Any]:
    containers, inits = MIX[i % len(MIX)]

    def spec(c: Container) -> dict[str, Any]:
        limits = {"tencent.com/vcuda-core": str(c[1])}
        if c[2]:
            limits["tencent.com/vcuda-memory"] = str(c[2])
        return {"name": c[0], "image": "cuda", "resources": {"limits": limits}}

    body: dict[str, Any] = {"containers": [spec(c) for c in containers]}
    if inits:
        body["initContainers"] = [spec(c) for c in inits]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"mix-{i}", "namespace": NAMESPACE},
            "spec": body}


async def allocator_log(workdir: Path, pods: int) -> Path:
    """Run ``pods`` pods of the mix through the simulated node; the ledger the allocator wrote."""
    sim = NodeSimulator(SimConfig(node_name=NODE, device_plugin_dir=workdir / "dp",
                                  pod_resources_socket=workdir / "pr" / "kubelet.sock",
                                  kubeconfig_path=workdir / "kubeconfig", seed=1))
    nats = NatsServer(workdir / "nats")
    launcher: Launcher | None = None
    await sim.start()
    try:
        await nats.start()
        settings = Settings(node_name=NODE, state_dir=str(workdir / "state"), device_plugin_dir=str(workdir / "dp"),
                            pod_resources_socket=str(workdir / "pr" / "kubelet.sock"),
                            kubeconfig=str(workdir / "kubeconfig"), nats_url=nats.url, gpus="fake",
                            log_format="json", log_level="warning", metrics_port=free_base_port(),
                            metrics_host="127.0.0.1")
        launcher = Launcher(settings, embedded_nats=False, log_dir=workdir / "logs")
        await launcher.start_services()
        await sim.wait_for_resource(RESOURCE_VCORE, GPUS * 100, timeout=60)
        for i in range(pods):
            await run_pod(sim, manifest(i))
            await sim.wait_for_resource(RESOURCE_VCORE, GPUS * 100, timeout=30)  # all free again
            if (i + 1) % 100 == 0:
                print(f"  {i + 1}/{pods} pods", file=sys.stderr, flush=True)
        return settings.log_path
    finally:
        if launcher is not None:
            await launcher.stop()
        await nats.stop()
        await sim.stop()


def used_bytes(path: Path) -> int:
    """The bytes of the pages in use, after a checkpoint (the WAL folded in, free pages not counted)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages, free, size = (conn.execute(f"PRAGMA {p}").fetchone()[0]
                             for p in ("page_count", "freelist_count", "page_size"))
        return int((pages - free) * size)
    finally:
        conn.close()


def measure(name: str, path: Path) -> dict[str, object]:
    events = sqlite3.connect(f"file:{path}?mode=ro", uri=True).execute("SELECT COUNT(*) FROM events").fetchone()[0]
    old, empty_1, empty_2 = (path.with_name(path.stem + suffix) for suffix in ("-f1.sqlite", "-f1-empty.sqlite",
                                                                                "-f2-empty.sqlite"))
    as_format_1(path, old)
    as_format_1(path, empty_1, upto=0)
    create_schema(empty_2)
    # What the rows take: the file less the pages an empty log of the same format has (a small log is
    # otherwise mostly the one page each table and index starts with).
    now, before = used_bytes(path) - used_bytes(empty_2), used_bytes(old) - used_bytes(empty_1)
    return {"log": name, "events": events, "format1_bytes_per_event": round(before / events),
            "format2_bytes_per_event": round(now / events)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=300)
    parser.add_argument("--events", type=int, default=100_000, help="of the benchmark mix")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--keep", type=Path, default=None,
                        help="copy the two logs measured here (allocator.sqlite, mix.sqlite) into this folder")
    args = parser.parse_args()
    configure_logging("log-size", fmt="console", level="warning", stream=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="gll", dir="/tmp") as tmp:  # short: unix socket paths
        workdir = Path(tmp)
        load_before = os.getloadavg()
        ledger = await allocator_log(workdir, args.pods)
        mix = workdir / "mix.sqlite"
        write_log(mix, synthetic(args.events), progress=False)
        rows = [measure(f"allocator, {args.pods} pods of the mixed workload", ledger),
                measure("bench.make_log mix", mix)]
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ledger, args.keep / "allocator.sqlite")
            shutil.copyfile(mix, args.keep / "mix.sqlite")
    results = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "load_before": [round(x, 2) for x in load_before],
               "load_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    for row in rows:
        print(f"{row['log']}: {row['events']:,} events, format 1 {row['format1_bytes_per_event']} B/event, "
              f"format 2 {row['format2_bytes_per_event']} B/event")
    print(f"load average before/after: {results['load_before']} / {results['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
