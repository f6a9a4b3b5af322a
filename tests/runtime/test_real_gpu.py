"""Walkthrough on a real NVIDIA GPU (GPULEDGER_GPU_TESTS=1 on a GPU machine with the real runtime): a
whole-GPU pod's container, started by containerd and runc with exactly what the agent's Allocate
answered, runs CUDA. It loads the real driver from the driver volume the vmanager mirrored, cuInit
succeeds through the device nodes the response named, CUDA sees the GPU the pod was given, and the
memory the container then holds is mapped to it from NVML's process list and its real cgroup."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from libs.bus.server import NatsServer
from tests.builders.nvml import nvml_truth, uuid_hex
from tests.observability.helpers import HEALTH, free_port_base, holds_gpu_memory, scraped
from tests.polling import eventually
from tests.runtime.helpers import RtNode, gpu_container, pod, start_rt_node, start_services_in_process

pytestmark = pytest.mark.gpu

HELD = 256 << 20  # what the container's CUDA program allocates and holds


@pytest.fixture
async def rt_gpu_node(nats_server: NatsServer, short_dir: Path, runtime_images: Path) -> AsyncIterator[RtNode]:
    """Simulator on a real containerd, the services in this process, on the machine's own GPUs and driver."""
    async with AsyncExitStack() as stack:
        node = await start_rt_node(stack, short_dir, nats_server.url, runtime_images, None, driver_volumes=True,
                                   metrics_port=free_port_base(), metrics_host="127.0.0.1", **HEALTH)
        await start_services_in_process(stack, node, vcore=100 * len(nvml_truth()))
        yield node


async def test_a_whole_gpu_container_runs_cuda_on_its_gpu(rt_gpu_node: RtNode) -> None:
    node, truth = rt_gpu_node, nvml_truth()
    command = f"exec /bin/cuda-probe devices {HELD} > /tmp/probe.out 2>&1"
    running = await node.run_pod(pod("cuda", gpu_container("main", cores=100, command=command)))
    assert running["status"]["phase"] == "Running", running["status"]
    opts = node.sim.container_run_options("default", "cuda", "main")
    given = opts["envs"]["NVIDIA_VISIBLE_DEVICES"]
    minor = next(m for u, m, _ in truth if u == given)

    # Inside: its own GPU's node and the driver's control nodes, and no other GPU.
    code, out = await node.sh("cuda", "main", "ls /dev | grep nvidia")
    assert code == 0, out
    assert sorted(out.split()) == sorted([f"nvidia{minor}", "nvidia-uvm", "nvidiactl"])

    # The program started as the container's process: the real driver from the volume, CUDA up.
    last: list[str] = []

    async def probed() -> list[str] | None:
        try:
            code, out = await node.sh("cuda", "main", "cat /tmp/probe.out")
        except Exception as exc:  # the container has gone: say so below with its status
            last[:] = [repr(exc)]
            return None
        last[:] = [f"exit {code}: {out}"]
        lines = out.splitlines()
        return lines if code == 0 and (any(x.startswith("held ") for x in lines) or "failed" in out) else None

    try:
        lines = await eventually(probed, timeout=60, interval=0.5, what="the CUDA program's output in the container")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last read {last}; pod status {node.pod('cuda')['status']}") from None
    assert "failed" not in "\n".join(lines), lines
    first, count, *devices, held = lines
    name, path, version, rc = first.split()
    assert (name, path, rc) == ("libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1", "rc=0")
    assert int(version.removeprefix("cuDriverGetVersion=")) >= 11000
    assert count == "devices 1"  # the container sees its one GPU, although the host has len(truth)
    assert devices == [f"device 0 {uuid_hex(given)}"]
    assert held == f"held {HELD}"

    # NVML names the program's host pid; its cgroup (runc's, under the pod's) names the container.
    holds = holds_gpu_memory("cuda", HELD, container="main")
    await eventually(lambda: scraped(node.settings.metrics_port, holds), timeout=30, interval=0.5,
                     what="the container's GPU memory on the allocator's /metrics")
