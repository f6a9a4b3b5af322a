"""This node's Node object, with device-plugin capacity filled in from the device manager,
and the kubeconfig that points clients at the simulated API server."""

from __future__ import annotations

import copy
import os
import platform
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from .store import now_rfc3339

__all__ = ["NodeObject", "write_kubeconfig"]

# (capacity, allocatable, resources removed after their grace) from the device manager.
CapacitySource = Callable[[], tuple[dict[str, int], dict[str, int], set[str]]]


class NodeObject:
    def __init__(self, name: str, capacity: CapacitySource, next_rv: Callable[[], int]) -> None:
        self._capacity = capacity
        self._next_rv = next_rv
        cpus = str(os.cpu_count() or 1)
        arch = "arm64" if platform.machine() in ("aarch64", "arm64") else "amd64"
        self._node: dict[str, Any] = {
            "kind": "Node",
            "apiVersion": "v1",
            "metadata": {
                "name": name,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": now_rfc3339(),
                "resourceVersion": str(next_rv()),
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": arch,
                },
                "annotations": {},
            },
            "spec": {},
            "status": {
                "capacity": {"cpu": cpus, "memory": "64Gi", "pods": "110"},
                "allocatable": {"cpu": cpus, "memory": "64Gi", "pods": "110"},
                "conditions": [
                    {"type": "Ready", "status": "True", "reason": "KubeletReady",
                     "message": "kubelet is posting ready status", "lastHeartbeatTime": now_rfc3339(),
                     "lastTransitionTime": now_rfc3339()}
                ],
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                              {"type": "Hostname", "address": name}],
                # Every required field: strict clients (lightkube) refuse a NodeSystemInfo without them.
                "nodeInfo": {
                    "machineID": uuid.uuid4().hex,
                    "systemUUID": str(uuid.uuid4()),
                    "bootID": str(uuid.uuid4()),
                    "kernelVersion": platform.release(), "osImage": "gpuledger simulator",
                    "containerRuntimeVersion": "containerd://simulated",
                    "kubeletVersion": "v1.33.0-gpuledger-sim",
                    "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": arch,
                },
            },
        }
        self._ever: set[str] = set()

    @property
    def name(self) -> str:
        return str(self._node["metadata"]["name"])

    def render(self) -> dict[str, Any]:
        """The object with extended resources as the kubelet's node-status sync would set them:
        counts as strings, and "0" for resources that were removed (never deleted)."""
        capacity, allocatable, removed = self._capacity()
        node = copy.deepcopy(self._node)
        self._ever |= set(capacity) | removed
        for resource in self._ever:
            node["status"]["capacity"][resource] = str(capacity.get(resource, 0))
            node["status"]["allocatable"][resource] = str(allocatable.get(resource, 0))
        return node

    def replace(self, new: dict[str, Any]) -> dict[str, Any]:
        """Store a patched/replaced object; identity fields are kept."""
        meta = new.setdefault("metadata", {})
        for field in ("name", "uid", "creationTimestamp"):
            meta[field] = self._node["metadata"][field]
        new["kind"], new["apiVersion"] = "Node", "v1"
        meta["resourceVersion"] = str(self._next_rv())
        self._node = copy.deepcopy(new)
        return self.render()


def write_kubeconfig(path: Path, server: str, *, name: str = "gpuledger-sim") -> None:
    """A kubeconfig with one cluster (the simulator, plain HTTP, no auth) as current context."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server}}],
        "users": [{"name": name, "user": {}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name, "namespace": "default"}}],
        "current-context": name,
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
