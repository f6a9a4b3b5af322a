"""bench/allocator_cpu.py still runs the allocator's real handlers: each grant goes to its own pod and
each release frees it (the benchmark raises otherwise), and the figures it prints are measured ones."""

from __future__ import annotations

from pathlib import Path

from bench.allocator_cpu import run


async def test_the_cpu_benchmark_grants_and_releases_every_pod(tmp_path: Path) -> None:
    results = await run(30, 3, tmp_path)
    assert results["allocates"] == 30
    for key in ("allocate_cpu", "allocate_wall", "release_cpu"):
        row = results[key]
        assert isinstance(row, dict)
        assert 0 < row["p50_us"] <= row["p90_us"], (key, row)
    wall, cpu = results["allocate_wall"], results["allocate_cpu"]
    assert isinstance(wall, dict) and isinstance(cpu, dict)
    assert wall["mean_us"] > 0 and cpu["mean_us"] > 0
