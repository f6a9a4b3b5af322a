"""bench.pod_start --cpu (bench/pod_start_cpu.py): CPU time per process inside each pod's window, and
inside each step of it (--cpu-steps)."""

from __future__ import annotations

import asyncio
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


def test_a_step_is_charged_with_what_ran_inside_its_calls_while_a_window_was_open() -> None:
    class Runtime:  # patched in place: a class of this test's own
        async def sandbox(self, busy: float, pause: float = 0.0) -> str:
            spin(busy)
            await asyncio.sleep(pause)
            return "made"

        async def start(self) -> None:
            await asyncio.sleep(0)

    meter = CpuMeter()
    meter.watch("me", os.getpid())
    meter.wrap_step(Runtime, "sandbox", "2 sandbox")
    meter.wrap_step(Runtime, "start", "5 start")
    runtime = Runtime()

    async def pods() -> None:
        assert await runtime.sandbox(0.05) == "made"  # no window open: not counted anywhere
        meter.begin()
        await runtime.sandbox(0.06)
        await runtime.sandbox(0.04)  # a pod's calls of one step add up
        spin(0.05)  # inside the window, in no step
        meter.end("gpu")
        meter.begin()  # a GPU pod that took no step: it counts as 0 in the step's mean
        meter.end("gpu")
        meter.begin()
        await runtime.start()
        late = asyncio.ensure_future(runtime.sandbox(0.0, pause=0.05))
        await asyncio.sleep(0.01)
        meter.end("plain")  # the sandbox call above is still running: counted up to here
        await late  # and no further

    asyncio.run(pods())
    first = meter.steps["gpu"][0]
    assert list(first) == ["2 sandbox"]
    assert 95 < first["2 sandbox"]["me"] < 140  # ms: both calls, neither the call before nor the spin after
    assert meter.windows["gpu"][0]["me"] >= 145  # the window holds the spin outside the steps too
    table = meter.step_table()
    assert list(table["gpu"]["2 sandbox"]) == ["me", MACHINE]
    assert table["gpu"]["2 sandbox"]["me"] == round(first["2 sandbox"]["me"] / 2, 2)
    assert list(table["plain"]) == ["2 sandbox", "5 start"]
    assert table["plain"]["2 sandbox"]["me"] < 20
    assert len(meter.steps["plain"]) == 1
