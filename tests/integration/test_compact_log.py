"""The compact stored form of grants, imports and corrections reads back as the events that were appended.

Responses built under HAMi-core delivery (with their random cache file), ``--extra-config`` devices,
compat32, whole GPUs, imports and corrections come back byte for byte from the recorded settings; a
response the settings do not reproduce is kept as it was; an edited settings entry is detected.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from libs.errors import CorruptLog
from libs.events.schema import AllocationCorrected, AllocationGranted, AllocationImported, GpuShare
from libs.placement.hami_response import HamiDelivery
from libs.placement.recorded import ResponseSettings
from libs.placement.responses import build_response
from libs.store import EventLog, iter_events, open_reader
from libs.store import compact as compact_module

VM, VDRIVER = Path("/var/lib/gpuledger/vm"), Path("/var/lib/gpuledger/vdriver")
HAMI = HamiDelivery(library="/usr/local/vgpu/libvgpu.so", mount_dir="/usr/local/vgpu", lock_dir="/tmp/vgpulock",
                    preload=f"{VDRIVER}/hami/ld.so.preload", origin_volume=f"{VDRIVER}/origin", vm_root=VM)
EXTRA = ("/dev/infiniband/uverbs0",)
SHARE = GpuShare(index=1, uuid="GPU-1", minor=1, cores=30, memory=1 << 30)
WHOLE = (GpuShare(index=2, uuid="GPU-2", minor=2, cores=100, memory=80 << 30),
         GpuShare(index=3, uuid="GPU-3", minor=3, cores=100, memory=80 << 30))


def grant(n: int, shares: tuple[GpuShare, ...], cores: int, ids: list[int], **build: object) -> AllocationGranted:
    uid = f"{n:08x}-0000-4000-8000-000000000000"
    response = build_response(shares=shares, cores=cores, memory=sum(s.memory for s in shares) if cores < 100 else 0,
                              pod_uid=uid, vm_root=VM, vdriver_root=VDRIVER, container="main", **build)  # type: ignore[arg-type]
    return AllocationGranted(
        alloc_id=f"{n:032x}", request_id=f"req-{n}", pod_uid=uid, namespace="ns", pod_name=f"p{n}",
        container="main", container_index=0, cores=cores, memory=shares[0].memory if cores < 100 else 0,
        device_ids=tuple(f"tencent.com/vcuda-core-{i}" for i in ids), shares=shares, response=response)


def history() -> list[AllocationGranted | AllocationCorrected]:
    hami_grant = grant(1, (SHARE,), 30, [7, 3, 4, 5], hami=HAMI, extra_devices=EXTRA)
    legacy = grant(2, (SHARE,), 30, list(range(30, 60)), compat32=True, hami=HAMI, extra_devices=EXTRA)
    whole = grant(3, WHOLE, 200, list(range(200, 400))[::-1], hami=HAMI, extra_devices=EXTRA)
    other = grant(4, (SHARE,), 30, [1, 2, 3])  # built without the node's settings: kept as sent
    odd_ids = AllocationGranted(**{**{f: getattr(other, f) for f in AllocationGranted.__struct_fields__},
                                   "alloc_id": "b" * 32, "device_ids": ("gpu-a", "gpu-b")})
    imported = AllocationImported(**{f: getattr(hami_grant, f) for f in AllocationGranted.__struct_fields__
                                     if f not in ("alloc_id", "request_id")},
                                  alloc_id="c" * 32, request_id="import:x/main", source="/ckpt")
    moved_response = build_response(shares=(SHARE,), cores=30, memory=2 << 30, pod_uid=hami_grant.pod_uid,
                                    vm_root=VM, vdriver_root=VDRIVER, extra_devices=EXTRA, hami=HAMI, container="other")
    corrected = AllocationCorrected(
        alloc_id=hami_grant.alloc_id, pod_uid=hami_grant.pod_uid, namespace="ns", pod_name="p1", container="other",
        container_index=1, memory=2 << 30, shares=(SHARE,), response=moved_response,
        previous_pod_uid=hami_grant.pod_uid, previous_container="main")
    return [hami_grant, legacy, whole, other, odd_ids, imported, corrected]


async def test_what_is_read_back_is_what_was_appended(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    settings = ResponseSettings.of(VM, VDRIVER, EXTRA, HAMI)
    events = history()
    event_log = await EventLog.open(path, response_settings=settings)
    try:
        await event_log.append(events)
        assert [s.event for s in await event_log.read_after(0)] == events  # the allocator's own reader
    finally:
        await event_log.close()
    compact_module._KNOWN.clear()  # as a fresh process: the settings come from the log's meta table
    conn = open_reader(path)
    try:
        assert [s.event for s in iter_events(conn)] == events
        bodies = conn.execute("SELECT type, schema_v, payload FROM events ORDER BY seq").fetchall()
    finally:
        conn.close()
    assert {v for _, v, _ in bodies} == {compact_module.COMPACT_V}
    kept = [compact_module.decode_compact(t, v, p).response is not None for t, v, p in bodies]  # type: ignore[union-attr]
    assert kept == [False, False, False, True, True, False, False]  # only those the settings cannot build


async def test_an_edited_settings_entry_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    settings = ResponseSettings.of(VM, VDRIVER)
    event_log = await EventLog.open(path, response_settings=settings)
    try:
        await event_log.append([grant(1, (SHARE,), 30, [1, 2])])
    finally:
        await event_log.close()
    key, _ = compact_module.settings_row(settings)
    edited = compact_module.settings_row(ResponseSettings.of(Path("/elsewhere"), VDRIVER))[1]
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = ? WHERE key = ?", (edited, key))
    compact_module._KNOWN.clear()
    conn = open_reader(path)
    try:
        with pytest.raises(CorruptLog, match="edited"):
            list(iter_events(conn))
    finally:
        conn.close()


async def test_device_ids_that_are_not_spelled_as_we_spell_them_come_back_exactly(tmp_path: Path) -> None:
    """An import carries whatever IDs a checkpoint held: each is read back as it was, none is
    "normalised" into a vcore number, and a number far past any node's (100 per GPU) neither
    changes nor makes a reader build a cache that long."""
    base = grant(10, (SHARE,), 30, [1, 2])
    odd = [("tencent.com/vcuda-core-1\n",), ("tencent.com/vcuda-core-01",), ("tencent.com/vcuda-core-1,2",),
           ("tencent.com/vcuda-core-\u0661",), ("tencent.com/vcuda-core-1\u0661",),
           ("tencent.com/vcuda-core-100000000000",), (f"tencent.com/vcuda-core-{1 << 70}",),
           ("tencent.com/vcuda-core-3", "tencent.com/vcuda-core-100000000000", "tencent.com/vcuda-core-4")]
    events = [AllocationImported(**{**{f: getattr(base, f) for f in AllocationGranted.__struct_fields__},
                                    "alloc_id": f"{i + 1:032x}", "device_ids": ids}, source="/ckpt")
              for i, ids in enumerate(odd)]
    path = tmp_path / "ledger.sqlite"
    event_log = await EventLog.open(path, response_settings=ResponseSettings.of(VM, VDRIVER, EXTRA, HAMI))
    try:
        await event_log.append(events)
    finally:
        await event_log.close()
    conn = open_reader(path)
    try:
        assert [s.event.device_ids for s in iter_events(conn)] == odd  # type: ignore[attr-defined]
    finally:
        conn.close()
    assert len(compact_module._ID_TEXT) <= compact_module._ID_TEXT_MAX
    # the version 3 forms (runs, bitmap) of numbers past the cache, as an older release wrote them
    assert compact_module.decode_ids((10**11, 2), b"") == ("tencent.com/vcuda-core-100000000000",
                                                           "tencent.com/vcuda-core-100000000001")
    assert compact_module.decode_ids((10**11,), b"\x01\x00", bits=b"\x05") == (
        "tencent.com/vcuda-core-100000000002", "tencent.com/vcuda-core-100000000000")
