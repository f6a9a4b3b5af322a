"""Fixtures of the real-runtime tests: pods run as real containers (containerd + runc, driven through
CRI by the simulator's kubelet), the agent's four services serving them.

They need root, containerd, runc, a static busybox and a C compiler (``apt-get install containerd runc
busybox-static gcc libc6-dev``). Without them every test here is skipped with one reason, reported on
one line; with ``GPULEDGER_REQUIRE_RUNTIME=1`` (CI) a missing runtime is an error instead.
After each test, nothing the run made may be left outside its temp dir: containerd, shims, pause
processes, mounts, pod cgroups, the fake /dev/nvidia* nodes (a reaper process removes them even when
the test process is killed; ``test_cleanup.py`` kills one to show it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from libs.bus.server import NatsServer
from simulator.runtime import runtime_unavailable_reason
from simulator.runtime.fakegpus import FakeGpus, fake_gpus_on_host
from simulator.runtime.images import build_images
from tests.e2e.helpers import wait_for_gpu_resources
from tests.runtime.helpers import RtNode, start_rt_node, start_services_in_process

REQUIRE = "GPULEDGER_REQUIRE_RUNTIME"
HERE = Path(__file__).parent
_not_run: list[str] = []  # why the real-runtime tests were left out, reported once at the end


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without a runtime (and without GPULEDGER_REQUIRE_RUNTIME=1) these tests are left out, and
    one line at the end of the run says so and why (skips would print one line per test)."""
    ours = [item for item in items if HERE in Path(str(item.path)).parents]
    if not ours or os.environ.get(REQUIRE) == "1":
        return
    reason = runtime_unavailable_reason()
    if reason is None:
        return
    _not_run.append(f"real-runtime tests did not run ({len(ours)} deselected): {reason}")
    config.hook.pytest_deselected(items=ours)
    items[:] = [item for item in items if item not in ours]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in _not_run:
        terminalreporter.write_line(line, yellow=True)


@pytest.fixture(scope="session")
def runtime_images() -> Iterator[Path]:
    """The images, built once; an error under GPULEDGER_REQUIRE_RUNTIME=1 without a runtime."""
    reason = runtime_unavailable_reason()
    if reason:
        pytest.fail(f"{REQUIRE}=1 but the real runtime cannot run here: {reason}", pytrace=False)
    out = Path(tempfile.mkdtemp(prefix="glimg", dir="/tmp"))
    try:
        build_images(out)
        yield out
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def fake_gpus(runtime_images: Path, short_dir: Path) -> Iterator[FakeGpus]:
    """Four fake GPUs: /dev/nvidia<minor> nodes (major 195, free minors) and a fake file naming them,
    made and removed as every real-runtime run makes them (``fake_gpus_on_host``: a reaper, the host's lock)."""
    with fake_gpus_on_host(short_dir) as gpus:  # a node left behind fails the teardown, naming it
        yield gpus


@pytest.fixture
async def rt_node(nats_server: NatsServer, short_dir: Path, runtime_images: Path,
                  fake_gpus: FakeGpus) -> AsyncIterator[RtNode]:
    """Simulator on a real containerd + the four services in this process."""
    async with AsyncExitStack() as stack:
        node = await start_rt_node(stack, short_dir, nats_server.url, runtime_images, fake_gpus)
        await start_services_in_process(stack, node)
        yield node


@pytest.fixture
async def rt_node_processes(nats_server: NatsServer, short_dir: Path, runtime_images: Path,
                            fake_gpus: FakeGpus) -> AsyncIterator[RtNode]:
    """Simulator on a real containerd + the four services as their own processes (gpuledger up's way)."""
    from gpuledger.launcher import Launcher

    async with AsyncExitStack() as stack:
        node = await start_rt_node(stack, short_dir, nats_server.url, runtime_images, fake_gpus, log_format="json")
        node.launcher = Launcher(node.settings, embedded_nats=False, log_dir=short_dir / "logs")
        stack.push_async_callback(node.launcher.stop)
        await node.launcher.start_services()
        await wait_for_gpu_resources(node.sim, 400, timeout=60)
        yield node


@pytest.fixture
async def rt_dra_node(nats_server: NatsServer, short_dir: Path, runtime_images: Path,
                      fake_gpus: FakeGpus) -> AsyncIterator[RtNode]:
    """Simulator on a real containerd with the kubelet's DRA half (plugin watcher, DRA manager, CDI
    resolution), GPUs 0 and 1 in DRA mode, the DeviceClass and example claim templates; services in process."""
    from tests.dra.e2e.helpers import claim_templates, deviceclass

    dirs = {"plugins_registry_dir": short_dir / "reg", "cdi_dir": short_dir / "cdi"}
    async with AsyncExitStack() as stack:
        node = await start_rt_node(stack, short_dir, nats_server.url, runtime_images, fake_gpus,
                                   sim_overrides={**dirs, "dra_state_dir": short_dir / "kubelet"},
                                   dra_gpus="0,1", kubelet_plugins_dir=str(short_dir / "plugins"),
                                   health_checks=False, **{k: str(v) for k, v in dirs.items()})
        node.sim.dra_objects.classes.create(deviceclass())
        for template in claim_templates():
            node.sim.dra_objects.templates.create(template)
        await start_services_in_process(stack, node, vcore=200)
        yield node
