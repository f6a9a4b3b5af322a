"""The NVML monitor on a machine with an NVIDIA GPU (run with GPULEDGER_GPU_TESTS=1): the real event-set,
sampling and probe calls."""

from __future__ import annotations

import time

import pytest

from libs.gpu import load_inventory
from libs.gpu.backends import open_monitor
from libs.gpu.health import EVENT_KINDS
from libs.gpu.nvml_monitor import NvmlMonitor


@pytest.mark.gpu
def test_real_nvml_events_samples_and_probes() -> None:
    inv = load_inventory("nvml")
    mon = open_monitor(inv)
    assert isinstance(mon, NvmlMonitor)
    try:
        assert mon._events is not None, "nvmlEventSetCreate failed"
        start = time.monotonic()
        events = mon.wait_events(0.5)  # a healthy GPU usually reports nothing: the wait must time out
        assert time.monotonic() - start < 5
        for ev in events:
            assert 0 <= ev.index < len(inv.gpus) and ev.kind in EVENT_KINDS
        samples = mon.sample()
        assert [s.index for s in samples] == [g.index for g in inv.gpus]
        for s, g in zip(samples, inv.gpus, strict=True):
            assert 0 <= s.utilization <= 100
            assert 0 < s.memory_used <= g.memory  # the driver always holds some memory
            for p in s.processes:
                assert p.pid > 0 and p.memory >= 0
        assert all(mon.probe(g.index) is None for g in inv.gpus)
    finally:
        mon.close()
