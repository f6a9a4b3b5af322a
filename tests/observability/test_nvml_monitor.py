"""The NVML monitor against a small `pynvml` stand-in: event registration, event translation, the wait's
timeout, samples with per-process utilisation, probes. (The real calls: test_real_nvml_health.py.)"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from libs.events.schema import GpuInfo
from libs.gpu.inventory import Inventory
from libs.gpu.nvml_monitor import NvmlMonitor

XID_T, DBE_T, SBE_T = 8, 2, 1
CID = "ab" * 32


class NVMLError(Exception):
    pass


class NVMLError_Timeout(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class StandIn:
    def __init__(self, supported: dict[int, int]) -> None:
        self.supported = supported
        self.registered: dict[int, int] = {}
        self.queue: collections.deque[Any] = collections.deque()
        self.waits: list[int] = []
        self.calls: list[str] = []
        self.lost: set[int] = set()

    def module(self) -> ModuleType:
        m = ModuleType("pynvml")
        m.NVMLError, m.NVMLError_Timeout = NVMLError, NVMLError_Timeout
        m.NVMLError_NotSupported = NVMLError_NotSupported
        m.nvmlEventTypeXidCriticalError, m.nvmlEventTypeDoubleBitEccError = XID_T, DBE_T
        m.nvmlEventTypeSingleBitEccError = SBE_T
        m.nvmlInit = lambda: self.calls.append("init")
        m.nvmlShutdown = lambda: self.calls.append("shutdown")
        m.nvmlDeviceGetHandleByIndex = self._handle
        m.nvmlEventSetCreate = lambda: "set"
        m.nvmlEventSetFree = lambda s: self.calls.append(f"free {s}")
        m.nvmlDeviceGetSupportedEventTypes = lambda h: self.supported[h]
        m.nvmlDeviceRegisterEvents = self._register
        m.nvmlEventSetWait_v2 = self._wait
        m.nvmlDeviceGetUUID = lambda h: f"GPU-{h}".encode()
        m.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=100, used=40 + h)
        m.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=10 * h, memory=0)
        m.nvmlDeviceGetComputeRunningProcesses = lambda h: [SimpleNamespace(pid=500 + h, usedGpuMemory=7),
                                                            SimpleNamespace(pid=600, usedGpuMemory=None)]
        m.nvmlDeviceGetProcessUtilization = self._proc_util
        return m

    def _handle(self, i: int) -> int:
        if i in self.lost:
            raise NVMLError("GPU is lost")
        return i

    def _register(self, h: int, mask: int, event_set: str) -> None:
        if not mask:
            raise NVMLError_NotSupported("Not Supported")
        self.registered[h] = mask

    def _wait(self, event_set: str, timeout_ms: int) -> Any:
        self.waits.append(timeout_ms)
        if not self.queue:
            raise NVMLError_Timeout("Timeout")
        return self.queue.popleft()

    def _proc_util(self, h: int, since: int) -> list[Any]:
        if since:
            raise NVMLError("Not Found")  # nothing new since the last sample
        return [SimpleNamespace(pid=500 + h, smUtil=33, timeStamp=1000)]


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[StandIn, NvmlMonitor]:
    fake = StandIn(supported={0: XID_T | DBE_T | SBE_T, 1: XID_T, 2: 0})
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    inv = Inventory(backend="nvml", driver_version="", links=(),
                    gpus=tuple(GpuInfo(index=i, minor=i, uuid=f"GPU-{i}", memory=100) for i in range(3)))
    (tmp_path / "500").mkdir()
    (tmp_path / "500" / "cgroup").write_text(f"0::/kubepods/pod1/{CID}\n")
    mon = NvmlMonitor(inv, proc=tmp_path)
    yield fake, mon
    mon.close()


def test_registers_the_supported_event_types(nvml: tuple[StandIn, NvmlMonitor]) -> None:
    fake, _ = nvml
    assert fake.registered == {0: XID_T | DBE_T | SBE_T, 1: XID_T}  # GPU 2 supports none: skipped, not fatal


def test_events_are_translated_and_the_wait_times_out(nvml: tuple[StandIn, NvmlMonitor]) -> None:
    fake, mon = nvml
    assert mon.wait_events(0.25) == []
    assert fake.waits == [250]
    fake.queue.extend([SimpleNamespace(device=1, eventType=XID_T, eventData=79),
                       SimpleNamespace(device=0, eventType=DBE_T, eventData=0),
                       SimpleNamespace(device=0, eventType=4, eventData=0)])  # a type we did not ask for
    events = mon.wait_events(1.0)
    assert [(e.index, e.kind, e.xid) for e in events] == [(1, "xid", 79), (0, "ecc-double-bit", 0)]


def test_samples_map_processes_to_containers(nvml: tuple[StandIn, NvmlMonitor]) -> None:
    _, mon = nvml
    s0 = mon.sample()[0]
    assert (s0.utilization, s0.memory_used) == (0.0, 40)
    by_pid = {p.pid: p for p in s0.processes}
    assert (by_pid[500].sm_util, by_pid[500].memory, by_pid[500].container_id) == (33.0, 7, CID)
    assert (by_pid[600].memory, by_pid[600].container_id) == (0, "")  # memory not reported (e.g. MIG)
    again = mon.sample()[0]  # no new utilisation samples since the last timestamp
    assert {p.pid: p.sm_util for p in again.processes} == {500: 0.0, 600: 0.0}


def test_probe_and_close(nvml: tuple[StandIn, NvmlMonitor]) -> None:
    fake, mon = nvml
    assert mon.probe(1) is None
    fake.lost.add(1)
    assert mon.probe(1) == "GPU is lost"
    mon.close()
    assert fake.calls[-2:] == ["free set", "shutdown"]
