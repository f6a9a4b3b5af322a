"""gpu-manager's three evaluators over the topology tree (reference 3.5), plus NVLink.

- ``share`` (fewer than 100 cores): every GPU, sorted by (cores left, whole 256 MiB blocks left,
  index); the first that has the cores and the memory. Partly used GPUs fill up before idle ones
  are broken into; masks are not consulted (a GPU held whole has 0 cores left, so never fits).
- ``fragment`` (100 cores): from the root, descend into the child group with the fewest fully free
  GPUs that still has one (leaves are never descended into), until no child group qualifies; take
  the lowest-index free GPU of that group. Whole-GPU requests so fill the most fragmented group
  first and keep well-connected free sets together.
- ``link`` (n x 100 cores, n >= 2): gpu-manager's rule is "for each GPU, the lowest ancestor with at
  least n free GPUs; of those, the lowest level, then the fewest free GPUs; its n lowest free GPUs".

How NVLink combines with the tree (gpu-manager ignores NVLink, upstream #167): every set of n free
GPUs is ranked by the key

    (-NVLinks between its members, level of the lowest node holding it, free GPUs in that node, indexes)

i.e. NVLink bandwidth first, then gpu-manager's two keys (connection level, tightest fit), then the
lowest indexes. When the free GPUs have no NVLink between them, or the same count on every pair (a
DGX behind NVSwitches: NV12 everywhere), the first key ties for every set and the key picks exactly
what gpu-manager's link picks (the set's lowest holding node is the candidate gpu-manager finds; a
property test checks this), so the tree walk answers directly. Otherwise the sets are searched:
exhaustively while there are at most `MAX_SETS` of them, else greedily (grow from each free GPU by
the best next member, keep the best result), which is exact on real nodes up to 16 GPUs.

The tree itself places NVLinked pairs in "NV" groups below PIX (libs/gpu/tree.py), so ``fragment``
also keeps NVLinked pairs whole: it fills a half-used NVLink pair before breaking into a whole one.
Ties fall to the lowest GPU index, never to hash or map order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence

from libs.config import MEMORY_BLOCK
from libs.gpu.tree import TopologyTree, TreeNode
from libs.ledger.state import GpuUsage

__all__ = ["MAX_SETS", "fragment", "link", "link_by_tree", "nvlink_sum", "set_key", "share"]

MAX_SETS = 20_000

NvMatrix = Sequence[Sequence[int]]


def share(gpus: Sequence[GpuUsage], cores: int, memory: int) -> GpuUsage | None:
    """Best fit on the cores left, then the memory left (whole blocks, as gpu-manager compares)."""
    ranked = sorted(gpus, key=lambda g: (g.cores_free, g.memory_free // MEMORY_BLOCK, g.index))
    return next((g for g in ranked if g.cores_free >= cores and g.memory_free >= memory), None)


def fragment(tree: TopologyTree, free: Collection[int]) -> int | None:
    """One whole GPU from the most fragmented group that still has one."""
    node = tree.root
    while True:
        groups = [c for c in tree.children(node) if not c.is_leaf and tree.available(c, free)]
        if not groups:
            break
        node = min(groups, key=lambda c: (len(tree.available(c, free)), c.first))
    avail = tree.available(node, free)
    return avail[0] if avail else None


def link_by_tree(tree: TopologyTree, free: Collection[int], n: int) -> tuple[int, ...] | None:
    """gpu-manager's link evaluator: n whole GPUs from the closest, tightest group."""
    candidates: dict[int, TreeNode] = {}
    for gpu in range(tree.gpu_count):
        for node in tree.ancestors(gpu)[:-1]:  # stop before the root
            if len(tree.available(node, free)) >= n:
                candidates[node.id] = node
                break
    nodes = list(candidates.values()) or [tree.root]
    best = min(nodes, key=lambda c: (c.level, len(tree.available(c, free)), tree.available(c, free)[:n]))
    chosen = tree.available(best, free)[:n]
    return tuple(chosen) if len(chosen) == n else None


def nvlink_sum(nv: NvMatrix, gpus: Sequence[int]) -> int:
    return sum(nv[a][b] for a, b in itertools.combinations(gpus, 2))


def set_key(tree: TopologyTree, free: Collection[int], nv: NvMatrix, gpus: Sequence[int]) -> tuple:
    """Lower is better: (-NVLinks, level of the holding node, its free GPUs, the indexes)."""
    holder = tree.span(gpus)
    return (-nvlink_sum(nv, gpus), holder.level, len(tree.available(holder, free)), tuple(sorted(gpus)))


def link(tree: TopologyTree, free: Collection[int], n: int, nv: NvMatrix) -> tuple[int, ...] | None:
    """n whole GPUs: most NVLinks, then gpu-manager's link order (see the module docstring)."""
    avail = sorted(free)
    if len(avail) < n:
        return None
    counts = {nv[a][b] for a, b in itertools.combinations(avail, 2)}
    if len(counts) <= 1:
        return link_by_tree(tree, free, n)
    if math.comb(len(avail), n) <= MAX_SETS:
        return min(itertools.combinations(avail, n), key=lambda s: set_key(tree, free, nv, s))
    return _greedy(tree, free, n, nv, avail)


def _greedy(tree: TopologyTree, free: Collection[int], n: int, nv: NvMatrix, avail: list[int]) -> tuple[int, ...]:
    results = []
    for start in avail:
        group = [start]
        while len(group) < n:
            rest = [g for g in avail if g not in group]
            group.append(min(rest, key=lambda g: set_key(tree, free, nv, [*group, g])))
        results.append(tuple(sorted(group)))
    return min(results, key=lambda s: set_key(tree, free, nv, s))
