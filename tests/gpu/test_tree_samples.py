"""Topology trees from real `nvidia-smi topo -m` outputs (tests/gpu/data), through the parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.gpu import parse_topo_matrix
from libs.gpu.tree import build_tree

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize(
    ("name", "groups"),
    [
        ("dgx-a100-8gpu.txt", [("NV", list(range(8)))]),
        ("pcie-4gpu.txt", [("PIX", [0, 1]), ("PXB", [0, 1, 2]), ("NODE", [0, 1, 2, 3])]),
        ("old-driver-soc-4gpu.txt", [("PHB", [0, 1]), ("PHB", [2, 3]), ("NODE", [0, 1, 2, 3])]),
        ("nvlink-2gpu.txt", [("NV", [0, 1])]),
        ("single-gpu.txt", []),
    ],
)
def test_sample_trees(name: str, groups: list[tuple[str, list[int]]]) -> None:
    tree = build_tree(parse_topo_matrix((DATA / name).read_text()))
    assert [(g.name, sorted(g.gpus)) for g in tree.groups] == groups
    assert tree.root.gpus == frozenset(range(tree.gpu_count))


@pytest.mark.gpu
def test_real_node_tree_and_placement() -> None:
    # On a GPU machine: the tree of NVML's own links holds every GPU, pairs meet no higher than their
    # link level, and a whole-node request gets every GPU.
    from libs.gpu import load_inventory
    from libs.gpu.tree import tree_level
    from libs.ledger.state import GpuUsage
    from libs.placement.placement import place

    inv = load_inventory("nvml")
    tree = build_tree(inv.links)
    n = len(inv.gpus)
    assert tree.root.gpus == frozenset(range(n))
    for i in range(n):
        for j in range(i + 1, n):
            assert tree.span([i, j]).level <= tree_level(inv.links[i][j])
    usage = [GpuUsage(index=g.index, uuid=g.uuid, minor=g.minor, memory_total=g.memory) for g in inv.gpus]
    shares = place(usage, inv.links, cores=100 * n, memory=0, share_mode=True)
    assert sorted(s.index for s in shares) == list(range(n))
