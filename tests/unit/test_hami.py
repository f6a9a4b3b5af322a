"""hami-core delivery: HAMi-core's environment and mounts from a grant (landscape.md 2.1), pure."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from libs.config import Settings
from libs.events.schema import GpuShare
from libs.placement.hami_response import HamiDelivery
from libs.placement.responses import build_response

UID = "3f9c2a8e-1b7d-4c5e-9a0f-6d2e8b1c4a7f"
GIB = 1 << 30


def settings(**kw: object) -> Settings:
    return Settings(node_name="n", state_dir="/var/lib/gpuledger", limit_delivery="hami-core", **kw)  # type: ignore[arg-type]


def share(index: int, cores: int, memory: int) -> GpuShare:
    return GpuShare(index=index, uuid=f"GPU-{index}", minor=index, cores=cores, memory=memory)


def test_fractional_container_gets_hamis_environment_and_mounts() -> None:
    s = settings()
    delivery = HamiDelivery.from_settings(s)
    assert delivery is not None
    r = build_response(shares=[share(1, 30, 3 * 256 << 20)], cores=30, memory=3 * 256 << 20, pod_uid=UID,
                       vm_root=s.vm_root, vdriver_root=s.vdriver_root, hami=delivery, container="trainer")
    cache = r.envs.pop("CUDA_DEVICE_MEMORY_SHARED_CACHE")
    assert re.fullmatch(r"/usr/local/vgpu/[0-9a-f]{32}\.cache", cache)
    assert r.envs == {
        "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
        "NVIDIA_VISIBLE_DEVICES": "GPU-1",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "768m",
        "CUDA_DEVICE_SM_LIMIT": "30",
    }
    assert [(m.container_path, m.host_path, m.read_only) for m in r.mounts] == [
        ("/usr/local/nvidia", "/var/lib/gpuledger/vdriver/origin", True),
        ("/usr/local/vgpu", f"/var/lib/gpuledger/vm/{UID}/_hami/trainer", False),
        ("/usr/local/vgpu/libvgpu.so", "/usr/local/vgpu/libvgpu.so", True),
        ("/tmp/vgpulock", "/tmp/vgpulock", False),
        ("/etc/ld.so.preload", "/var/lib/gpuledger/vdriver/hami/ld.so.preload", True),
    ]
    # Same devices and annotations as gpu-manager's response.
    assert [d.container_path for d in r.devices] == ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert r.annotations["tencent.com/vcuda-core"] == "30"


def test_paths_are_configurable() -> None:
    s = settings(hami_library="/opt/hami/libvgpu.so", hami_mount_dir="/opt/vgpu/", hami_lock_dir="/run/vgpulock",
                 vm_dir="/srv/vm", vdriver_dir="/srv/vdriver")
    delivery = HamiDelivery.from_settings(s)
    r = build_response(shares=[share(0, 50, 4 * GIB)], cores=50, memory=4 * GIB, pod_uid=UID, vm_root=s.vm_root,
                       vdriver_root=s.vdriver_root, hami=delivery, container="c")
    assert r.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m"
    assert r.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"].startswith("/opt/vgpu/")
    assert {m.container_path: m.host_path for m in r.mounts} == {
        "/usr/local/nvidia": "/srv/vdriver/origin", "/opt/vgpu": f"/srv/vm/{UID}/_hami/c",
        "/opt/vgpu/libvgpu.so": "/opt/hami/libvgpu.so", "/run/vgpulock": "/run/vgpulock",
        "/etc/ld.so.preload": "/srv/vdriver/hami/ld.so.preload",
    }


def test_whole_gpus_are_unlimited_as_in_vcuda_mode() -> None:
    s = settings()
    shares = [share(0, 100, 80 * GIB), share(1, 100, 80 * GIB)]
    kw = {"shares": shares, "cores": 200, "memory": 0, "pod_uid": UID, "vm_root": s.vm_root,
          "vdriver_root": s.vdriver_root}
    assert build_response(**kw, hami=HamiDelivery.from_settings(s), container="big") == build_response(**kw)


def test_vcuda_mode_has_no_hami_delivery() -> None:
    assert HamiDelivery.from_settings(Settings(node_name="n")) is None
    with pytest.raises(msgspec.ValidationError, match="limit_delivery"):
        Settings(node_name="n", limit_delivery="hami")


def test_fractional_needs_the_container_name() -> None:
    s = settings()
    with pytest.raises(ValueError, match="container"):
        build_response(shares=[share(0, 10, GIB)], cores=10, memory=GIB, pod_uid=UID, vm_root=Path("/vm"),
                       vdriver_root=Path("/vd"), hami=HamiDelivery.from_settings(s))
