"""The placement benchmark's traces in DRA mode: each arrival becomes a ResourceClaim that the
simulator's scheduler-side allocator for structured parameters (``simulator.dra.allocator.allocate``,
the one the simulated kube-scheduler uses) places on the node's ResourceSlice (``libs.dra_objects``,
every GPU a device with consumable ``cores`` and ``memory``), as a cluster with gpuledger as its DRA
driver would: a share asks ``cores`` and ``memory`` of one device, a whole GPU asks one device with
no capacity (the request policies' defaults: all of it), several whole GPUs ask ``count`` devices,
with no topology constraint, since the device-plugin pods of the same trace ask none either.
A departure deletes its claim. Used by bench/placement_quality.py.
"""

from __future__ import annotations

import itertools
from typing import Any

from libs.config import MEMORY_BLOCK
from libs.dra import DRIVER_NAME, device_index
from libs.dra_objects import device_class, node_slice
from libs.events.schema import InventoryRecorded
from libs.gpu.inventory import Inventory
from libs.placement.placement import topology
from simulator.dra.allocator import AllocationFailed, allocate

__all__ = ["claim_for", "run_dra_trace"]

NODE = "bench"


def claim_for(cores: int, blocks: int) -> dict[str, Any]:
    """The ResourceClaim of one arrival (``cores`` over 100 means that many whole GPUs)."""
    request: dict[str, Any] = {"deviceClassName": DRIVER_NAME}
    if cores < 100:
        request["capacity"] = {"requests": {"cores": str(cores), "memory": str(blocks * MEMORY_BLOCK)}}
    elif cores > 100:
        request["count"] = cores // 100
    return {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}}


def run_dra_trace(inv: Inventory, ops: list[Any], run: Any) -> Any:
    """``run`` (a bench.placement_quality.Run) filled from the trace: arrivals placed before the first
    refusal, the utilisation then, and the links of the multi-GPU claims."""
    recorded = InventoryRecorded(node=NODE, backend="fake", driver_version=inv.driver_version, gpus=inv.gpus,
                                 links=inv.links)
    slices = [node_slice(recorded, inv.gpus, 1)]
    classes = {DRIVER_NAME: device_class()}
    _, nv = topology(inv.links, len(inv.gpus))
    live: dict[str, dict[str, Any]] = {}
    cores_of: dict[str, int] = {}
    for op in ops:
        if isinstance(op, str):
            live.pop(op, None)
            continue
        claim = claim_for(op.cores, op.blocks)
        try:
            claim["status"] = {"allocation": allocate(claim, classes, slices, list(live.values()), NODE)}
        except AllocationFailed:
            break
        live[op.pod] = claim
        cores_of[op.pod] = op.cores
        run.placed += 1
        gpus = [device_index(r["device"]) for r in claim["status"]["allocation"]["devices"]["results"]]
        if len(gpus) > 1:
            pairs = list(itertools.combinations(gpus, 2))
            run.nvlinks_per_pair.append(sum(nv[a][b] for a, b in pairs) / len(pairs))
            run.cross_socket.append(any(inv.links[a][b] == "SYS" for a, b in pairs))
    run.utilisation = sum(cores_of[p] for p in live) / (100 * len(inv.gpus))
    return run
