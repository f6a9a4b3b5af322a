"""Walkthrough: the driver volume. A stand-in libcuda.so.1 (built here, listed in an ld.so.cache
made with the real ldconfig) is mirrored by the vmanager into the whole-GPU volume, mounted at
/usr/local/nvidia, and loaded inside the container by the dynamic loader from LD_LIBRARY_PATH."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from libs.bus.server import NatsServer
from simulator.runtime.fakegpus import FakeGpus
from tests.runtime.helpers import RtNode, gpu_container, pod, start_rt_node, start_services_in_process

STUB = "int cuDriverGetVersion(int *v) { *v = 12020; return 0; }\n"


def _stand_in_driver(root: Path) -> Path:
    """libcuda.so.550.54.15 (soname libcuda.so.1) in ROOT/driver/lib64, and the ld.so.cache naming it."""
    lib64 = root / "driver" / "lib64"
    lib64.mkdir(parents=True)
    (root / "stub.c").write_text(STUB)
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    str(lib64 / "libcuda.so.550.54.15"), str(root / "stub.c")], check=True, timeout=60)
    (root / "ld.so.conf").write_text(f"{lib64}\n")
    cache = root / "ld.so.cache"
    subprocess.run([shutil.which("ldconfig") or "/sbin/ldconfig", "-C", str(cache), "-f", str(root / "ld.so.conf")],
                   check=True, timeout=60)
    return cache


@pytest.fixture
async def rt_node_driver(nats_server: NatsServer, short_dir: Path, runtime_images: Path,
                         fake_gpus: FakeGpus) -> AsyncIterator[RtNode]:
    cache = _stand_in_driver(short_dir)
    (short_dir / "nobin").mkdir()
    async with AsyncExitStack() as stack:
        node = await start_rt_node(stack, short_dir, nats_server.url, runtime_images, fake_gpus,
                              driver_volumes=True, ld_cache=str(cache), driver_bin_dirs=str(short_dir / "nobin"))
        await start_services_in_process(stack, node)
        yield node


async def test_the_driver_volume_is_loaded_by_the_dynamic_loader_inside(rt_node_driver: RtNode) -> None:
    node = rt_node_driver
    running = await node.run_pod(pod("whole", gpu_container("cuda", cores=100)))
    assert running["status"]["phase"] == "Running", running["status"]
    origin = Path(node.settings.vdriver_root) / "origin" / "lib64"
    assert (origin / "libcuda.so.1").exists()  # mirrored by the vmanager at start

    code, out = await node.sh("whole", "cuda", "echo $LD_LIBRARY_PATH; /bin/cuda-probe")
    assert code == 0, out
    library_path, probe = out.splitlines()[:2]
    assert library_path == "/usr/local/nvidia/lib64"
    assert probe.split() == ["libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1", "cuDriverGetVersion=12020",
                             "rc=0"]
    code, out = await node.sh("whole", "cuda", "touch /usr/local/nvidia/lib64/x")
    assert code != 0 and "Read-only file system" in out, out
