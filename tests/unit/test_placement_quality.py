"""The placement-quality benchmark's own parts: the offline bound really bounds, first-fit is naive."""

from __future__ import annotations

import random

from bench.dra_placement import run_dra_trace
from bench.placement_quality import Request, Run, first_fit, make_trace, offline_bound, run_trace
from libs.gpu.fake import PROFILES_DIR, FakeBackend
from libs.placement.placement import place

INV = FakeBackend(PROFILES_DIR / "pcie-4gpu.yaml").inventory()


def test_bound_on_a_hand_made_trace() -> None:
    # Two 60-core pods need two GPUs, a 2-GPU pod takes the other two: a second 2-GPU pod cannot
    # fit, whatever the placement: the bound is 3 of 4.
    ops: list[Request | str] = [Request("a", 60, 1), Request("b", 60, 1), Request("c", 200, 0),
                                Request("d", 200, 0)]
    assert offline_bound(INV, ops) == 3
    # With a departure in between, it fits once "c" left.
    assert offline_bound(INV, [*ops[:3], "c", ops[3]]) == 4


def test_bound_counts_memory() -> None:
    ops: list[Request | str] = [Request(f"p{i}", 10, 60) for i in range(9)]  # 60 x 256 MiB = 15 GiB of 24
    assert offline_bound(INV, ops) == 4


def test_no_placer_beats_the_bound() -> None:
    rng = random.Random(5)
    for _ in range(15):
        ops = make_trace(rng, INV, {2: 1, 3: 1}, arrivals=12, churn=True)
        bound = offline_bound(INV, ops)
        for placer in (place, first_fit):
            assert run_trace(INV, ops, placer).placed <= bound
        assert run_dra_trace(INV, ops, Run()).placed <= bound


def test_first_fit_ignores_topology_and_fit() -> None:
    ops: list[Request | str] = [Request("a", 100, 0), Request("b", 200, 0)]
    ours = run_trace(INV, ops, place)
    naive = run_trace(INV, ops, first_fit)
    assert ours.placed == naive.placed == 2
    assert naive.cross_socket == [False] and ours.nvlinks_per_pair == [0.0]


def test_dra_mode_places_claims_through_the_scheduler_side_allocator() -> None:
    # Consumable capacity: two 60-core shares cannot share a GPU, so they take two; the 2-GPU claim
    # takes the other two, a second one fits nowhere (the bound of the hand-made trace above).
    ops: list[Request | str] = [Request("a", 60, 1), Request("b", 60, 1), Request("c", 200, 0),
                                Request("d", 200, 0)]
    run = run_dra_trace(INV, ops, Run())
    assert run.placed == 3 and run.utilisation == (60 + 60 + 200) / 400
    # Memory counts too: 60 blocks of 96 per GPU, so one such share per GPU.
    assert run_dra_trace(INV, [Request(f"p{i}", 10, 60) for i in range(9)], Run()).placed == 4
