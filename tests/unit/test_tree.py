"""The topology tree: groups per level from the bundled profiles, odd nodes, and its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.gpu.fake import PROFILES_DIR, FakeBackend
from libs.gpu.tree import LEVEL_NV, LEVEL_ROOT, TopologyTree, build_tree, mask_of, tree_level

TOKENS = ["NV1", "NV2", "NV12", "PIX", "PXB", "PHB", "NODE", "SOC", "SYS"]


def profile_tree(name: str) -> TopologyTree:
    return build_tree(FakeBackend(PROFILES_DIR / f"{name}.yaml").inventory().links)


def shape(tree: TopologyTree) -> list[tuple[str, list[int]]]:
    """(level name, GPUs) of every inner node, bottom-up."""
    return [(n.name, sorted(n.gpus)) for n in (*tree.groups, tree.root)]


def matrix(n: int, token: str, pairs: dict[tuple[int, int], str] | None = None) -> list[list[str]]:
    m = [["X" if i == j else token for j in range(n)] for i in range(n)]
    for (a, b), tok in (pairs or {}).items():
        m[a][b] = m[b][a] = tok
    return m


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        ("demo-4gpu", [("NV", [0, 1]), ("NV", [2, 3]), ("SYS", [0, 1, 2, 3]), ("ROOT", [0, 1, 2, 3])]),
        ("dgx-a100-8gpu", [("NV", list(range(8))), ("ROOT", list(range(8)))]),
        ("dgx1-v100-8gpu", [("NV", list(range(8))), ("ROOT", list(range(8)))]),
        ("pcie-4gpu", [("PIX", [0, 1]), ("PIX", [2, 3]), ("PHB", [0, 1, 2, 3]), ("ROOT", [0, 1, 2, 3])]),
        (
            "pcie-6gpu",
            [("PIX", [0, 1]), ("PIX", [3, 4]), ("PXB", [0, 1, 2]), ("NODE", [3, 4, 5]),
             ("SYS", list(range(6))), ("ROOT", list(range(6)))],
        ),
    ],
)
def test_bundled_profiles(profile: str, expected: list[tuple[str, list[int]]]) -> None:
    assert shape(profile_tree(profile)) == expected


def test_pcie_6gpu_parents_and_drawing() -> None:
    tree = profile_tree("pcie-6gpu")
    assert [a.name for a in tree.ancestors(2)] == ["PXB", "SYS", "ROOT"]
    assert [a.name for a in tree.ancestors(0)] == ["PIX", "PXB", "SYS", "ROOT"]
    assert [a.name for a in tree.ancestors(5)] == ["NODE", "SYS", "ROOT"]
    assert tree.render({1, 2, 5}) == "\n".join([
        "ROOT:3",
        "|---SYS (aval: 3)",
        "|   |---PXB (aval: 2)",
        "|   |   |---PIX (aval: 1)",
        "|   |   |   |---GPU0",
        "|   |   |   |---GPU1",
        "|   |   |---GPU2",
        "|   |---NODE (aval: 1)",
        "|   |   |---PIX (aval: 0)",
        "|   |   |   |---GPU3",
        "|   |   |   |---GPU4",
        "|   |   |---GPU5",
    ])


def test_masks_hold_only_fully_free_gpus() -> None:
    tree = profile_tree("pcie-6gpu")
    masks = tree.masks({0, 2, 4})
    pxb = next(n for n in tree.groups if n.name == "PXB")
    assert masks[pxb.id] == 0b101
    assert masks[tree.root.id] == 0b10101
    assert tree.available(tree.root, {5, 0, 3}) == [0, 3, 5]
    assert masks[tree.leaf(1).id] == 0  # a busy leaf is in no mask, its own included


def test_sys_and_node_make_groups() -> None:
    # Old drivers print SOC for the CPU level; gpu-manager's text parser ignored SYS entirely.
    tree = build_tree(matrix(4, "SYS", {(0, 1): "NODE", (2, 3): "SOC"}))
    assert shape(tree) == [("NODE", [0, 1]), ("NODE", [2, 3]), ("SYS", [0, 1, 2, 3]), ("ROOT", [0, 1, 2, 3])]


def test_gpus_that_share_no_level_hang_off_the_root() -> None:
    # gpu-manager died here ("Should not reach here"); rows may be missing or tokens unknown.
    tree = build_tree([], gpu_count=3)
    assert shape(tree) == [("ROOT", [0, 1, 2])]
    assert [c.name for c in tree.children(tree.root)] == ["GPU0", "GPU1", "GPU2"]
    partial = build_tree([["X", "PIX"], ["PIX", "X"]], gpu_count=3)
    assert shape(partial) == [("PIX", [0, 1]), ("ROOT", [0, 1, 2])]
    assert [c.name for c in partial.children(partial.root)] == ["PIX", "GPU2"]


def test_single_gpu() -> None:
    tree = build_tree([["X"]])
    assert tree.root.children == (0,) and tree.span([0]).id == 0


def test_more_than_32_gpus() -> None:
    # 40 GPUs: 5 sockets (SYS between) of 8 GPUs, PIX pairs inside each socket (PXB between pairs).
    n = 40
    m = [["X" if i == j else ("PIX" if i // 2 == j // 2 else "PXB" if i // 8 == j // 8 else "SYS")
          for j in range(n)] for i in range(n)]
    tree = build_tree(m)
    names = [g.name for g in tree.groups]
    assert names.count("PIX") == 20 and names.count("PXB") == 5 and names.count("SYS") == 1
    assert tree.span([38, 39]).name == "PIX" and tree.span([33, 39]).name == "PXB"
    assert tree.span([0, 39]).name == "SYS"
    assert tree.mask(tree.root, {39, 35}) == (1 << 39) | (1 << 35)
    assert mask_of([39]) > 2**32


def test_levels() -> None:
    assert [tree_level(t) for t in ("NV4", "PIX", "PXB", "PHB", "NODE", "SOC", "SYS")] == [
        LEVEL_NV, 10, 20, 30, 40, 40, 50]
    assert tree_level("junk") == tree_level(None) == tree_level("X") == LEVEL_ROOT


@st.composite
def topologies(draw: st.DrawFn) -> list[list[str]]:
    n = draw(st.integers(min_value=1, max_value=40))
    m = [["X"] * n for _ in range(n)]
    tokens = st.sampled_from([*TOKENS, "junk"])
    for i in range(n):
        for j in range(i + 1, n):
            m[i][j] = m[j][i] = draw(tokens)
    return m


@settings(max_examples=150, deadline=None)
@given(topologies())
def test_tree_invariants(links: list[list[str]]) -> None:
    tree = build_tree(links)
    n = len(links)
    assert tree.root.gpus == frozenset(range(n))
    assert [tree.leaf(i).gpus for i in range(n)] == [frozenset((i,)) for i in range(n)]
    for node in tree.nodes:
        kids = tree.children(node)
        if node.is_leaf:
            assert not kids
            continue
        # Children partition their parent, sit strictly lower, and are ordered by lowest GPU.
        assert frozenset().union(*(k.gpus for k in kids)) == node.gpus
        assert sum(len(k.gpus) for k in kids) == len(node.gpus)
        assert all(k.level < node.level and k.parent == node.id for k in kids)
        assert [k.first for k in kids] == sorted(k.first for k in kids)
        if node is not tree.root:
            assert len(kids) >= 2
    # Two GPUs meet at a node no higher than their link's level (a group joins at most that far).
    for i in range(n):
        for j in range(i + 1, n):
            assert tree.span([i, j]).level <= tree_level(links[i][j])
    # Every GPU's ancestors end at the root, levels strictly rising.
    for i in range(n):
        levels = [a.level for a in tree.ancestors(i)]
        assert levels == sorted(set(levels)) and levels[-1] == LEVEL_ROOT


@settings(max_examples=100, deadline=None)
@given(topologies(), st.data())
def test_masks_are_the_free_leaves_below(links: list[list[str]], data: st.DataObject) -> None:
    tree = build_tree(links)
    free = data.draw(st.sets(st.integers(0, len(links) - 1)))
    for node in tree.nodes:
        assert tree.mask(node, free) == mask_of(g for g in node.gpus if g in free)
        assert tree.available(node, free) == sorted(g for g in node.gpus if g in free)
