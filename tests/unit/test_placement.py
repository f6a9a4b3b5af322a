"""Placement: share best-fit, whole-GPU picks, NVLink-aware sets, deterministic ties, clear refusals."""

from __future__ import annotations

import pytest

from libs.errors import ServiceError
from libs.ledger.state import GpuUsage
from services.allocator.placement import place

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


def test_single_gpu_keeps_nvlink_pairs_whole() -> None:
    # 0-1 and 2-3 are NVLink pairs, GPU4 is alone: a one-GPU request should take GPU4.
    links = links_from({(0, 1): "NV2", (2, 3): "NV2"}, 5)
    (share,) = place(gpus(5), links, cores=100, memory=0, share_mode=True)
    assert share.index == 4


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
    assert len({s.index for s in chosen}) == 16
