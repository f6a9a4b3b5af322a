"""bench.allocate_rtt's 95 % block-bootstrap interval of the p99 ratio (pure logic: no services)."""

from __future__ import annotations

import random

import pytest

from bench.allocate_rtt import percentile, ratio_interval


def test_ours_at_twice_the_floor_everywhere_has_no_spread() -> None:
    floor = [0.002 + (i % 37) / 10_000 for i in range(400)]
    ours = [2 * v for v in floor for _ in range(2)]  # two of ours per floor Allocate, each twice as slow
    assert ratio_interval(ours, floor) == (2.0, 2.0)


def test_a_slow_stretch_of_the_run_widens_the_interval_around_the_figure() -> None:
    rng = random.Random(3)
    floor = [rng.lognormvariate(-6.0, 0.3) for _ in range(2000)]
    ours = [rng.lognormvariate(-5.3, 0.3) for _ in range(4000)]
    low, high = ratio_interval(ours, floor)
    figure = percentile(ours, 0.99) / percentile(floor, 0.99)
    assert low <= figure <= high
    steady = high - low
    # The same Allocates, but one tenth of the run (where ours and the floor's took turns) was slower
    # for ours only, as when something else on the machine woke beside our services.
    ours_drift = [v * (3 if 1600 <= i < 2000 else 1) for i, v in enumerate(ours)]
    low, high = ratio_interval(ours_drift, floor)
    assert low <= percentile(ours_drift, 0.99) / percentile(floor, 0.99) <= high
    assert high - low > 2 * steady


def test_the_counts_must_pair_up() -> None:
    with pytest.raises(ValueError, match="two of ours per floor Allocate"):
        ratio_interval([0.001] * 100, [0.001] * 100)
    with pytest.raises(ValueError, match="at least 50"):
        ratio_interval([0.001] * 20, [0.001] * 10)
