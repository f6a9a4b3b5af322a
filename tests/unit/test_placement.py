"""Placement: share best-fit, whole-GPU picks, NVLink-aware sets, deterministic ties, clear refusals."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.errors import ServiceError
from libs.gpu.fake import PROFILES_DIR, FakeBackend
from libs.ledger.state import GpuUsage
from libs.placement import evaluators
from libs.placement.placement import place, topology

GIB = 1 << 30


def gpus(n: int, memory: int = 16 * GIB) -> list[GpuUsage]:
    return [GpuUsage(index=i, uuid=f"GPU-{i}", minor=i, memory_total=memory) for i in range(n)]


def links_from(pairs: dict[tuple[int, int], str], n: int, default: str = "SYS") -> list[list[str]]:
    m = [["X" if i == j else default for j in range(n)] for i in range(n)]
    for (a, b), tok in pairs.items():
        m[a][b] = m[b][a] = tok
    return m


def test_share_prefers_the_fullest_gpu_that_fits() -> None:
    g = gpus(3)
    g[1].cores_used, g[1].memory_used, g[1].alloc_ids = 70, 4 * GIB, ["a"]
    g[2].cores_used, g[2].memory_used, g[2].alloc_ids = 40, 1 * GIB, ["b"]
    (share,) = place(g, links_from({}, 3), cores=30, memory=GIB, share_mode=True)
    assert (share.index, share.cores, share.memory) == (1, 30, GIB)
    (share,) = place(g, links_from({}, 3), cores=40, memory=GIB, share_mode=True)
    assert share.index == 2  # GPU1 has only 30 cores left


def test_share_ties_go_to_the_lowest_index() -> None:
    (share,) = place(gpus(4), links_from({}, 4), cores=10, memory=GIB, share_mode=True)
    assert share.index == 0


@pytest.mark.parametrize(
    ("cores", "memory", "share_mode", "code", "text"),
    [
        (50, GIB, False, 400, "share mode is not enabled"),
        (50, 0, True, 400, "that cores or memory is zero"),
        (50, 64 * GIB, True, 400, "is larger than"),
        (150, 0, True, 400, "must be multiple of 100"),
        (900, 0, True, 400, "asks for 9 GPUs"),
        (0, GIB, True, 400, "at least 1"),
    ],
)
def test_refusals_say_why(cores: int, memory: int, share_mode: bool, code: int, text: str) -> None:
    with pytest.raises(ServiceError) as err:
        place(gpus(4), links_from({}, 4), cores=cores, memory=memory, share_mode=share_mode)
    assert err.value.code == code
    assert text in err.value.message


def test_full_node_is_a_capacity_error() -> None:
    g = gpus(2)
    for x in g:
        x.cores_used, x.memory_used, x.alloc_ids = 100, x.memory_total, ["z"]
    with pytest.raises(ServiceError) as err:
        place(g, links_from({}, 2), cores=100, memory=0, share_mode=True)
    assert err.value.code == 503
    with pytest.raises(ServiceError) as err:
        place(g, links_from({}, 2), cores=10, memory=GIB, share_mode=True)
    assert err.value.code == 503 and "no free node" in err.value.message


def test_whole_gpu_takes_all_of_it() -> None:
    (share,) = place(gpus(2), links_from({}, 2), cores=100, memory=4 * GIB, share_mode=True)
    assert (share.cores, share.memory) == (100, 16 * GIB)


def test_single_gpu_fills_a_broken_nvlink_pair_first() -> None:
    # 0-1 and 2-3 are NVLink pairs, GPU4 is alone. gpu-manager's fragment evaluator descends only into
    # groups, never picks a lone leaf over a group: GPU0 first, then GPU1 (the pair already broken),
    # which keeps the pair 2-3 whole for a later 2-GPU request.
    links = links_from({(0, 1): "NV2", (2, 3): "NV2"}, 5)
    g = gpus(5)
    order = []
    for _ in range(3):
        (share,) = place(g, links, cores=100, memory=0, share_mode=True)
        order.append(share.index)
        g[share.index].alloc_ids, g[share.index].cores_used = ["x"], 100
    assert order == [0, 1, 2]


def test_two_gpus_prefer_nvlink_then_pcie_level() -> None:
    links = links_from({(0, 1): "PHB", (1, 2): "PIX", (2, 3): "NV4", (0, 3): "NODE"}, 4)
    chosen = place(gpus(4), links, cores=200, memory=0, share_mode=True)
    assert [s.index for s in chosen] == [2, 3]
    busy = gpus(4)
    busy[3].alloc_ids, busy[3].cores_used = ["x"], 10
    chosen = place(busy, links, cores=200, memory=0, share_mode=True)
    assert [s.index for s in chosen] == [1, 2]  # PIX beats PHB and SYS


def test_partly_used_gpus_are_not_idle() -> None:
    g = gpus(2)
    g[0].cores_used, g[0].memory_used, g[0].alloc_ids = 10, GIB, ["a"]
    (share,) = place(g, links_from({}, 2), cores=100, memory=0, share_mode=True)
    assert share.index == 1


def test_large_nodes_use_the_greedy_path() -> None:
    n = 32
    links = links_from({(i, i + 1): "NV1" for i in range(0, n - 1, 2)}, n, default="SYS")
    chosen = place(gpus(n), links, cores=1600, memory=0, share_mode=True)
    indexes = sorted(s.index for s in chosen)
    assert len(set(indexes)) == 16
    # Too many sets to try them all (32 choose 16): the greedy search still keeps NVLink pairs whole.
    assert all(i ^ 1 in indexes for i in indexes)


# --- gpu-manager's evaluators on the bundled profiles (reference 3.5) ---------------------------

def profile(name: str) -> tuple[list[GpuUsage], tuple[tuple[str, ...], ...]]:
    inv = FakeBackend(PROFILES_DIR / f"{name}.yaml").inventory()
    usage = [GpuUsage(index=g.index, uuid=g.uuid, minor=g.minor, memory_total=g.memory) for g in inv.gpus]
    return usage, inv.links


def hold(g: list[GpuUsage], *indexes: int, cores: int = 100) -> None:
    for i in indexes:
        g[i].alloc_ids.append(f"held-{i}")
        g[i].cores_used += cores
        g[i].memory_used += g[i].memory_total if cores == 100 else GIB


def picks(g: list[GpuUsage], links: object, cores: int) -> list[int]:
    return [s.index for s in place(g, links, cores=cores, memory=GIB, share_mode=True)]  # type: ignore[arg-type]


def test_fragment_fills_the_most_fragmented_group() -> None:
    g, links = profile("pcie-6gpu")
    # All free: SYS -> (PXB 3 free, NODE 3 free) tie -> lowest index -> PIX(0,1) (2 free) -> GPU0.
    assert picks(g, links, 100) == [0]
    hold(g, 0)
    assert picks(g, links, 100) == [1]  # PXB has 2 free now, fewer than NODE's 3; its PIX has 1
    hold(g, 1)
    assert picks(g, links, 100) == [2]
    hold(g, 2)
    assert picks(g, links, 100) == [3]  # PXB is full; NODE -> PIX(3,4)
    hold(g, 4)
    # NODE has 3 and 5 free; its child group PIX(3,4) has 1: GPU3, not the lone GPU5.
    assert picks(g, links, 100) == [3]


def test_fragment_ignores_share_held_gpus() -> None:
    g, links = profile("pcie-4gpu")
    hold(g, 0, cores=10)  # any share takes a GPU out of every mask (reference 3.6)
    assert picks(g, links, 100) == [1]


def test_link_takes_the_closest_then_tightest_group() -> None:
    g, links = profile("pcie-6gpu")
    assert picks(g, links, 200) == [0, 1]      # PIX groups tie on level and fit: lowest index
    hold(g, 1)
    assert picks(g, links, 200) == [3, 4]      # the only PIX group with 2 free
    hold(g, 4)
    assert picks(g, links, 200) == [0, 2]      # PXB (level 20) before NODE (40)
    assert picks(g, links, 300) == [0, 2, 3]   # no group below the root has 3 free: root, lowest
    hold(g, 2)
    assert picks(g, links, 200) == [3, 5]      # NODE
    g2, _ = profile("pcie-6gpu")
    hold(g2, 0)
    assert picks(g2, links, 300) == [3, 4, 5]  # NODE has exactly 3 free (tight), PXB only 2
    assert picks(g2, links, 400) == [1, 2, 3, 4]  # SYS: the lowest four free


def test_link_fit_breaks_level_ties() -> None:
    # Two PXB groups of three: the one with fewer free GPUs wins (tightest fit).
    links = links_from({(0, 1): "PXB", (0, 2): "PXB", (1, 2): "PXB",
                        (3, 4): "PXB", (3, 5): "PXB", (4, 5): "PXB"}, 6, default="SYS")
    g = gpus(6)
    hold(g, 3)
    assert picks(g, links, 200) == [4, 5]


def test_link_prefers_nvlink_over_pcie_closeness() -> None:
    # 0-1 behind one switch (PIX), 2-3 NVLinked across the sockets (NV4 hides their PCIe level).
    links = links_from({(0, 1): "PIX", (2, 3): "NV4", (0, 2): "SYS", (0, 3): "SYS",
                        (1, 2): "SYS", (1, 3): "SYS"}, 4)
    assert picks(gpus(4), links, 200) == [2, 3]


def test_link_prefers_more_nvlinks() -> None:
    # A partial mesh: 0-1 NV1, 0-2 NV2, 1-2 NV1, 2-3 NV2, 1-3 NV2, 0-3 no NVLink.
    links = links_from({(0, 1): "NV1", (0, 2): "NV2", (1, 2): "NV1", (2, 3): "NV2",
                        (1, 3): "NV2", (0, 3): "SYS"}, 4)
    assert picks(gpus(4), links, 200) == [0, 2]     # NV2 pairs: (0,2) (1,3) (2,3); lowest indexes
    assert picks(gpus(4), links, 300) == [1, 2, 3]  # 2+1+2 = 5 links, the most of any three
    g = gpus(4)
    hold(g, 2)
    assert picks(g, links, 200) == [1, 3]


def test_link_on_nvswitch_is_gpu_managers_choice() -> None:
    g, links = profile("dgx-a100-8gpu")
    assert picks(g, links, 400) == [0, 1, 2, 3]
    hold(g, 1, 5)
    assert picks(g, links, 300) == [0, 2, 3]


def test_link_on_a_hybrid_cube_mesh_follows_the_links() -> None:
    # DGX-1: NV2 pairs 0-3, 1-2, 2-3 and the quad twins; a 4-GPU job gets a whole quad (9 links).
    g, links = profile("dgx1-v100-8gpu")
    assert picks(g, links, 200) == [0, 3]
    hold(g, 0, 3)
    assert picks(g, links, 400) == [4, 5, 6, 7]
    assert picks(g, links, 200) == [1, 2]


def test_share_compares_whole_memory_blocks() -> None:
    # GPU0 has 100 MiB more left than GPU1, but the same number of whole 256 MiB blocks: index wins.
    g = gpus(2)
    g[0].alloc_ids, g[0].cores_used, g[0].memory_used = ["a"], 50, GIB - (100 << 20)
    g[1].alloc_ids, g[1].cores_used, g[1].memory_used = ["b"], 50, GIB
    (share,) = place(g, links_from({}, 2), cores=10, memory=GIB, share_mode=True)
    assert share.index == 0
    g[0].memory_used = GIB + (300 << 20)  # now a whole block less: the tighter GPU0 is the best fit
    (share,) = place(g, links_from({}, 2), cores=10, memory=GIB, share_mode=True)
    assert share.index == 0
    g[0].memory_used = GIB - (300 << 20)  # a whole block more than GPU1: GPU1 is the best fit
    (share,) = place(g, links_from({}, 2), cores=10, memory=GIB, share_mode=True)
    assert share.index == 1


def test_share_never_lands_on_a_whole_gpu() -> None:
    g, links = profile("pcie-4gpu")
    hold(g, 0, 1, 2)
    assert picks(g, links, 50) == [3]


def test_more_than_32_gpus() -> None:
    n = 40
    links = [["X" if i == j else ("PIX" if i // 2 == j // 2 else "SYS") for j in range(n)] for i in range(n)]
    g = gpus(n)
    hold(g, *range(35))
    assert picks(g, links, 100) == [35]   # PIX(34,35) has one free: the fragmented group first
    assert picks(g, links, 200) == [36, 37]
    hold(g, 36, 38)
    assert picks(g, links, 200) == [35, 37]  # no PIX pair is free: the root's lowest two


def test_no_links_at_all() -> None:
    # An inventory recorded without links (GPUs share no known level): placement still works.
    assert picks(gpus(3), (), 200) == [0, 1]
    assert picks(gpus(3), (), 100) == [0]


# --- properties ---------------------------------------------------------------------------------

PCIE = ["PIX", "PXB", "PHB", "NODE", "SYS"]


@st.composite
def nodes(draw: st.DrawFn, tokens: list[str]) -> tuple[list[list[str]], frozenset[int], int]:
    n = draw(st.integers(min_value=2, max_value=9))
    m = [["X"] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            m[i][j] = m[j][i] = draw(st.sampled_from(tokens))
    free = draw(st.frozensets(st.integers(0, n - 1)))
    want = draw(st.integers(min_value=2, max_value=n))
    return m, free, want


@settings(max_examples=200, deadline=None)
@given(nodes(PCIE))
def test_without_nvlink_the_set_key_is_gpu_managers_link(case: tuple[list[list[str]], frozenset[int], int]) -> None:
    links, free, want = case
    tree, nv = topology(links, len(links))
    by_tree = evaluators.link_by_tree(tree, free, want)
    combos = list(itertools.combinations(sorted(free), want))
    by_key = min(combos, key=lambda s: evaluators.set_key(tree, free, nv, s)) if combos else None
    assert by_tree == by_key


@settings(max_examples=200, deadline=None)
@given(nodes([*PCIE, "NV1", "NV2", "NV4"]))
def test_link_maximises_nvlinks(case: tuple[list[list[str]], frozenset[int], int]) -> None:
    links, free, want = case
    g = gpus(len(links))
    hold(g, *(i for i in range(len(links)) if i not in free))
    if len(free) < want:
        with pytest.raises(ServiceError, match="no free node"):
            place(g, links, cores=want * 100, memory=0, share_mode=True)
        return
    chosen = [s.index for s in place(g, links, cores=want * 100, memory=0, share_mode=True)]
    assert set(chosen) <= free and len(set(chosen)) == want
    _, nv = topology(links, len(links))
    best = max(evaluators.nvlink_sum(nv, s) for s in itertools.combinations(sorted(free), want))
    assert evaluators.nvlink_sum(nv, chosen) == best
    assert place(g, links, cores=want * 100, memory=0, share_mode=True) == place(
        g, links, cores=want * 100, memory=0, share_mode=True)


@settings(max_examples=200, deadline=None)
@given(nodes([*PCIE, "NV2"]))
def test_fragment_takes_a_free_gpu_from_the_most_fragmented_group(
        case: tuple[list[list[str]], frozenset[int], int]) -> None:
    links, free, _ = case
    tree, _ = topology(links, len(links))
    got = evaluators.fragment(tree, free)
    if not free:
        assert got is None
        return
    assert got in free
    # Walking down from the root, no sibling group with free GPUs had fewer of them than the one taken.
    path = [a for a in tree.ancestors(got)][::-1]
    for parent, child in itertools.pairwise(path):
        siblings = [c for c in tree.children(parent) if not c.is_leaf and tree.available(c, free)]
        assert len(tree.available(child, free)) == min(len(tree.available(c, free)) for c in siblings)
