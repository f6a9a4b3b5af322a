"""The topology tree: GPUs grouped by how close they are, as gpu-manager builds it (reference 3.4).

Leaves are the GPUs (by NVML index). An inner node is a group of GPUs whose pairs are all at most
one distance level apart; groups nest, from the closest level up to the root that holds every GPU.
The evaluators read it together with the set of fully free GPUs: a node's *mask* is the set of its
leaves that hold no allocation at all (``mask``/``available``), so a group's "available" count is
how many whole GPUs it can still give.

Levels follow NVML's common-ancestor levels: PIX 10, PXB 20, PHB 30, NODE/SOC 40, SYS 50, and the
root 60 (gpu-manager's UNKNOWN). One level is ours: NV 5, for pairs joined by NVLink. A topology
matrix shows ``NV#`` instead of the PCIe level for such pairs, so the PCIe level is unknown; NVLinked
GPUs are the closest a pair can be, so they group below PIX.

Where gpu-manager differs, on purpose (reference 8.1 item 11):
- groups are the connected components of "pairs at this level or closer", so they always nest and
  never overlap (gpu-manager merges a pair into the first group it touches, which can overlap);
- SYS and NODE make groups (gpu-manager's text parser ignored SYS); NV makes groups;
- masks are Python sets/ints: any number of GPUs (gpu-manager's uint32 stops at 32);
- GPUs that share no level (an unknown token, a missing row) simply hang off the root, where
  gpu-manager died with "Should not reach here";
- children are ordered by their lowest GPU index, never by map order.
Everything here is pure: it reads a token matrix and sets of indexes, and changes nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from libs.gpu.topology import link_level, nvlink_count

__all__ = [
    "LEVEL_NAMES",
    "LEVEL_NV",
    "LEVEL_ROOT",
    "TopologyTree",
    "TreeNode",
    "build_tree",
    "mask_of",
    "tree_level",
]

LEVEL_LEAF = 0
LEVEL_NV = 5
LEVEL_ROOT = 60
_GROUP_LEVELS = (LEVEL_NV, 10, 20, 30, 40, 50)
LEVEL_NAMES = {0: "GPU", 5: "NV", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS", 60: "ROOT"}


def tree_level(token: str | None) -> int:
    """The level at which a pair with this token joins: NV# 5, PIX 10 ... SYS 50, unknown 60."""
    if token is None:
        return LEVEL_ROOT
    if nvlink_count(token):
        return LEVEL_NV
    try:
        level = link_level(token)
    except ValueError:
        return LEVEL_ROOT  # no shared level known: only the root joins them
    return level if level > 0 else LEVEL_ROOT  # "X" off the diagonal is not a link


def mask_of(gpus: Iterable[int]) -> int:
    """A bit per GPU index; a Python int, so there is no limit on the number of GPUs."""
    m = 0
    for i in gpus:
        m |= 1 << i
    return m


@dataclass(frozen=True, slots=True)
class TreeNode:
    id: int                       # leaves: the GPU index; groups and the root follow, bottom-up
    level: int                    # 0 for a leaf, 5..50 for a group, 60 for the root
    gpus: frozenset[int]          # the leaves below (a leaf: itself)
    children: tuple[int, ...]     # node ids, ordered by their lowest GPU index
    parent: int | None            # None for the root

    @property
    def is_leaf(self) -> bool:
        return self.level == LEVEL_LEAF

    @property
    def name(self) -> str:
        return f"GPU{self.id}" if self.is_leaf else LEVEL_NAMES.get(self.level, str(self.level))

    @property
    def first(self) -> int:
        return min(self.gpus)


class TopologyTree:
    """Nodes of one node's topology; build it with `build_tree`."""

    def __init__(self, nodes: Sequence[TreeNode], gpu_count: int) -> None:
        self.nodes = tuple(nodes)
        self.gpu_count = gpu_count
        self.root = self.nodes[-1]

    def node(self, node_id: int) -> TreeNode:
        return self.nodes[node_id]

    def leaf(self, gpu: int) -> TreeNode:
        return self.nodes[gpu]

    @property
    def groups(self) -> tuple[TreeNode, ...]:
        """The inner nodes below the root, bottom-up."""
        return self.nodes[self.gpu_count : -1]

    def ancestors(self, gpu: int) -> list[TreeNode]:
        """The leaf's parents, closest first, the root last."""
        out = []
        parent = self.leaf(gpu).parent
        while parent is not None:
            out.append(self.nodes[parent])
            parent = self.nodes[parent].parent
        return out

    def children(self, node: TreeNode) -> list[TreeNode]:
        return [self.nodes[c] for c in node.children]

    # --- availability: which leaves below a node are fully free ---
    @staticmethod
    def available(node: TreeNode, free: Collection[int]) -> list[int]:
        """The node's fully free GPUs, lowest index first."""
        return sorted(node.gpus.intersection(free))

    @staticmethod
    def mask(node: TreeNode, free: Collection[int]) -> int:
        return mask_of(node.gpus.intersection(free))

    def masks(self, free: Collection[int]) -> dict[int, int]:
        """Node id -> mask of its fully free leaves (gpu-manager keeps these up to date in place)."""
        return {n.id: self.mask(n, free) for n in self.nodes}

    def span(self, gpus: Collection[int]) -> TreeNode:
        """The lowest node that holds all these GPUs."""
        wanted = frozenset(gpus)
        node = self.leaf(min(wanted))
        while not wanted <= node.gpus:
            assert node.parent is not None  # the root holds every GPU
            node = self.nodes[node.parent]
        return node

    def render(self, free: Collection[int] | None = None) -> str:
        """A text drawing like gpu-manager's PrintGraph: ``ROOT:n`` then one indented line per node."""
        free = set(range(self.gpu_count)) if free is None else set(free)
        lines = [f"ROOT:{len(self.available(self.root, free))}"]

        def walk(node: TreeNode, depth: int) -> None:
            for child in self.children(node):
                label = child.name if child.is_leaf else f"{child.name} (aval: {len(self.available(child, free))})"
                lines.append("|   " * depth + "|---" + label)
                walk(child, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)


def build_tree(links: Sequence[Sequence[str]], gpu_count: int | None = None) -> TopologyTree:
    """The tree of a token matrix (``links[i][j]`` as `nvidia-smi topo -m` prints it).

    ``gpu_count`` may exceed the matrix (GPUs without a row share no level with anyone).
    """
    n = max(len(links), gpu_count or 0)
    if n == 0:
        raise ValueError("a topology tree needs at least one GPU")

    def level(i: int, j: int) -> int:
        row = links[i] if i < len(links) else ()
        return tree_level(row[j] if j < len(row) else None)

    by_level: dict[int, list[tuple[int, int]]] = {}
    for i in range(n):
        for j in range(i + 1, n):
            lv = level(i, j)
            if lv != LEVEL_ROOT:
                by_level.setdefault(lv, []).append((i, j))

    levels = [LEVEL_LEAF] * n
    members = [frozenset((i,)) for i in range(n)]
    children: list[tuple[int, ...]] = [()] * n
    parents: list[int | None] = [None] * n
    top = list(range(n))           # the current highest node above each GPU
    uf = list(range(n))

    def find(x: int) -> int:
        while uf[x] != x:
            uf[x] = uf[uf[x]]
            x = uf[x]
        return x

    def add(level: int, gpus: frozenset[int], below: list[int]) -> int:
        new = len(levels)
        levels.append(level)
        members.append(gpus)
        children.append(tuple(sorted(below, key=lambda k: min(members[k]))))
        parents.append(None)
        for child in below:
            parents[child] = new
        for g in gpus:
            top[g] = new
        return new

    for lv in _GROUP_LEVELS:
        for i, j in by_level.get(lv, ()):
            a, b = find(i), find(j)
            if a != b:
                uf[max(a, b)] = min(a, b)
        components: dict[int, list[int]] = {}
        for g in range(n):
            components.setdefault(find(g), []).append(g)
        for comp in sorted(components.values(), key=min):
            below = {top[g] for g in comp}
            if len(below) > 1:  # something joined at this level (else no group, as in gpu-manager)
                add(lv, frozenset(comp), list(below))
    add(LEVEL_ROOT, frozenset(range(n)), list({top[g] for g in range(n)}))
    frozen = [
        TreeNode(id=k, level=levels[k], gpus=members[k], children=children[k], parent=parents[k])
        for k in range(len(levels))
    ]
    return TopologyTree(frozen, n)
