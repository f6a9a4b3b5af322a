"""The Allocate response matches gpu-manager's, field by field (gpu-manager-reference.md 3.7)."""

from __future__ import annotations

from pathlib import Path

from libs.events.schema import GpuShare
from services.allocator.responses import build_response


def test_share_response() -> None:
    resp = build_response(
        shares=(GpuShare(index=1, uuid="GPU-aaa", minor=3, cores=50, memory=1 << 30),),
        cores=50, memory=1 << 30, pod_uid="0e1f", vm_root=Path("/vm"), vdriver_root=Path("/vd"),
    )
    assert [d.container_path for d in resp.devices] == ["/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert all(d.host_path == d.container_path and d.permissions == "rwm" for d in resp.devices)
    assert resp.envs == {"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64", "NVIDIA_VISIBLE_DEVICES": "GPU-aaa"}
    assert [(m.container_path, m.host_path, m.read_only) for m in resp.mounts] == [
        ("/usr/local/nvidia", "/vd/nvidia", True), ("/etc/vcuda", "/vm/0e1f", True)]
    assert resp.annotations == {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "1073741824",
                                "tencent.com/vcuda-device": "/dev/nvidia3"}


def test_whole_gpus_get_the_original_driver_and_compat32() -> None:
    shares = tuple(GpuShare(index=i, uuid=f"GPU-{i}", minor=i, cores=100, memory=1) for i in (0, 1))
    resp = build_response(shares=shares, cores=200, memory=0, pod_uid="p", vm_root=Path("/vm"),
                          vdriver_root=Path("/vd"), compat32=True, extra_devices=("/dev/fuse",))
    assert resp.envs["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib"
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-0,GPU-1"
    assert resp.mounts[0].host_path == "/vd/origin"
    assert resp.annotations["tencent.com/vcuda-device"] == "/dev/nvidia0,/dev/nvidia1"
    assert resp.annotations["tencent.com/vcuda-memory"] == "0"
    assert resp.devices[-1].container_path == "/dev/fuse"
