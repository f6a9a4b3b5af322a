"""hami-core limit delivery on a whole simulated node (in-process services), end to end."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from libs.bus.server import NatsServer
from libs.kube.pods import RESOURCE_VCORE
from libs.ledger.state import LedgerState
from libs.store import replay
from tests.builders import gpu_pod, settings_for
from tests.e2e.helpers import Node, opposite_order, prestart, start_in_process
from tests.polling import eventually


@pytest.fixture
async def hami_node(nats_server: NatsServer, short_dir: Path) -> AsyncIterator[Node]:
    library = short_dir / "hami" / "libvgpu.so"
    library.parent.mkdir()
    library.write_bytes(b"\x7fELF")
    settings = settings_for(short_dir, nats_server.url, limit_delivery="hami-core", hami_library=str(library),
                            hami_lock_dir=str(short_dir / "vgpulock"))
    async with AsyncExitStack() as stack:
        yield await start_in_process(stack, short_dir, nats_server.url, settings)


async def test_hami_core_mode_end_to_end(hami_node: Node) -> None:
    node, s = hami_node, hami_node.settings
    pod = await node.run_pod(gpu_pod("train", ("trainer", 30, 3), ("evaluator", 100, 0)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    uid = pod["metadata"]["uid"]

    trainer = node.sim.container_run_options("default", "train", "trainer")
    cache = trainer["envs"].pop("CUDA_DEVICE_MEMORY_SHARED_CACHE")
    assert cache.startswith("/usr/local/vgpu/") and cache.endswith(".cache")
    assert trainer["envs"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "768m"
    assert trainer["envs"]["CUDA_DEVICE_SM_LIMIT"] == "30"
    cache_host = s.vm_root / uid / "_hami" / "trainer"
    mounts = {m["container_path"]: (m["host_path"], m["read_only"]) for m in trainer["mounts"]}
    assert mounts == {
        "/usr/local/nvidia": (str(s.vdriver_root / "origin"), True),
        "/usr/local/vgpu": (str(cache_host), False),
        "/usr/local/vgpu/libvgpu.so": (s.hami_library, True),
        s.hami_lock_dir: (s.hami_lock_dir, False),
        "/etc/ld.so.preload": (str(s.hami_preload), True),
    }
    # Made by the vmanager before the container started; the preload file names the library.
    assert cache_host.is_dir() and stat.S_IMODE(os.stat(cache_host).st_mode) == 0o777
    assert s.hami_preload.read_text() == "/usr/local/vgpu/libvgpu.so\n"
    assert stat.S_IMODE(os.stat(s.hami_preload).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(s.hami_lock_dir).st_mode) == 0o1777
    # Whole GPUs: no limits, as in vcuda mode.
    evaluator = node.sim.container_run_options("default", "train", "evaluator")
    assert not any(k.startswith("CUDA_DEVICE_") for k in evaluator["envs"])

    await node.sim.delete_pod("default", "train")
    await eventually(lambda: not (s.vm_root / uid).exists(), timeout=15, interval=0.1,
                     what="the pod's directory removed")


async def test_a_corrected_grant_keeps_hami_core_delivery(hami_node: Node) -> None:
    # pod-resources is down while two pods start, so the allocator guesses their grants the wrong way
    # round (tests/e2e/test_identity.py); the correction at PreStartContainer must record the HAMi-core
    # response of the real owner (its memory limit, its cache directory), not gpu-manager's vcuda one,
    # and the log must give that response back exactly.
    node, s = hami_node, hami_node.settings
    assert node.sim.pod_resources is not None
    await node.sim.pod_resources.stop()
    uid, want = await opposite_order(node)
    await node.sim.pod_resources.start()
    await prestart(node, node.sim.allocated_device_ids(uid["pod-b"], "main", RESOURCE_VCORE))
    corrected = await node.tap.wait("alloc.corrected", 2, timeout=10)

    snap = await node.snapshot()
    by_pod = {a.pod_name: a for a in snap.allocations}
    for name in ("pod-a", "pod-b"):
        response = by_pod[name].response
        assert by_pod[name].corrected_seq > 0
        assert response.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{want[name] >> 20}m"
        assert response.envs["CUDA_DEVICE_SM_LIMIT"] == "60"
        mounts = {m.container_path: m.host_path for m in response.mounts}
        assert mounts["/usr/local/vgpu"] == str(s.vm_root / uid[name] / "_hami" / "main")
        assert "/etc/vcuda" not in mounts
        assert (s.vm_root / uid[name] / "_hami" / "main").is_dir()  # made by the vmanager
    # What the bus carried is what the log gives back (stored compact, reproduced byte for byte).
    replayed = LedgerState()
    replay(s.log_path, replayed.apply)
    assert replayed.snapshot() == snap
    assert {r.data["pod_uid"]: r.data["response"]["envs"]["CUDA_DEVICE_MEMORY_LIMIT_0"] for r in corrected} == {
        uid[n]: f"{want[n] >> 20}m" for n in ("pod-a", "pod-b")}
