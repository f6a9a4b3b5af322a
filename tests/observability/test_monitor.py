"""The fake monitor's deterministic samples and injection; container IDs from cgroup files."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.gpu.backends import load_inventory, open_monitor
from libs.gpu.monitor import FakeMonitor, InjectRequest, ProcessSample, apply_injection, container_id_of

CID = "0123456789abcdef" * 4


def test_fake_samples_are_deterministic() -> None:
    mon = open_monitor(load_inventory("fake"))
    assert isinstance(mon, FakeMonitor)
    idle = mon.sample()
    assert [(s.index, s.utilization, s.memory_used, s.processes) for s in idle] == [
        (i, 0.0, 0, ()) for i in range(4)]
    mon.set_processes(2, (ProcessSample(pid=1, sm_util=70, memory=5), ProcessSample(pid=2, sm_util=50, memory=7)))
    s = mon.sample()[2]
    assert (s.utilization, s.memory_used, len(s.processes)) == (100.0, 12, 2)  # capped at 100 %
    assert mon.sample() == mon.sample()


def test_injection_and_event_wait() -> None:
    mon = FakeMonitor(load_inventory("fake"))
    assert mon.wait_events(0.01) == []
    done = apply_injection(mon, InjectRequest(gpu=1, xid=79, ecc="double-bit", probe_error="lost"))
    assert done == ["probes of GPU 1 fail: lost", "XID 79 on GPU 1", "ecc-double-bit ECC error on GPU 1"]
    events = mon.wait_events(0.01)
    assert [(e.index, e.kind, e.xid) for e in events] == [(1, "xid", 79), (1, "ecc-double-bit", 0)]
    assert mon.probe(1) == "lost" and mon.probe(0) is None
    apply_injection(mon, InjectRequest(gpu=1, probe_error=""))
    assert mon.probe(1) is None
    with pytest.raises(ValueError, match="no GPU 4"):
        apply_injection(mon, InjectRequest(gpu=4, xid=79))
    with pytest.raises(ValueError, match="nothing to inject"):
        apply_injection(mon, InjectRequest(gpu=0))
    with pytest.raises(ValueError, match="double-bit or single-bit"):
        apply_injection(mon, InjectRequest(gpu=0, ecc="triple"))


@pytest.mark.parametrize("line", [
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-{CID}.scope",
    f"12:memory:/kubepods/burstable/pod1234/{CID}",
    f"0::/system.slice/docker-{CID}.scope",
    f"0::/kubepods.slice/kubepods-pod1.slice/crio-{CID}.scope",
])
def test_container_id_from_cgroup(tmp_path: Path, line: str) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(f"1:name=systemd:/init.scope\n{line}\n")
    assert container_id_of(42, tmp_path) == CID


def test_no_container_id(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text("0::/user.slice/user-1000.slice/session-2.scope\n")
    assert container_id_of(7, tmp_path) == ""
    assert container_id_of(8, tmp_path) == ""  # the process is gone
