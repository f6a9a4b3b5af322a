"""A whole node on a real NVIDIA GPU (run with GPULEDGER_GPU_TESTS=1 on a GPU machine).

The services read NVML's inventory and mirror the host's driver, as on a real node. The checks read the
truth elsewhere: NVML asked directly (pynvml), the device nodes in /dev, and CUDA itself, loaded from the
driver volume that a whole-GPU container gets, holding GPU memory that the usage sample must then map
to that container.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from libs.bus.server import NatsServer
from libs.config import MEMORY_BLOCK
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY
from libs.vcuda.client import register_vdevice
from libs.vcuda.config import decode
from simulator.runtime.fakegpus import NVIDIA_MAJOR
from tests.builders import gpu_pod, settings_for
from tests.builders.cgroups import enter_container
from tests.builders.nvml import nvml_truth, uuid_hex
from tests.e2e.helpers import Node, start_in_process
from tests.observability.helpers import HEALTH, free_port_base, holds_gpu_memory, scrape, scraped, value
from tests.polling import eventually
from tests.runtime.helpers import runtime_id

pytestmark = pytest.mark.gpu

# What a CUDA program does first, through the driver API alone (no toolkit needed): initialise, find
# the device, make its context current, allocate. Then it holds the memory until its stdin closes.
CUDA_PROCESS = r"""
import ctypes, sys
cuda = ctypes.CDLL(sys.argv[1])
def call(name, *args):
    rc = getattr(cuda, name)(*args)
    if rc != 0:
        sys.exit(f"{name} failed: CUresult {rc}")
call("cuInit", 0)
count, dev, ctx, ptr = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
uuid = (ctypes.c_ubyte * 16)()
call("cuDeviceGetCount", ctypes.byref(count))
call("cuDeviceGet", ctypes.byref(dev), 0)
call("cuDeviceGetUuid_v2", uuid, dev)
call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
call("cuCtxSetCurrent", ctx)
call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(int(sys.argv[2])))
print(count.value, bytes(uuid).hex(), flush=True)
sys.stdin.read()
"""


@pytest.fixture
async def gpu_node(nats_server: NatsServer, short_dir: Path) -> AsyncIterator[Node]:
    settings = settings_for(short_dir, nats_server.url, gpus="nvml", driver_volumes=True,
                            metrics_port=free_port_base(), metrics_host="127.0.0.1", **HEALTH)
    async with AsyncExitStack() as stack:
        yield await start_in_process(stack, short_dir, nats_server.url, settings, vcore=100 * len(nvml_truth()))


def assert_device_node(path: str, minor: int | None = None) -> None:
    # runc fails CreateContainer on a device spec whose host node is missing (lstat ...: no such file)
    st = os.stat(path)
    assert stat.S_ISCHR(st.st_mode), f"{path} is not a character device"
    if minor is not None:
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (NVIDIA_MAJOR, minor), path


async def test_shares_and_whole_gpus_of_the_real_gpus(gpu_node: Node) -> None:
    node, truth = gpu_node, nvml_truth()
    snap = await node.snapshot()
    assert [(g.uuid, g.minor, g.memory_total) for g in snap.gpus] == truth
    r = await asyncio.to_thread(scrape, node.settings.metrics_port + 1)
    assert value(r, "gpuledger_advertised_devices", resource=RESOURCE_VCORE, health="Healthy") == 100 * len(truth)
    assert value(r, "gpuledger_advertised_devices", resource=RESOURCE_VMEMORY,
                 health="Healthy") == sum(memory // MEMORY_BLOCK for _, _, memory in truth)

    # A share: the real GPU's node, its UUID, and the limits registered through vcuda.sock.
    pod = await node.run_pod(gpu_pod("infer", ("main", 50, 4)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    uid = pod["metadata"]["uid"]
    (alloc,) = (await node.snapshot()).allocations
    share = alloc.shares[0]
    uuid, minor, _ = truth[share.index]
    opts = node.sim.container_run_options("default", "infer", "main")
    assert [d["host_path"] for d in opts["devices"]] == [f"/dev/nvidia{minor}", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert_device_node(f"/dev/nvidia{minor}", minor)
    for d in opts["devices"][1:]:
        assert_device_node(d["host_path"])
    assert opts["envs"]["NVIDIA_VISIBLE_DEVICES"] == uuid
    cid = runtime_id(pod, "main")
    vm_dir = node.settings.vm_root / uid
    node.enter_container(uid, cid)
    await register_vdevice(str(vm_dir / "vcuda.sock"), pod_uid=uid, container_id=cid, timeout=5)
    cfg = decode((vm_dir / cid / "vcuda.config").read_bytes())
    assert (cfg.pod_uid, cfg.utilization, cfg.gpu_memory) == (uid, 50, 4 * MEMORY_BLOCK)

    # Every GPU whole is more than is left: refused, as the kubelet reports it.
    everything = await node.run_pod(gpu_pod("all", ("c", 100 * len(truth), 0)))
    assert everything["status"]["phase"] == "Failed"
    assert everything["status"]["reason"] == "UnexpectedAdmissionError"

    # Once the share is gone, they are all free again.
    await node.sim.delete_pod("default", "infer")
    await node.tap.wait("alloc.released", 1)
    await node.sim.delete_pod("default", "all")
    again = await node.run_pod(gpu_pod("all-again", ("c", 100 * len(truth), 0)))
    assert again["status"]["phase"] == "Running", again["status"]
    opts = node.sim.container_run_options("default", "all-again", "c")
    assert sorted(d["host_path"] for d in opts["devices"] if d["host_path"][-1].isdigit()) == sorted(
        f"/dev/nvidia{m}" for _, m, _ in truth)
    assert set(opts["envs"]["NVIDIA_VISIBLE_DEVICES"].split(",")) == {u for u, _, _ in truth}


async def test_cuda_through_the_driver_volume_and_its_memory_mapped_to_the_container(gpu_node: Node) -> None:
    node, truth = gpu_node, nvml_truth()
    pod = await node.run_pod(gpu_pod("cuda", ("main", 100, 0)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    uid = pod["metadata"]["uid"]
    opts = node.sim.container_run_options("default", "cuda", "main")
    (driver,) = [m["host_path"] for m in opts["mounts"] if m["container_path"] == "/usr/local/nvidia"]
    assert driver == str(node.settings.vdriver_root / "origin")
    libcuda = Path(driver) / "lib64" / "libcuda.so.1"

    # A CUDA program loads the driver from the volume, sees the GPU the container was given, and holds
    # 1 GiB of its memory.
    held = 1 << 30
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CUDA_PROCESS, str(libcuda), str(held),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(child.stdout.readline(), 60)  # type: ignore[union-attr]
        if not line:
            err = await asyncio.wait_for(child.stderr.read(), 10)  # type: ignore[union-attr]
            pytest.fail(f"the CUDA program failed: {err.decode(errors='replace')}")
        count, seen = line.decode().split()
        assert int(count) == len(truth)
        given = opts["envs"]["NVIDIA_VISIBLE_DEVICES"]
        assert given in {u for u, _, _ in truth}
        if len(truth) == 1:  # with several, CUDA's device 0 need not be NVML's index 0
            assert seen == uuid_hex(given)

        # NVML names the program's pid; its cgroup names the container; the sample maps them.
        enter_container(Path(node.settings.proc_root).parent, uid, runtime_id(pod, "main"), pid=child.pid)
        holds = holds_gpu_memory("cuda", held)
        m = await eventually(lambda: scraped(node.settings.metrics_port, holds), timeout=30, interval=0.5,
                             what="the CUDA program's memory under its container on the allocator's /metrics")
        index = next(i for i, (u, _, _) in enumerate(truth) if u == given)
        assert value(m, "gpuledger_gpu_memory_used_bytes", gpu=str(index)) >= held
    finally:
        if child.returncode is None:
            child.stdin.close()  # type: ignore[union-attr]
            try:
                await asyncio.wait_for(child.wait(), 20)
            except TimeoutError:
                child.kill()
                await child.wait()
