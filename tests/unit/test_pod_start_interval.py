"""bench.pod_start's 95 % bootstrap interval of the p50 overhead (pure logic: no runtime needed)."""

from __future__ import annotations

import random

import pytest

from bench.pod_start import overhead_interval


def test_a_constant_overhead_has_no_spread() -> None:
    plain = [0.2 + i / 1000 for i in range(100)]
    gpu = [p * 1.1 for p in plain]
    low, high = overhead_interval(gpu, plain)
    assert low == high == 10.0


def test_the_interval_holds_the_overhead_and_narrows_with_more_pods() -> None:
    rng = random.Random(7)

    def pods(n: int) -> tuple[list[float], list[float]]:
        plain = [rng.gauss(0.230, 0.030) for _ in range(n)]
        gpu = [rng.gauss(0.253, 0.030) for _ in range(n)]  # +10 % at the median, noisy
        return gpu, plain

    low, high = overhead_interval(*pods(100))
    assert low < 10.0 < high
    assert high - low > 4.0  # 100 noisy pods cannot pin a p50 ratio to a point
    wide = high - low
    low, high = overhead_interval(*pods(1600))
    assert low < 10.0 < high
    assert high - low < wide / 2  # 16x the pods: about a quarter of the width


def test_the_pairs_must_match() -> None:
    with pytest.raises(ValueError, match="as many GPU pods as plain pods"):
        overhead_interval([0.2, 0.3], [0.2])
    with pytest.raises(ValueError):
        overhead_interval([], [])
