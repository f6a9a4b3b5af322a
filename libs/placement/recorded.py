"""What shapes an Allocate response besides the grant itself, recorded so the log can reproduce it.

A response (``responses.build_response``) is a pure function of the grant (shares, cores, memory, pod
UID, container name), two per-container facts (the ``compat32`` env, HAMi-core's random cache file name)
and the node's delivery settings: the vm and vdriver roots, the ``--extra-config`` devices and, in
``hami-core`` mode, HAMi-core's paths. The log keeps those settings once (``ResponseSettings``, content
addressed by ``digest``) instead of the whole response in every grant, and ``reproduce`` rebuilds
the response byte for byte. The writer checks each reproduction against the response really sent and
keeps the response itself when they differ, so a reproduced response is always the one the kubelet got.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import msgspec

from libs.config import Settings
from libs.events.schema import ContainerResponse, DeviceNode, GpuShare, MountSpec
from libs.placement.hami_response import HamiDelivery
from libs.placement.responses import CONTROL_DEVICES, VCUDA_MOUNTPOINT, build_response

__all__ = ["HamiSettings", "ResponseSettings", "reproduce"]


class HamiSettings(msgspec.Struct, frozen=True, kw_only=True):
    library: str
    mount_dir: str
    lock_dir: str
    preload: str
    origin_volume: str


class ResponseSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The node settings an Allocate response depends on (``--vm-dir``, ``--vdriver-dir``,
    ``--extra-config``, ``--limit-delivery`` and the ``--hami-*`` paths)."""

    vm_root: str
    vdriver_root: str
    extra_devices: tuple[str, ...] = ()
    hami: HamiSettings | None = None

    @classmethod
    def of(cls, vm_root: Path, vdriver_root: Path, extra_devices: tuple[str, ...] = (),
           hami: HamiDelivery | None = None) -> ResponseSettings:
        return cls(vm_root=str(vm_root), vdriver_root=str(vdriver_root), extra_devices=tuple(extra_devices),
                   hami=None if hami is None else HamiSettings(
                       library=hami.library, mount_dir=hami.mount_dir, lock_dir=hami.lock_dir,
                       preload=hami.preload, origin_volume=hami.origin_volume))

    @classmethod
    def for_node(cls, settings: Settings, extra_devices: tuple[str, ...]) -> ResponseSettings:
        """What a node's allocator builds its grants' responses with: its roots, its extra devices
        (``services.allocator.extraconfig``) and its limit delivery."""
        return cls.of(settings.vm_root, settings.vdriver_root, extra_devices, HamiDelivery.from_settings(settings))

    @property
    def digest(self) -> bytes:
        """8 bytes of sha256 over the msgpack encoding: what a compact grant names its settings by."""
        return _digest(self)

    def delivery(self) -> HamiDelivery | None:
        if self.hami is None:
            return None
        h = self.hami
        return HamiDelivery(library=h.library, mount_dir=h.mount_dir, lock_dir=h.lock_dir, preload=h.preload,
                            origin_volume=h.origin_volume, vm_root=Path(self.vm_root))


@functools.cache  # asked for each grant written; a process meets one or a few settings (frozen, so hashable)
def _digest(settings: ResponseSettings) -> bytes:
    return hashlib.sha256(msgspec.msgpack.encode(settings)).digest()[:8]


class _Prepared:
    """What every response under one settings shares, made once (a replay reproduces many responses):
    the roots as Path and as text, the driver volume mounts, the device nodes by minor."""

    __slots__ = ("delivery", "driver_mounts", "extra_nodes", "nodes", "vdriver_root", "vm_prefix", "vm_root")

    def __init__(self, settings: ResponseSettings) -> None:
        self.vm_root = Path(settings.vm_root)
        self.vdriver_root = Path(settings.vdriver_root)
        self.delivery = settings.delivery()
        self.vm_prefix = str(self.vm_root / "x")[:-1]  # "<vm root>/", as Path joins it
        self.driver_mounts = {
            hooked: MountSpec(container_path="/usr/local/nvidia", read_only=True,
                              host_path=str(self.vdriver_root / ("nvidia" if hooked else "origin")))
            for hooked in (True, False)
        }
        self.extra_nodes = tuple(DeviceNode(container_path=p, host_path=p, permissions="rwm")
                                 for p in (*CONTROL_DEVICES, *settings.extra_devices))
        self.nodes: dict[int, DeviceNode] = {}

    def node(self, minor: int) -> DeviceNode:
        found = self.nodes.get(minor)
        if found is None:
            path = f"/dev/nvidia{minor}"
            found = self.nodes[minor] = DeviceNode(container_path=path, host_path=path, permissions="rwm")
        return found


_prepared: dict[ResponseSettings, _Prepared] = {}
_UID_LEN = 36  # a pod UID: 8-4-4-4-12 hex
_PLACEHOLDER = "\x00" * _UID_LEN
_PLACEHOLDER_BYTES = _PLACEHOLDER.encode()
_TEMPLATES = 4096
_templates: dict[tuple[object, ...], bytes] = {}
_encode = msgspec.msgpack.Encoder().encode
_decode_response = msgspec.msgpack.Decoder(ContainerResponse).decode


def reproduce(
    settings: ResponseSettings, *, shares: tuple[GpuShare, ...], cores: int, memory: int, pod_uid: str,
    container: str, compat32: bool = False, cache_token: str = "",
) -> ContainerResponse:
    """The response ``build_response`` gave for this grant under ``settings``."""
    ready = _prepared.get(settings)
    if ready is None:
        ready = _prepared[settings] = _Prepared(settings)
    if ready.delivery is None or cores >= 100:
        if len(pod_uid) != _UID_LEN:
            return _vcuda(ready, shares=shares, cores=cores, memory=memory, pod_uid=pod_uid, compat32=compat32)
        # Responses that differ only in the pod UID: one msgpack template, the UID put in its place
        # (same length, so the encoding stays valid) and decoded in C, about 4x faster than building.
        key = (settings, shares, cores, memory, compat32)
        template = _templates.get(key)
        if template is None:
            if len(_templates) >= _TEMPLATES:
                _templates.clear()
            template = _templates[key] = _encode(_vcuda(ready, shares=shares, cores=cores, memory=memory,
                                                        pod_uid=_PLACEHOLDER, compat32=compat32))
        return _decode_response(template.replace(_PLACEHOLDER_BYTES, pod_uid.encode()))
    return build_response(
        shares=shares, cores=cores, memory=memory, pod_uid=pod_uid, vm_root=ready.vm_root,
        vdriver_root=ready.vdriver_root, compat32=compat32, extra_devices=settings.extra_devices,
        hami=ready.delivery, container=container, cache_token=cache_token or None,
    )


def _vcuda(ready: _Prepared, *, shares: tuple[GpuShare, ...], cores: int, memory: int, pod_uid: str,
           compat32: bool) -> ContainerResponse:
    """``build_response``'s vcuda form from the prepared parts: the same response, a few times faster.
    (The writer compares every reproduction with the response built for the kubelet, so a difference
    between the two would keep that response in the log, never change it.)"""
    minors = [s.minor for s in shares]
    return ContainerResponse(
        envs={
            "LD_LIBRARY_PATH": "/usr/local/nvidia/lib" if compat32 else "/usr/local/nvidia/lib64",
            "NVIDIA_VISIBLE_DEVICES": ",".join(s.uuid for s in shares),
        },
        mounts=(ready.driver_mounts[cores < 100],
                MountSpec(container_path=VCUDA_MOUNTPOINT, host_path=ready.vm_prefix + pod_uid, read_only=True)),
        devices=(*(ready.node(m) for m in minors), *ready.extra_nodes),
        annotations={
            "tencent.com/vcuda-core": str(cores),
            "tencent.com/vcuda-memory": str(memory),
            "tencent.com/vcuda-device": ",".join(f"/dev/nvidia{m}" for m in minors),
        },
    )
