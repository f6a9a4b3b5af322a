"""bench.pod_start --cpu (bench/pod_start_cpu.py): CPU time per process inside each pod's window."""

from __future__ import annotations

import os
import sys
import time

import pytest

from bench.pod_start_cpu import MACHINE, CpuMeter, machine_cpu_ns, process_cpu_ns

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")


def spin(cpu_seconds: float) -> None:
    """Run this thread on a CPU for ``cpu_seconds`` (its own CPU time, however busy the machine)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


def test_a_busy_window_is_charged_to_the_process_that_ran_and_to_the_machine() -> None:
    meter = CpuMeter()
    meter.watch("me", os.getpid())
    meter.watch("gone", None)  # not started: not watched
    meter.end("gpu")  # before any begin (the warm-up): nothing recorded
    for kind, busy in (("gpu", 0.1), ("plain", 0.0), ("gpu", 0.1)):
        meter.begin()
        spin(busy)
        meter.end(kind)
    table = meter.table()
    assert list(table["gpu"]) == ["me", MACHINE]
    assert 95 < table["gpu"]["me"] < 1000  # ms, means over the two busy windows
    assert table["plain"]["me"] < 20
    assert table["gpu"][MACHINE] >= 80  # 10 ms ticks, other processes count too
    assert len(meter.windows["gpu"]) == 2


def test_a_process_that_is_gone_reads_as_nothing() -> None:
    assert process_cpu_ns(2**22 + 12345) == 0
    assert process_cpu_ns(os.getpid()) > 0
    before = machine_cpu_ns()
    spin(0.05)
    assert machine_cpu_ns() > before
