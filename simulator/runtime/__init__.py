"""Real containers for the node simulator's kubelet: a private containerd driven through CRI.

``start_runtime(cfg)`` gives the kubelet a ``PodRuntime`` on a containerd of its own (see
``containerd.py``); ``RuntimeHandle.close()`` removes every pod, stops containerd and removes what the
run made outside its work dir.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..config import SimConfig
from .containerd import Containerd, RuntimeUnavailable, runtime_unavailable_reason
from .cri import CriClient
from .images import BUSYBOX_IMAGE, PAUSE_IMAGE, BuiltImages
from .pods import ContainerCreateError, PodRuntime

__all__ = [
    "BUSYBOX_IMAGE",
    "PAUSE_IMAGE",
    "ContainerCreateError",
    "Containerd",
    "PodRuntime",
    "RuntimeHandle",
    "RuntimeUnavailable",
    "runtime_unavailable_reason",
    "start_runtime",
]


@dataclass
class RuntimeHandle:
    containerd: Containerd
    pods: PodRuntime
    leftovers_found: list[str] | None = None

    async def close(self) -> list[str]:
        """Remove the pods, stop containerd, clean up; what survived (empty when all went)."""
        try:
            await self.pods.close()
        finally:
            self.leftovers_found = await asyncio.to_thread(self.containerd.stop)
        return self.leftovers_found


def _prebuilt(images: Path | None) -> BuiltImages | None:
    if images is None:
        return None
    return BuiltImages(pause=images / "pause_1.oci.tar", busybox=images / "busybox_1.oci.tar")


async def start_runtime(cfg: SimConfig) -> RuntimeHandle:
    remove_work = cfg.runtime_dir is None
    work = Path(cfg.runtime_dir) if cfg.runtime_dir else Path(tempfile.mkdtemp(prefix="glrt", dir="/tmp"))
    containerd = Containerd(work, _prebuilt(cfg.runtime_images), remove_work=remove_work)
    await asyncio.to_thread(containerd.start)
    client = CriClient(containerd.socket)
    try:
        await client.version()
    except BaseException:
        await client.close()
        await asyncio.to_thread(containerd.stop)
        raise
    return RuntimeHandle(containerd, PodRuntime(client, containerd.leftovers, work / "pods"))
