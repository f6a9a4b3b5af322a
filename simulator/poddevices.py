"""The device manager's allocation table: (pod UID, container, resource) -> device IDs + response.

Mirrors upstream `pod_devices.go`: IDs are kept per NUMA node (-1 = no topology), the stored
`ContainerAllocateResponse` is what containers are started with, and the table is what the
checkpoint, garbage collection and PodResources read.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as dp

from .logger import logger

__all__ = ["NO_TOPOLOGY", "DeviceAllocation", "PodDevices", "empty_run_options"]

NO_TOPOLOGY = -1  # the pseudo NUMA node of devices that report no topology

_logger = logger("poddevices")


@dataclass
class DeviceAllocation:
    devices_per_numa: dict[int, list[str]]
    response: dp.ContainerAllocateResponse

    def ids(self) -> list[str]:
        """Every ID once (a device on two NUMA nodes is listed under both)."""
        return list(dict.fromkeys(i for ids in self.devices_per_numa.values() for i in ids))


def empty_run_options() -> dict[str, Any]:
    return {"envs": {}, "mounts": [], "devices": [], "annotations": {}, "cdi_devices": []}


class PodDevices:
    def __init__(self) -> None:
        self._devs: dict[str, dict[str, dict[str, DeviceAllocation]]] = {}

    def pods(self) -> set[str]:
        return set(self._devs)

    def insert(
        self,
        pod_uid: str,
        container: str,
        resource: str,
        devices_per_numa: dict[int, list[str]],
        response: dp.ContainerAllocateResponse,
    ) -> None:
        self._devs.setdefault(pod_uid, {}).setdefault(container, {})[resource] = DeviceAllocation(
            devices_per_numa, response
        )

    def delete(self, pod_uids: set[str]) -> None:
        for uid in pod_uids:
            self._devs.pop(uid, None)

    def container_devices(self, pod_uid: str, container: str, resource: str) -> set[str] | None:
        """None when nothing is recorded (upstream returns a nil set then)."""
        alloc = self._devs.get(pod_uid, {}).get(container, {}).get(resource)
        return None if alloc is None else set(alloc.ids())

    def allocation(self, pod_uid: str, container: str, resource: str) -> DeviceAllocation | None:
        return self._devs.get(pod_uid, {}).get(container, {}).get(resource)

    def container_allocations(self, pod_uid: str, container: str) -> dict[str, DeviceAllocation]:
        return dict(self._devs.get(pod_uid, {}).get(container, {}))

    def add_container_allocated_resources(
        self, pod_uid: str, container: str, pool: dict[str, set[str]]
    ) -> None:
        """An ordinary init container's devices become reusable by the pod's later containers."""
        for resource, alloc in self._devs.get(pod_uid, {}).get(container, {}).items():
            pool.setdefault(resource, set()).update(alloc.ids())

    def remove_container_allocated_resources(
        self, pod_uid: str, container: str, pool: dict[str, set[str]]
    ) -> None:
        """App containers and sidecars keep their devices, so nobody else may reuse them."""
        for resource, alloc in self._devs.get(pod_uid, {}).get(container, {}).items():
            if resource in pool:
                pool[resource].difference_update(alloc.ids())

    def devices(self) -> dict[str, set[str]]:
        """Every allocated ID per resource: the "allocated" set the kubelet rebuilds from this table."""
        out: dict[str, set[str]] = {}
        for containers in self._devs.values():
            for resources in containers.values():
                for resource, alloc in resources.items():
                    out.setdefault(resource, set()).update(alloc.ids())
        return out

    def entries(self) -> list[tuple[str, str, str, DeviceAllocation]]:
        return [
            (uid, container, resource, alloc)
            for uid, containers in self._devs.items()
            for container, resources in containers.items()
            for resource, alloc in resources.items()
        ]

    def run_container_options(self, pod_uid: str, container: str, rng: random.Random) -> dict[str, Any]:
        """Merge the container's stored responses as upstream does (spec 2.6).

        Resources are visited in random order (a Go map), the first value for an env name, device
        or mount container path, or annotation key wins; CDI devices are a de-duplicated union.
        """
        opts = empty_run_options()
        resources = self._devs.get(pod_uid, {}).get(container, {})
        order = sorted(resources)
        rng.shuffle(order)
        devices: dict[str, dict[str, Any]] = {}
        mounts: dict[str, dict[str, Any]] = {}
        for resource in order:
            resp = resources[resource].response
            for key, value in resp.envs.items():
                _keep_first(opts["envs"], key, value, "env", container)
            for dev in resp.devices:
                _keep_first(devices, dev.container_path, {"container_path": dev.container_path,
                            "host_path": dev.host_path, "permissions": dev.permissions}, "device", container)
            for mount in resp.mounts:
                _keep_first(mounts, mount.container_path, {"container_path": mount.container_path,
                            "host_path": mount.host_path, "read_only": mount.read_only}, "mount", container)
            for key, value in resp.annotations.items():
                _keep_first(opts["annotations"], key, value, "annotation", container)
            for cdi in resp.cdi_devices:
                if cdi.name not in opts["cdi_devices"]:
                    opts["cdi_devices"].append(cdi.name)
        opts["devices"] = list(devices.values())
        opts["mounts"] = list(mounts.values())
        return opts


def _keep_first(kept: dict[str, Any], key: str, value: Any, what: str, container: str) -> None:
    """Upstream's merge: the first value for a key stays; a different later one is only logged."""
    if key not in kept:
        kept[key] = value
    elif kept[key] != value:
        _logger.warning(f"{what} conflict", container=container, key=key)
