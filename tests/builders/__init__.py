"""Builders the test areas share: pod manifests, the settings of a simulated node, filler events.

Beside them: ``tests.builders.cgroups`` (fake cgroup trees and /proc files) and ``tests.builders.elf``
(shared objects and ld.so.cache files written byte by byte), ``tests.builders.format1`` (logs in the row
format before format 2).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from libs.config import Settings
from libs.events.schema import AllocationReleased

NODE = "node-1.example"  # a dot, to exercise subject escaping end to end


def gpu_pod(name: str, *containers: tuple[str, int, int], namespace: str = "default",
            annotations: dict[str, str] | None = None, owner: bool = False) -> dict[str, Any]:
    def spec(c: tuple[str, int, int]) -> dict[str, Any]:
        limits = {"tencent.com/vcuda-core": str(c[1])}
        if c[2]:
            limits["tencent.com/vcuda-memory"] = str(c[2])
        return {"name": c[0], "image": "cuda", "resources": {"limits": limits, "requests": dict(limits)}}

    meta: dict[str, Any] = {"name": name, "namespace": namespace, "annotations": annotations or {}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [spec(c) for c in containers]}}


def settings_for(root: Path, nats_url: str, **overrides: Any) -> Settings:
    fields: dict[str, Any] = dict(
        node_name=NODE, state_dir=str(root / "state"), device_plugin_dir=str(root / "dp"),
        pod_resources_socket=str(root / "pr" / "kubelet.sock"), kubeconfig=str(root / "kubeconfig"),
        nats_url=nats_url, gpus="fake", allocate_timeout=5.0, request_timeout=3.0,
        cgroup_root=str(root / "cgroup"), proc_root=str(root / "proc"),
        driver_volumes=False,  # never mirror a GPU host's real driver into temp dirs (tests/vmanager/test_volumes.py)
    )
    return Settings(**(fields | overrides))


def pod_manifest(
    name: str,
    containers: list[dict[str, Any]] | None = None,
    *,
    init: list[dict[str, Any]] | None = None,
    namespace: str = "default",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": containers or [ctr("main")]}
    if init:
        spec["initContainers"] = init
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def ctr(name: str, limits: dict[str, int | str] | None = None, *, sidecar: bool = False) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": "busybox"}
    if limits:
        c["resources"] = {"limits": {k: str(v) for k, v in limits.items()}}
    if sidecar:
        c["restartPolicy"] = "Always"
    return c


def phase_is(*phases: str) -> Callable[[dict[str, Any]], bool]:
    return lambda pod: (pod.get("status") or {}).get("phase") in phases


def released_event(i: int, *, pods: int = 3) -> AllocationReleased:
    """Release number ``i`` of pod ``p{i % pods}``: small events to fill a log or a stream with."""
    return AllocationReleased(alloc_id=f"a{i}", pod_uid=f"p{i % pods}", container="c", reason="deleted")
