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
