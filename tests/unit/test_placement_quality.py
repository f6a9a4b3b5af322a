"""The placement-quality benchmark's own parts: the offline bound really bounds, first-fit is naive."""

from __future__ import annotations

import functools
import itertools
import random

from bench.dra_placement import run_dra_trace
from bench.placement_quality import (
    Request,
    Run,
    arrivals_before_capacity_runs_out,
    first_fit,
    make_trace,
    offline_bound,
    run_trace,
)
from libs.config import MEMORY_BLOCK
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


def plain_search(ops: list[Request | str], gpus: int, memory: int) -> int:
    """The bound the slow way: every placement on every GPU, nothing pruned, nothing interchangeable."""

    @functools.cache
    def best(i: int, state: tuple[tuple[int, int, frozenset[str]], ...]) -> int:
        if i == len(ops):
            return 0
        op = ops[i]
        if isinstance(op, str):
            return best(i + 1, tuple((c, m, pods) if op not in pods else _without(op, pods) for c, m, pods in state))
        most = 0
        if op.cores >= 100:
            idle = [k for k, (_, _, pods) in enumerate(state) if not pods]
            for chosen in itertools.combinations(idle, op.cores // 100):
                nxt = tuple((100, memory, frozenset({op.pod})) if k in chosen else g for k, g in enumerate(state))
                most = max(most, 1 + best(i + 1, nxt))
            return most
        for k, (c, m, pods) in enumerate(state):
            mem = op.blocks * MEMORY_BLOCK
            if c + op.cores <= 100 and m + mem <= memory:
                nxt = (*state[:k], (c + op.cores, m + mem, pods | {op.pod}), *state[k + 1:])
                most = max(most, 1 + best(i + 1, nxt))
        return most

    sizes = {op.pod: op for op in ops if isinstance(op, Request)}

    def _without(pod: str, pods: frozenset[str]) -> tuple[int, int, frozenset[str]]:
        rest = pods - {pod}
        cores = sum(min(100, sizes[p].cores) for p in rest)
        return cores, sum(memory if sizes[p].cores >= 100 else sizes[p].blocks * MEMORY_BLOCK for p in rest), rest

    return best(0, tuple((0, 0, frozenset()) for _ in range(gpus)))


def test_the_bound_equals_a_search_of_every_placement() -> None:
    # The bound's search stops early once a placement reaches what the node's totals allow, and treats
    # GPUs with the same pods as one: neither may change its answer.
    rng = random.Random(11)
    memory = min(g.memory for g in INV.gpus)
    below_total = 0
    for _ in range(40):
        ops = make_trace(rng, INV, {2: 1, 3: 1}, arrivals=9, churn=rng.random() < 0.5)
        bound = offline_bound(INV, ops)
        assert bound == plain_search(ops, len(INV.gpus), memory)
        below_total += bound < arrivals_before_capacity_runs_out(ops, len(INV.gpus), memory)[0]
    assert below_total > 0  # some traces are refused by fragmentation, not by the node's totals


def test_capacity_count_on_a_hand_made_trace() -> None:
    memory = min(g.memory for g in INV.gpus)
    # 4 GPUs: two whole-GPU pods, then 90 + 90 cores of shares fill the other two; the next 30 cores
    # need a fifth GPU whatever the placement. After "w1" leaves, the same request fits.
    ops: list[Request | str] = [Request("w1", 100, 0), Request("w2", 100, 0), Request("a", 90, 1),
                                Request("b", 90, 1), Request("c", 30, 1)]
    assert arrivals_before_capacity_runs_out(ops, 4, memory) == [4, 3, 2, 1, 0, 0]
    assert arrivals_before_capacity_runs_out([*ops[:4], "w1", ops[4]], 4, memory)[0] == 5


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
