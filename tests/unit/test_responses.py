"""The Allocate response matches gpu-manager's, field by field (gpu-manager-reference.md 3.7)."""

from __future__ import annotations

from pathlib import Path

from libs.events.schema import GpuShare
from libs.placement.responses import build_response


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


# --- golden: the protobuf the kubelet receives, byte for byte -----------------------------------------

def _golden(devices: list[str], envs: dict[str, str], driver: str, vm: str, annotations: dict[str, str]) -> bytes:
    """Section 3.7 written out by hand as a ContainerAllocateResponse (not through build_response)."""
    from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as pb

    msg = pb.ContainerAllocateResponse(
        envs=envs,
        mounts=[pb.Mount(container_path="/usr/local/nvidia", host_path=driver, read_only=True),
                pb.Mount(container_path="/etc/vcuda", host_path=vm, read_only=True)],
        devices=[pb.DeviceSpec(container_path=d, host_path=d, permissions="rwm") for d in devices],
        annotations=annotations,
    )
    return msg.SerializeToString(deterministic=True)


def test_golden_share_response_bytes() -> None:
    from services.registrar.plugin import to_proto

    resp = build_response(
        shares=(GpuShare(index=2, uuid="GPU-5e0d1f2a-0000-4000-8000-000000000002", minor=2, cores=30,
                         memory=3 * 268435456),),
        cores=30, memory=3 * 268435456, pod_uid="7f1c7e9e-1111-4222-8333-444455556666",
        vm_root=Path("/etc/gpu-manager/vm"), vdriver_root=Path("/etc/gpu-manager/vdriver"),
        extra_devices=("/dev/infiniband/uverbs0",),
    )
    assert to_proto(resp).SerializeToString(deterministic=True) == _golden(
        ["/dev/nvidia2", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/infiniband/uverbs0"],
        {"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
         "NVIDIA_VISIBLE_DEVICES": "GPU-5e0d1f2a-0000-4000-8000-000000000002"},
        "/etc/gpu-manager/vdriver/nvidia", "/etc/gpu-manager/vm/7f1c7e9e-1111-4222-8333-444455556666",
        {"tencent.com/vcuda-core": "30", "tencent.com/vcuda-memory": "805306368",
         "tencent.com/vcuda-device": "/dev/nvidia2"},
    )


def test_golden_multi_gpu_response_bytes_keep_placement_order() -> None:
    from services.registrar.plugin import to_proto

    # Placement order, not index order: the device list and the UUID list follow the chosen GPUs.
    shares = tuple(GpuShare(index=i, uuid=f"GPU-{i}", minor=i + 4, cores=100, memory=1 << 34) for i in (3, 1))
    resp = build_response(shares=shares, cores=200, memory=0, pod_uid="p-1", vm_root=Path("/vm"),
                          vdriver_root=Path("/vd"), compat32=True)
    assert to_proto(resp).SerializeToString(deterministic=True) == _golden(
        ["/dev/nvidia7", "/dev/nvidia5", "/dev/nvidiactl", "/dev/nvidia-uvm"],
        {"LD_LIBRARY_PATH": "/usr/local/nvidia/lib", "NVIDIA_VISIBLE_DEVICES": "GPU-3,GPU-1"},
        "/vd/origin", "/vm/p-1",
        {"tencent.com/vcuda-core": "200", "tencent.com/vcuda-memory": "0",
         "tencent.com/vcuda-device": "/dev/nvidia7,/dev/nvidia5"},
    )


def test_extra_config_default_devices(tmp_path: Path) -> None:
    import pytest

    from libs.errors import ConfigError
    from services.allocator.extraconfig import default_devices

    assert default_devices("") == ()
    good = tmp_path / "extra.json"
    good.write_text('{"default": {"devices": ["/dev/fuse", "/dev/infiniband/uverbs0"]}, "other": {"devices": []}}')
    assert default_devices(str(good)) == ("/dev/fuse", "/dev/infiniband/uverbs0")
    (tmp_path / "empty.json").write_text("{}")  # gpu-manager's shipped file
    assert default_devices(str(tmp_path / "empty.json")) == ()
    (tmp_path / "bad.json").write_text('{"default": {"devices": "fuse"}}')
    with pytest.raises(ConfigError, match="not a map"):
        default_devices(str(tmp_path / "bad.json"))
    (tmp_path / "rel.json").write_text('{"default": {"devices": ["fuse"]}}')
    with pytest.raises(ConfigError, match="not a /dev path"):
        default_devices(str(tmp_path / "rel.json"))
    with pytest.raises(ConfigError, match="cannot read"):
        default_devices(str(tmp_path / "missing.json"))
