"""hami-core delivery: the limits reach HAMi-core's ``libvgpu.so`` as its environment (landscape.md 2.1).

For a fractional container (fewer than 100 vcuda-core) the response keeps gpu-manager's device nodes
and annotations but, instead of the hooked driver volume and /etc/vcuda, carries:

- ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` per allocated device, in MiB with HAMi's ``m`` suffix;
- ``CUDA_DEVICE_SM_LIMIT``: the cores percentage of the first device;
- ``CUDA_DEVICE_MEMORY_SHARED_CACHE``: ``<mount dir>/<random>.cache``, the shared-region file, in a
  per-container host directory (``<vm>/<pod uid>/_hami/<container>``, made by the vmanager before the
  container starts, removed with the pod's directory) mounted read-write at ``<mount dir>``;
- ``libvgpu.so`` mounted read-only at ``<mount dir>/libvgpu.so`` and an ``ld.so.preload`` naming it
  mounted read-only at ``/etc/ld.so.preload`` (the vmanager writes that file);
- the host-wide lock directory HAMi-core expects (``/tmp/vgpulock``), read-write;
- the pristine driver volume (``vdriver/origin``) at /usr/local/nvidia, so plain runc works as in
  vcuda mode.

Whole GPUs get exactly the vcuda response (pristine driver, no limits), as gpu-manager does.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import msgspec

from libs.config import MIB, Settings
from libs.events.schema import ContainerResponse, GpuShare, MountSpec
from libs.hami import LIBRARY_NAME, cache_dir

__all__ = ["HamiDelivery", "hami_response"]

PRELOAD_MOUNTPOINT = "/etc/ld.so.preload"
DRIVER_MOUNTPOINT = "/usr/local/nvidia"


@dataclass(frozen=True)
class HamiDelivery:
    library: str        # host path of libvgpu.so
    mount_dir: str      # container directory holding libvgpu.so and the cache file
    lock_dir: str       # host = container path of HAMi-core's lock directory
    preload: str        # host path of the ld.so.preload file the vmanager writes
    origin_volume: str  # host path of the pristine driver volume
    vm_root: Path

    @classmethod
    def from_settings(cls, settings: Settings) -> HamiDelivery | None:
        if settings.limit_delivery != "hami-core":
            return None
        return cls(library=settings.hami_library, mount_dir=settings.hami_mount_dir.rstrip("/"),
                   lock_dir=settings.hami_lock_dir, preload=str(settings.hami_preload),
                   origin_volume=str(settings.vdriver_root / "origin"), vm_root=settings.vm_root)


def _memory_limits(shares: tuple[GpuShare, ...] | list[GpuShare]) -> dict[str, str]:
    return {f"CUDA_DEVICE_MEMORY_LIMIT_{i}": f"{share.memory // MIB}m" for i, share in enumerate(shares)}


def hami_response(
    base: ContainerResponse, delivery: HamiDelivery, *, shares: tuple[GpuShare, ...] | list[GpuShare],
    cores: int, pod_uid: str, container: str, cache_token: str | None = None,
) -> ContainerResponse:
    """The vcuda response ``base`` turned into HAMi-core's form (for fractional containers).

    ``cache_token`` names the shared-region cache file; a fresh random one when None (a grant), the
    recorded one when the log reproduces the response it sent."""
    if cores >= 100 or not shares:
        return base
    if not container:
        raise ValueError("hami-core delivery needs the container's name (its cache directory)")
    envs = {
        "LD_LIBRARY_PATH": base.envs.get("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64"),
        "NVIDIA_VISIBLE_DEVICES": base.envs.get("NVIDIA_VISIBLE_DEVICES", ""),
        **_memory_limits(shares),
        "CUDA_DEVICE_SM_LIMIT": str(min(shares[0].cores, 100)),
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"{delivery.mount_dir}/{cache_token or uuid.uuid4().hex}.cache",
    }
    mounts = (
        MountSpec(container_path=DRIVER_MOUNTPOINT, host_path=delivery.origin_volume, read_only=True),
        MountSpec(container_path=delivery.mount_dir,
                  host_path=str(cache_dir(delivery.vm_root, pod_uid, container)), read_only=False),
        MountSpec(container_path=f"{delivery.mount_dir}/{LIBRARY_NAME}", host_path=delivery.library, read_only=True),
        MountSpec(container_path=delivery.lock_dir, host_path=delivery.lock_dir, read_only=False),
        MountSpec(container_path=PRELOAD_MOUNTPOINT, host_path=delivery.preload, read_only=True),
    )
    return msgspec.structs.replace(base, envs=envs, mounts=mounts)
