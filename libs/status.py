"""The status view: gpu-manager's ``/graph``, ``/usage`` and ``/version``, from the folded ledger state.

Pure functions over a `LedgerSnapshot` and the recorded inventory, shared by the allocator's HTTP
routes and ``gpuledger status``. The tree is built from the pairwise link tokens: GPUs are grouped by
the closest level that joins them (NVLink, then PIX, PXB, PHB, NODE, SYS), which is the shape of
gpu-manager's topology tree; when a full tree module exists, only `topology_tree` needs to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

import msgspec

from libs.config import MEMORY_BLOCK
from libs.events.schema import InventoryRecorded
from libs.gpu.topology import link_level, nvlink_count
from libs.ledger.state import Allocation, GpuUsage, LedgerSnapshot

__all__ = ["TreeNode", "agent_version", "graph_json", "render_graph", "topology_tree", "usage_json"]

MIB = 1 << 20
_LEVEL_NAMES = {-1: "NVLINK", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


class TreeNode(msgspec.Struct, kw_only=True):
    kind: str                         # ROOT, SYS, NODE, PHB, PXB, PIX, NVLINK or GPU
    gpus: list[int]                   # the GPU indexes under this node
    children: list[TreeNode] = []


def agent_version() -> str:
    try:
        return version("gpuledger")
    except PackageNotFoundError:
        return "unknown"


def _distance(links: Sequence[Sequence[str]], a: int, b: int) -> int:
    token = links[a][b] if a < len(links) and b < len(links[a]) else "SYS"
    # NVLinked GPUs are the closest of all, below a shared PCIe switch (PIX = 10).
    return -1 if nvlink_count(token) else link_level(token)


def topology_tree(inventory: InventoryRecorded) -> TreeNode:
    """GPUs grouped top-down: a node's level is the farthest link among its GPUs; its children are the
    sets of GPUs joined by closer links."""
    links = inventory.links

    def build(members: list[int]) -> TreeNode:
        if len(members) == 1:
            return TreeNode(kind="GPU", gpus=members)
        level = max(_distance(links, a, b) for a in members for b in members if a < b)
        groups: list[list[int]] = []
        for m in members:
            joined = [g for g in groups if any(_distance(links, m, o) < level for o in g)]
            groups = [g for g in groups if g not in joined] + [sorted({m, *(x for g in joined for x in g)})]
        groups.sort()
        children = ([TreeNode(kind="GPU", gpus=[m]) for m in members] if len(groups) == 1
                    else [build(g) for g in groups])
        return TreeNode(kind=_LEVEL_NAMES.get(level, "NVLINK"), gpus=members, children=children)

    indexes = sorted(g.index for g in inventory.gpus)
    return TreeNode(kind="ROOT", gpus=indexes, children=[build(indexes)] if indexes else [])


def _gpu_line(g: GpuUsage, allocs: dict[str, Allocation]) -> str:
    health = "" if g.healthy else f"  UNHEALTHY ({g.health_reason})"
    pods = sorted({f"{allocs[a].namespace}/{allocs[a].pod_name}:{allocs[a].container}"
                   for a in g.alloc_ids if a in allocs})
    return (f"GPU{g.index} ({g.uuid})  cores {g.cores_free}/100 free  memory "
            f"{g.memory_free // MIB}/{g.memory_total // MIB} MiB free "
            f"({g.memory_free // MEMORY_BLOCK} vcuda-memory){health}"
            + (f"  pods: {', '.join(pods)}" if pods else ""))


def render_graph(snapshot: LedgerSnapshot, inventory: InventoryRecorded | None) -> str:
    """The tree as text: one line per node, each GPU with what is free on it and who holds it."""
    if inventory is None:
        return "no GPU inventory recorded yet\n"
    gpus = {g.index: g for g in snapshot.gpus}
    allocs = {a.alloc_id: a for a in snapshot.allocations}
    lines = [f"node {inventory.node} ({inventory.backend}, driver {inventory.driver_version or 'unknown'}), "
             f"log seq {snapshot.seq}"]

    def walk(node: TreeNode, prefix: str, last: bool, depth: int) -> None:
        branch = "" if depth == 0 else ("└─ " if last else "├─ ")
        if node.kind == "GPU" and node.gpus[0] in gpus:
            text = _gpu_line(gpus[node.gpus[0]], allocs)
        else:
            text = f"{node.kind} [{', '.join(f'GPU{i}' for i in node.gpus)}]"
        lines.append(prefix + branch + text)
        inner = prefix + ("" if depth == 0 else ("   " if last else "│  "))
        for k, child in enumerate(node.children):
            walk(child, inner, k == len(node.children) - 1, depth + 1)

    walk(topology_tree(inventory), "", True, 0)
    return "\n".join(lines) + "\n"


def graph_json(snapshot: LedgerSnapshot, inventory: InventoryRecorded | None) -> dict[str, object]:
    """``/graph``: gpu-manager answers ``{"graph": "<text>"}``; we add the tree and GPUs as data."""
    return {
        "graph": render_graph(snapshot, inventory),
        "tree": msgspec.to_builtins(topology_tree(inventory)) if inventory is not None else None,
        "gpus": [
            {"index": g.index, "uuid": g.uuid, "cores_free": g.cores_free, "cores_allocated": g.cores_used,
             "memory_free": g.memory_free, "memory_allocated": g.memory_used, "memory_total": g.memory_total,
             "healthy": g.healthy, "health_reason": g.health_reason, "allocations": sorted(g.alloc_ids)}
            for g in snapshot.gpus
        ],
        "seq": snapshot.seq,
    }


def usage_json(snapshot: LedgerSnapshot, inventory: InventoryRecorded | None,
               used: dict[tuple[str, str], dict[int, tuple[float, int, tuple[int, ...]]]] | None = None,
               ) -> dict[str, object]:
    """``/usage``: gpu-manager's shape, keyed by pod UID: ``{"usage": {uid: {"stat", "spec", "project"}}}``.

    ``used[(pod_uid, container)][gpu index] = (sm %, memory bytes, pids)`` is the last background
    sample, when there is one; ``spec`` is what the container asked for (cores / 100, MiB).
    """
    bus_ids = {g.index: g.pci_bus_id for g in inventory.gpus} if inventory is not None else {}
    totals = {g.index: g.memory for g in inventory.gpus} if inventory is not None else {}
    out: dict[str, dict[str, object]] = {}
    for a in snapshot.allocations:
        pod = out.setdefault(a.pod_uid, {"stat": {}, "spec": {}, "project": a.namespace, "pod": a.pod_name})
        sample = (used or {}).get((a.pod_uid, a.container), {})
        devices = []
        for s in a.shares:
            sm, mem, pids = sample.get(s.index, (0.0, 0, ()))
            devices.append({"id": bus_ids.get(s.index, ""), "card_idx": str(s.index), "gpu": sm,
                            "mem": mem / MIB, "pids": list(pids), "device_mem": totals.get(s.index, 0) / MIB,
                            "cores": s.cores, "memory": s.memory})
        pod["stat"][a.container] = {"dev": devices}  # type: ignore[index]
        memory = a.memory or sum(s.memory for s in a.shares)
        pod["spec"][a.container] = {"gpu": a.cores / 100, "mem": memory / MIB}  # type: ignore[index]
    return {"usage": out}
