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

import hashlib
from pathlib import Path

import msgspec

from libs.events.schema import ContainerResponse, GpuShare
from libs.placement.hami_response import HamiDelivery
from libs.placement.responses import build_response

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

    @property
    def digest(self) -> bytes:
        """8 bytes of sha256 over the msgpack encoding: what a compact grant names its settings by."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).digest()[:8]

    def delivery(self) -> HamiDelivery | None:
        if self.hami is None:
            return None
        h = self.hami
        return HamiDelivery(library=h.library, mount_dir=h.mount_dir, lock_dir=h.lock_dir, preload=h.preload,
                            origin_volume=h.origin_volume, vm_root=Path(self.vm_root))


class _Prepared:
    """Path objects and the HAMi delivery made once per settings (a replay reproduces many responses)."""

    __slots__ = ("delivery", "vdriver_root", "vm_root")

    def __init__(self, settings: ResponseSettings) -> None:
        self.vm_root = Path(settings.vm_root)
        self.vdriver_root = Path(settings.vdriver_root)
        self.delivery = settings.delivery()


_prepared: dict[ResponseSettings, _Prepared] = {}


def reproduce(
    settings: ResponseSettings, *, shares: tuple[GpuShare, ...], cores: int, memory: int, pod_uid: str,
    container: str, compat32: bool = False, cache_token: str = "",
) -> ContainerResponse:
    """The response ``build_response`` gave for this grant under ``settings``."""
    ready = _prepared.get(settings)
    if ready is None:
        ready = _prepared[settings] = _Prepared(settings)
    return build_response(
        shares=shares, cores=cores, memory=memory, pod_uid=pod_uid, vm_root=ready.vm_root,
        vdriver_root=ready.vdriver_root, compat32=compat32, extra_devices=settings.extra_devices,
        hami=ready.delivery, container=container, cache_token=cache_token or None,
    )
