"""Where a request goes: gpu-manager's evaluator choice and its refusals, over our topology tree.

- fewer than 100 cores: share mode only, memory required; the ``share`` evaluator (best fit);
- exactly 100 cores: the ``fragment`` evaluator (one whole GPU from the most fragmented group);
- more than 100 cores: a multiple of 100, the ``link`` evaluator (n whole GPUs, NVLink first).
The evaluators and how NVLink combines with gpu-manager's tree are in `evaluators.py`; the tree is
`libs/gpu/tree.py`. Refusals carry gpu-manager's error texts (reference 3.2), with the numbers added.
Everything is pure and deterministic: ties fall to the lowest GPU index.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from libs.errors import ServiceError
from libs.events.schema import GpuShare
from libs.gpu.topology import nvlink_count
from libs.gpu.tree import TopologyTree, build_tree
from libs.ledger.state import GpuUsage
from libs.placement import evaluators

__all__ = ["Links", "NoRoom", "place", "topology"]

Links = Sequence[Sequence[str]]


class NoRoom(ServiceError):
    """Refused for want of room now (not a request this node could never hold): worth freeing and retrying."""


def place(
    gpus: Sequence[GpuUsage], links: Links, *, cores: int, memory: int, share_mode: bool
) -> tuple[GpuShare, ...]:
    gpus = [g for g in gpus if g.healthy]  # never place on a GPU marked unhealthy
    if cores <= 0:
        raise ServiceError(400, f"a request needs at least 1 vcuda-core unit, got {cores}")
    if cores < 100:
        return (_share(gpus, cores=cores, memory=memory, share_mode=share_mode),)
    if cores % 100:
        raise ServiceError(400, f"cores are greater than 100, must be multiple of 100 (got {cores})")
    wanted = cores // 100
    if wanted > len(gpus):
        raise ServiceError(400, f"no free node: {cores} cores asks for {wanted} GPUs; this node has {len(gpus)}")
    by_index = {g.index: g for g in gpus}
    tree, nv = topology(links, max(by_index) + 1)
    free = frozenset(i for i, g in by_index.items() if g.idle)
    if wanted == 1:
        one = evaluators.fragment(tree, free)
        chosen: tuple[int, ...] | None = (one,) if one is not None else None
    else:
        chosen = evaluators.link(tree, free, wanted, nv)
    if chosen is None:
        raise NoRoom(503, f"no free node: {wanted} whole GPU(s) wanted, {len(free)} fully free")
    return tuple(
        GpuShare(index=g.index, uuid=g.uuid, minor=g.minor, cores=100, memory=g.memory_total)
        for g in (by_index[i] for i in chosen)
    )


def _share(gpus: Sequence[GpuUsage], *, cores: int, memory: int, share_mode: bool) -> GpuShare:
    if not share_mode:
        raise ServiceError(400, "share mode is not enabled: requests under 100 cores are refused")
    if memory <= 0:
        raise ServiceError(400, "that cores or memory is zero is not permitted in share mode")
    best = evaluators.share(gpus, cores, memory)
    if best is None:
        largest = max((g.memory_total for g in gpus), default=0)
        if memory > largest:
            raise ServiceError(400, f"request memory {memory} is larger than {largest}")
        raise NoRoom(503, f"no free node: no GPU has {cores} cores and {memory} bytes left")
    return GpuShare(index=best.index, uuid=best.uuid, minor=best.minor, cores=cores, memory=memory)


def topology(links: Links, gpu_count: int) -> tuple[TopologyTree, tuple[tuple[int, ...], ...]]:
    """The tree and the NVLink-count matrix of a links matrix (cached: the links rarely change)."""
    frozen = tuple(tuple(row) for row in links)
    return _topology(frozen, gpu_count)


@functools.lru_cache(maxsize=16)
def _topology(links: tuple[tuple[str, ...], ...], gpu_count: int) -> tuple[TopologyTree, tuple[tuple[int, ...], ...]]:
    tree = build_tree(links, gpu_count)
    n = tree.gpu_count
    nv = tuple(
        tuple(nvlink_count(links[i][j]) if i < len(links) and j < len(links[i]) else 0 for j in range(n))
        for i in range(n)
    )
    return tree, nv
