"""The kubelet side of the Allocate benchmark, in its own process: the node simulator's kubelet.

The benchmark process must not share an interpreter (event loop, GIL, gRPC client) with what it
measures from, so the simulated node (API server + kubelet device manager) runs here, alone, and
the Allocate times are those its own gRPC client sees: from the call to the reply, as the kubelet's
admission issues Allocate after Allocate. Pods are created, admitted and deleted one at a time,
in pairs: a pod asking for gpuledger's ``tencent.com/vcuda-core``, then one asking for a floor's
resource, the bare echo plugin's and the durable echo plugin's (a bus round trip and an fsync'd
append before it answers) in turn. So all see the same request sequence under the same conditions,
and each of our Allocates follows one floor pod, as when the bare plugin was the only floor.

Protocol (line-based, for bench/allocate_rtt.py): prints ``ready`` once the simulator serves
(kubeconfig written, kubelet.sock listening); then for each stdin line ``{"pods": N, "warmup": W}``
it runs 2(W+N) pairs and prints one JSON line ``{"ours": [seconds...], "bare": [...], "durable": [...]}``
(the warm-up pairs left out): N times of each floor, 2N of ours. It stops at end of input.

    python -m bench.kubelet_driver WORKDIR NODE_NAME
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from bench.echo_plugin import DURABLE_RESOURCE
from bench.echo_plugin import RESOURCE as ECHO_RESOURCE
from libs.kube.pods import RESOURCE_VCORE
from libs.logger import configure_logging
from libs.runtime import settle_gc
from simulator import NodeSimulator, SimConfig

NAMESPACE = "bench"


def vcore_pod(i: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"bench-{i}", "namespace": NAMESPACE},
            "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": {
                "tencent.com/vcuda-core": "10", "tencent.com/vcuda-memory": "1"}}}]}}


def echo_pod(i: int, resource: str = ECHO_RESOURCE, prefix: str = "echo") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{prefix}-{i}", "namespace": NAMESPACE},
            "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": {resource: "1"}}}]}}


async def run_pod(sim: NodeSimulator, manifest: dict) -> None:
    created = await sim.create_pod(manifest)
    name = created["metadata"]["name"]
    done = await sim.wait_for_pod(NAMESPACE, name, lambda p: p["status"].get("phase") in ("Running", "Failed"), 30)
    if done["status"]["phase"] != "Running":
        raise RuntimeError(f"{name} failed: {done['status'].get('message')}")
    await sim.delete_pod(NAMESPACE, name)


async def run_phase(sim: NodeSimulator, first: int, pods: int, warmup: int) -> dict[str, list[float]]:
    """2(W+N) pairs (ours, then a floor's: the echo plugin's and the durable echo plugin's in turn);
    the Allocate times after the warm-up: N of each floor, 2N of ours."""
    mark = len(sim.calls)
    total = 2 * (warmup + pods)
    for n, i in enumerate(range(first, first + total), 1):
        await run_pod(sim, vcore_pod(i))
        await run_pod(sim, echo_pod(i) if n % 2 else echo_pod(i, DURABLE_RESOURCE, "durable"))
        if n % 500 == 0:
            print(f"  {n}/{total} pod pairs", file=sys.stderr, flush=True)

    def times(resource: str, skip: int) -> list[float]:
        calls = [c for c in sim.calls[mark:] if c.method == "Allocate" and c.resource == resource and c.ok]
        return [c.end - c.start for c in calls][skip:]  # type: ignore[operator]

    return {"ours": times(RESOURCE_VCORE, 2 * warmup), "bare": times(ECHO_RESOURCE, warmup),
            "durable": times(DURABLE_RESOURCE, warmup)}


async def main(workdir: Path, node: str) -> None:
    sim = NodeSimulator(SimConfig(node_name=node, device_plugin_dir=workdir / "dp",
                                  pod_resources_socket=workdir / "pr" / "kubelet.sock",
                                  kubeconfig_path=workdir / "kubeconfig", seed=1))
    await sim.start()
    # The simulated kubelet keeps every call it made or served (requests and responses as dicts, for
    # tests), which a kubelet does not: over a run its heap grows, and with the collector's defaults a
    # gen1 pass every ~100 pods took ~5 ms and a full pass up to 133 ms, stalling the Allocates of both
    # plugins (ours twice: the Allocate, then the allocator's pod-resources List). A Go kubelet's
    # collector runs beside it. The services settle their collector the same way (libs/runtime.py).
    settle_gc()
    try:
        print("ready", flush=True)
        reader = asyncio.StreamReader()
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        first = 0
        while line := await reader.readline():
            order = json.loads(line)
            await sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=60)
            await sim.wait_for_resource(ECHO_RESOURCE, 1000, timeout=60)
            await sim.wait_for_resource(DURABLE_RESOURCE, 1000, timeout=60)
            result = await run_phase(sim, first, order["pods"], order["warmup"])
            first += 2 * (order["pods"] + order["warmup"])
            print(json.dumps(result), flush=True)
    finally:
        await sim.stop()


if __name__ == "__main__":
    configure_logging("kubelet-driver", fmt="console", level="warning", stream=sys.stderr)
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
