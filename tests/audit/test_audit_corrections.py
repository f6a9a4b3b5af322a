"""The audit view folds corrections, init-container reuse and GPU health exactly as ``LedgerState``.

A seeded random log mixes every event type that changes holdings: init containers whose kubelet
devices an app container of the pod reuses (the hold moves to the app container), corrections that
move a grant to another pod or container (with new memory, shares and core limit), releases, GPU
health transitions and a second inventory whose GPUs changed places. At every seq both folds must
say the same: who holds what, which grants are charged, each GPU's usage and health.
"""

from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import msgspec
import pytest

from bench.make_log import START_NS
from libs.events.schema import (
    AllocationCorrected,
    AllocationGranted,
    AllocationReleased,
    ContainerResponse,
    Event,
    GpuHealthChanged,
    GpuInfo,
    GpuShare,
    InventoryRecorded,
)
from libs.ledger import timeline, views
from libs.ledger.holdings import AuditFold, audit_replay, grant_device_ids
from libs.ledger.state import LedgerState
from libs.ledger.timeline import gpu_history, pod_history
from libs.store import iter_events, open_reader, replay
from libs.store.compact import COMPACT_V, COMPACT_V3
from libs.store.layout import layout_of
from libs.store.log import create_schema
from libs.store.rows import GENESIS_HASH, chain_hash, event_row

GIB = 1 << 30


def _inventory(order: list[int], node: str = "audit") -> InventoryRecorded:
    return InventoryRecorded(node=node, backend="fake", driver_version="1", gpus=tuple(
        GpuInfo(index=i, minor=i, uuid=f"GPU-{u:04d}", memory=16 * GIB, name="Fake") for i, u in enumerate(order)))


def _shares(rng: random.Random, gpus: int) -> tuple[GpuShare, ...]:
    picked = rng.sample(range(gpus), rng.choice((1, 1, 2)))
    return tuple(GpuShare(index=i, uuid=f"GPU-{i:04d}", minor=i, cores=rng.choice((10, 25, 50)),
                          memory=rng.randint(1, 8) * GIB) for i in sorted(picked))


def random_log(count: int, seed: int) -> Iterator[Event]:
    rng = random.Random(seed)
    gpus = 4
    yield _inventory(list(range(gpus)))
    live: dict[str, AllocationGranted] = {}
    pods: list[tuple[str, str]] = []          # (uid, name)
    reusable: dict[str, list[str]] = {}       # pod uid -> its init containers' device IDs
    n = 0
    made = 1
    while made < count:
        made += 1
        n += 1
        roll = rng.random()
        if roll < 0.35 or not live:
            if not pods or rng.random() < 0.4:
                pods.append((f"uid-{n:05d}", f"job-{n}"))
            uid, name = rng.choice(pods)
            init = rng.random() < 0.4
            ids = [f"vcore-{n}-{k}" for k in range(rng.randint(1, 3))]
            if not init and reusable.get(uid) and rng.random() < 0.8:
                ids = rng.sample(reusable[uid], rng.randint(1, len(reusable[uid]))) + ids[:1]
            if init:
                reusable.setdefault(uid, []).extend(ids)
            grant = AllocationGranted(
                alloc_id=f"a{n:05d}", request_id=f"req-{n}", pod_uid=uid, namespace="team", pod_name=name,
                container=f"{'init' if init else 'main'}-{n % 3}", container_index=n % 3, init_container=init,
                cores=25, memory=2 * GIB, device_ids=tuple(ids), shares=_shares(rng, gpus),
                core_limit=rng.choice((None, 50)), response=ContainerResponse())
            live[grant.alloc_id] = grant
            yield grant
        elif roll < 0.6:
            old = live.pop(rng.choice(sorted(live)))
            yield AllocationReleased(alloc_id=old.alloc_id, pod_uid=old.pod_uid, container=old.container,
                                     reason="deleted")
        elif roll < 0.78:
            old = live[rng.choice(sorted(live))]
            uid, name = rng.choice(pods)
            init = rng.random() < 0.3
            moved = AllocationCorrected(
                alloc_id=old.alloc_id, pod_uid=uid, namespace="team", pod_name=name,
                container=f"{'init' if init else 'main'}-fixed", container_index=0, init_container=init,
                memory=rng.randint(1, 4) * GIB, shares=_shares(rng, gpus), core_limit=rng.choice((None, 30)),
                response=ContainerResponse(), previous_pod_uid=old.pod_uid, previous_container=old.container,
                reason=rng.choice(("pod-resources", "reconcile")))
            live[old.alloc_id] = AllocationGranted(**{
                **{f: getattr(old, f) for f in AllocationGranted.__struct_fields__},
                "pod_uid": uid, "pod_name": name, "container": moved.container})
            yield moved
        elif roll < 0.97:
            i = rng.randrange(gpus)
            healthy = rng.random() < 0.5
            reason = "recovered" if healthy else rng.choice(("xid", "ecc-double-bit", "query-failed"))
            yield GpuHealthChanged(index=i, uuid=f"GPU-{i:04d}", healthy=healthy, reason=reason,
                                   xid=79 if reason == "xid" else 0)
        else:  # a reboot: the GPUs changed indexes (health follows the uuid)
            order = list(range(gpus))
            rng.shuffle(order)
            yield _inventory(order)


def write_log(path: Path, events: Iterator[Event], *, progress: bool = False, upgrade_at: int = 0) -> int:
    """The rows as the writer makes them (bench's writer assumes a pod is done after a release); the rows
    before seq ``upgrade_at`` with the bodies of version 3, as the release before version 4 wrote them."""
    create_schema(path)
    conn = sqlite3.connect(path, isolation_level=None)
    rng = random.Random(0)
    prev, versions, seq = GENESIS_HASH, dict[str, int](), 0
    conn.execute("BEGIN IMMEDIATE")
    for seq, ev in enumerate(events, start=1):
        stream = ev.stream()
        versions[stream] = versions.get(stream, 0) + 1
        command = ev.request_id if isinstance(ev, AllocationGranted) else None
        body_version = COMPACT_V3 if seq < upgrade_at else COMPACT_V
        row = event_row(seq, START_NS + seq * 1_000_000, stream, versions[stream], ev, rng.randbytes(16), command,
                        None, body_version)
        prev = chain_hash(prev, row)
        layout_of(conn).insert(conn, [(*row, prev)])
    conn.execute("COMMIT")
    conn.close()
    return seq


def _full(path: Path, seq: int) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    state = LedgerState()
    replay(path, state.apply, upto_seq=seq)
    snap = state.snapshot()
    allocs = [(a.alloc_id, a.pod_uid, a.pod_name, a.container, a.init_container, a.cores, a.memory, a.shares,
               a.core_limit, a.charged, a.corrected_seq, a.granted_at, a.granted_seq, a.request_id)
              for a in snap.allocations]
    gpus = [(g.index, g.uuid, g.cores_used, g.memory_used, g.alloc_ids, g.healthy, g.health_reason)
            for g in snap.gpus]
    return allocs, gpus


def _audit(view) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    allocs = [(h.alloc_id, h.pod_uid, h.pod_name, h.container, h.init_container, h.cores, h.memory, h.shares,
               h.core_limit, h.charged, h.corrected_seq, h.since, h.granted_seq, h.request_id)
              for h in view.allocations]
    gpus = [(g.index, g.uuid, g.cores_used, g.memory_used, sorted(g.holders), g.healthy, g.health_reason)
            for g in view.gpus]
    return allocs, gpus


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_both_folds_agree_on_corrections_reuse_and_health(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "ledger.sqlite"
    last = write_log(path, random_log(300, seed), progress=False)
    conn = open_reader(path)
    types = {t for (t,) in conn.execute("SELECT DISTINCT type FROM events")}
    conn.close()
    assert types == {"inventory.recorded", "alloc.granted", "alloc.released", "alloc.corrected", "gpu.health"}
    uncharged = corrected = unhealthy = 0
    for seq in range(0, last + 1, 3):
        view = audit_replay(path, upto_seq=seq)
        assert _audit(view) == _full(path, seq), f"seed {seed}, seq {seq}"
        uncharged += sum(not h.charged for h in view.allocations)
        corrected += sum(h.corrected_seq > 0 for h in view.allocations)
        unhealthy += sum(not g.healthy for g in view.gpus)
    assert uncharged and corrected and unhealthy  # the log exercised every rule


@pytest.mark.parametrize("seed", [1, 2])
def test_a_log_written_across_the_upgrade_to_body_version_4_folds_the_same(tmp_path: Path, seed: int) -> None:
    """Grants of version 3 (text ids) released, corrected and taken over by rows of version 4 (packed ids):
    the audit fold matches them (each id in the other form), as ``LedgerState`` does."""
    path = tmp_path / "ledger.sqlite"
    last = write_log(path, random_log(300, seed), upgrade_at=150)
    conn = open_reader(path)
    versions = {v for (v,) in conn.execute("SELECT DISTINCT schema_v FROM events WHERE type = 'alloc.released'")}
    conn.close()
    assert versions == {COMPACT_V3, COMPACT_V}
    for seq in range(140, last + 1, 2):
        assert _audit(audit_replay(path, upto_seq=seq)) == _full(path, seq), f"seed {seed}, seq {seq}"


@pytest.mark.parametrize("seed", [1, 2])
def test_history_spells_out_only_the_events_it_shows_and_shows_the_same(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """History matches each event on its ids spelled out one by one and spells out the whole view only
    for the events it shows; with every view spelled out first (as it did before), every pod's and
    every GPU's timeline is the same, on a log written across the upgrade to body version 4. (The
    request ids a version 4 grant leaves to its row are only read for a view as decoded: left out.)"""
    path = tmp_path / "ledger.sqlite"
    write_log(path, random_log(300, seed), upgrade_at=150)
    conn = open_reader(path)
    pods = sorted({ev.event.pod_uid for ev in iter_events(conn) if isinstance(ev.event, AllocationGranted)})
    conn.close()
    gpus = ["0", "1", "2", "3", "GPU-0000", "GPU-0001", "GPU-0003"]

    def timelines() -> list[list[object]]:
        found = [pod_history(path, p) for p in pods] + [gpu_history(path, g) for g in gpus]
        return [[msgspec.structs.replace(e, request_id="") for e in entries] for entries in found]

    lazy = timelines()
    assert sum(len(t) for t in lazy) > len(pods) * 2 and any(lazy[len(pods):])
    spelled = views.iter_views
    monkeypatch.setattr(timeline, "iter_views",
                        lambda conn, **kw: ((s, at, views.plain(v)) for s, at, v in spelled(conn, **kw)))
    assert timelines() == lazy


def test_the_full_decode_path_folds_the_same(tmp_path: Path) -> None:
    """Rows of an older schema version are decoded in full (and upcast): the same fold applies."""
    path = tmp_path / "ledger.sqlite"
    write_log(path, random_log(300, 7), progress=False)
    conn = open_reader(path)
    fold = AuditFold(partial(grant_device_ids, conn))
    try:
        for stored in iter_events(conn):
            fold.apply(stored.seq, stored.recorded_at, stored)
        assert _audit(fold.result(conn)) == _audit(audit_replay(path)) == _full(path, fold.seq)
    finally:
        conn.close()


def _moved(path: Path) -> AllocationCorrected:
    conn = sqlite3.connect(path)
    seq = conn.execute("SELECT seq FROM events WHERE type = 'alloc.corrected' ORDER BY seq LIMIT 1").fetchone()[0]
    conn.close()
    reader = open_reader(path)
    try:
        ev = next(iter_events(reader, after_seq=seq - 1)).event
    finally:
        reader.close()
    assert isinstance(ev, AllocationCorrected)
    return ev


def test_a_correction_is_on_both_pods_timelines_and_health_on_the_gpus(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    write_log(path, random_log(300, 1), progress=False)
    ev = _moved(path)
    for uid in (ev.previous_pod_uid, ev.pod_uid):
        entries = [e for e in pod_history(path, uid) if e.type == "alloc.corrected" and e.alloc_id == ev.alloc_id]
        assert entries, uid
        assert entries[0].pod_uid == ev.pod_uid and ev.previous_pod_uid in entries[0].detail
    gpu = gpu_history(path, "GPU-0001")
    health = [e for e in gpu if e.type == "gpu.health"]
    assert health and all("GPU-0001" in e.detail for e in health)
    assert any("UNHEALTHY" in e.detail for e in health)


def test_replay_and_history_print_corrections_and_health(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    last = write_log(path, random_log(300, 2), progress=False)
    ev = _moved(path)

    def run(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "gpuledger", *args, "--state-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        return out.stdout

    view = audit_replay(path)
    table = run("replay", "--seq", str(last))
    assert ("UNHEALTHY" in table) == any(not g.healthy for g in view.gpus)
    assert "healthy" in table
    if any(h.corrected_seq for h in view.allocations):
        assert "corrected at seq" in table
    if any(not h.charged for h in view.allocations):
        assert "not charged" in table
    assert "alloc.corrected" in run("history", "--pod", ev.previous_pod_uid)
    assert "gpu.health" in run("history", "--gpu", "0")
