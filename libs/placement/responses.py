"""The ContainerAllocateResponse gpu-manager hands to a container (gpu-manager-reference.md 3.7).

Byte-for-byte the same keys, units and order, so the in-container library and existing tooling see
what they saw under gpu-manager: device nodes, then /dev/nvidiactl and /dev/nvidia-uvm; the driver
volume (hooked for shares, pristine for whole GPUs) at /usr/local/nvidia; the pod's vcuda directory at
/etc/vcuda; NVIDIA_VISIBLE_DEVICES by UUID; annotations in cores, bytes and device paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from libs.events.schema import ContainerResponse, DeviceNode, GpuShare, MountSpec
from libs.placement.hami_response import HamiDelivery, hami_response

__all__ = ["VCUDA_MOUNTPOINT", "build_response"]

VCUDA_MOUNTPOINT = "/etc/vcuda"
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm")


def build_response(
    *,
    shares: Sequence[GpuShare],
    cores: int,
    memory: int,
    pod_uid: str,
    vm_root: Path,
    vdriver_root: Path,
    compat32: bool = False,
    extra_devices: Sequence[str] = (),
    hami: HamiDelivery | None = None,  # limit_delivery=hami-core
    container: str = "",
    cache_token: str | None = None,  # hami-core: the recorded cache file name (None: a fresh one)
) -> ContainerResponse:
    device_paths = [f"/dev/nvidia{s.minor}" for s in shares]
    devices = tuple(
        DeviceNode(container_path=p, host_path=p, permissions="rwm")
        for p in (*device_paths, *CONTROL_DEVICES, *extra_devices)
    )
    driver_volume = vdriver_root / ("nvidia" if cores < 100 else "origin")
    response = ContainerResponse(
        envs={
            "LD_LIBRARY_PATH": "/usr/local/nvidia/lib" if compat32 else "/usr/local/nvidia/lib64",
            "NVIDIA_VISIBLE_DEVICES": ",".join(s.uuid for s in shares),
        },
        mounts=(
            MountSpec(container_path="/usr/local/nvidia", host_path=str(driver_volume), read_only=True),
            MountSpec(container_path=VCUDA_MOUNTPOINT, host_path=str(vm_root / pod_uid), read_only=True),
        ),
        devices=devices,
        annotations={
            "tencent.com/vcuda-core": str(cores),
            "tencent.com/vcuda-memory": str(memory),
            "tencent.com/vcuda-device": ",".join(device_paths),
        },
    )
    if hami is not None:
        return hami_response(response, hami, shares=shares, cores=cores, pod_uid=pod_uid, container=container,
                             cache_token=cache_token)
    return response
