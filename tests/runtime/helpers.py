"""Helpers of the real-runtime tests: pod manifests, and a node whose simulated kubelet runs every pod
as real containers (containerd + runc through CRI). The fake GPU device nodes are the product's
(simulator/runtime/fakegpus.py), shared with bench.pod_start and the demo."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.config import Settings
from libs.vcuda import config as vcuda_config
from simulator import NodeSimulator, SimConfig
from simulator.runtime.cri import cri
from simulator.runtime.fakegpus import FakeGpus
from simulator.runtime.leftovers import cgroup_mounts
from tests.e2e.helpers import wait_for_gpu_resources
from tests.processes import processes_mentioning

NODE = "rt-node"
VCUDA_SOCK = "/etc/vcuda/vcuda.sock"  # where the Allocate response mounts the pod's directory


def gpu_container(name: str, cores: int = 0, memory: int = 0, *, command: str | None = None,
                  image: str = "cuda") -> dict[str, Any]:
    limits = {}
    if cores:
        limits["tencent.com/vcuda-core"] = str(cores)
    if memory:
        limits["tencent.com/vcuda-memory"] = str(memory)
    spec: dict[str, Any] = {"name": name, "image": image, "resources": {"limits": limits, "requests": dict(limits)}}
    if command is not None:
        spec["command"] = ["/bin/sh", "-c", command]
    return spec


def pod(name: str, *containers: dict[str, Any], init: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers), "terminationGracePeriodSeconds": 5}
    if init:
        spec["initContainers"] = list(init)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def runtime_id(pod_obj: dict[str, Any], container: str) -> str:
    statuses = [*(pod_obj["status"].get("initContainerStatuses") or []), *pod_obj["status"]["containerStatuses"]]
    st = next(s for s in statuses if s["name"] == container)
    return str(st["containerID"]).split("://", 1)[1]


@dataclass
class RtNode:
    """The simulator (kubelet on containerd) and the agent's settings; services attached by the fixture."""

    sim: NodeSimulator
    settings: Settings
    gpus: FakeGpus | None  # None: the machine's real GPUs (NVML)
    services: dict[str, Any] = field(default_factory=dict)
    launcher: Any = None

    async def allocations(self) -> list[Any]:
        """The allocator's live allocations, asked over NATS as any client would."""
        from libs.bus.client import Bus
        from libs.commands import StateReply, StateRequest

        bus = await Bus.connect(self.settings.nats_url, name="rt-test", node=NODE)
        try:
            reply = await bus.request(bus.subjects.state, StateRequest(), StateReply, timeout=5)
        finally:
            await bus.close()
        return list(reply.snapshot.allocations)

    async def wait_no_allocations(self, timeout: float = 20) -> None:
        async with asyncio.timeout(timeout):
            while await self.allocations():  # noqa: ASYNC110 (another process's state: poll it)
                await asyncio.sleep(0.2)

    @property
    def client(self) -> Any:
        return self.sim.runtime.pods.client

    async def run_pod(self, manifest: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        created = await self.sim.create_pod(manifest)
        ns, name = created["metadata"]["namespace"], created["metadata"]["name"]
        return await self.sim.wait_for_pod(
            ns, name, lambda p: p["status"].get("phase") in ("Running", "Failed", "Succeeded"), timeout)

    def pod(self, name: str) -> dict[str, Any]:
        found = self.sim.get_pod("default", name)
        assert found is not None, f"pod {name} does not exist"
        return found

    async def exec(self, pod_name: str, container: str, *cmd: str, timeout: int = 20) -> cri.ExecSyncResponse:
        """Run a command inside the container (CRI ExecSync: its namespaces, cgroup and device rules)."""
        return await self.client.exec_sync(runtime_id(self.pod(pod_name), container), list(cmd), timeout)

    async def sh(self, pod_name: str, container: str, script: str) -> tuple[int, str]:
        reply = await self.exec(pod_name, container, "/bin/sh", "-c", script)
        return reply.exit_code, (reply.stdout + reply.stderr).decode(errors="replace")

    async def register(self, pod_name: str, container: str, *, as_pod: str | None = None) -> tuple[int, str]:
        """vcuda-register from inside the container, naming its own pod (or ``as_pod``'s) and container id."""
        target = self.pod(as_pod or pod_name)
        reply = await self.exec(pod_name, container, "/bin/vcuda-register", VCUDA_SOCK,
                                target["metadata"]["uid"], runtime_id(self.pod(pod_name), container))
        return reply.exit_code, (reply.stdout + reply.stderr).decode(errors="replace")

    async def read_vcuda_config(self, pod_name: str, container: str) -> vcuda_config.VcudaConfig:
        """The container reads its own vcuda.config (od inside the container); decoded here."""
        cid = runtime_id(self.pod(pod_name), container)
        code, out = await self.sh(pod_name, container, f"od -An -v -tx1 /etc/vcuda/{cid}/vcuda.config")
        assert code == 0, out
        return vcuda_config.decode(bytes(int(b, 16) for b in out.split()))


def pod_cgroup_dirs(uid: str) -> list[str]:
    """Every cgroup directory of the pod, in any hierarchy and QoS level."""
    found = []
    for mount in cgroup_mounts():
        for level in ("kubepods", "kubepods/besteffort", "kubepods/burstable"):
            path = Path(mount) / level / f"pod{uid}"
            if path.exists():
                found.append(str(path))
    return found


async def host_cgroup_of_pid1(node: RtNode, pod_name: str, container: str) -> str:
    """/proc/<pid>/cgroup of the container's first process, read on the host."""
    pid = await node.client.container_pid(runtime_id(node.pod(pod_name), container))
    return Path(f"/proc/{pid}/cgroup").read_text()


def mounts_under(prefix: str) -> list[str]:
    return [line.split(" ")[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split(" ")[4].startswith(prefix)]


def rt_settings(root: Path, nats_url: str, gpus: FakeGpus | None, **overrides: Any) -> Settings:
    return Settings(
        node_name=NODE, state_dir=str(root / "state"), device_plugin_dir=str(root / "dp"),
        pod_resources_socket=str(root / "pr" / "kubelet.sock"), kubeconfig=str(root / "kubeconfig"),
        nats_url=nats_url, gpus=f"fake:{gpus.profile}" if gpus else "nvml", allocate_timeout=5.0, request_timeout=3.0,
        cgroup_root="/sys/fs/cgroup", proc_root="/proc",  # the real ones: containers are real
        **{"driver_volumes": False, **overrides},
    )


async def start_rt_sim(root: Path, images: Path, **sim_overrides: Any) -> NodeSimulator:
    sim = NodeSimulator(SimConfig(
        node_name=NODE, device_plugin_dir=root / "dp", pod_resources_socket=root / "pr" / "kubelet.sock",
        kubeconfig_path=root / "kubeconfig", seed=7, runtime="containerd", runtime_dir=root / "rt",
        runtime_images=images, container_retry_backoff=0.5, **sim_overrides))
    await sim.start()
    return sim


def assert_nothing_left(root: Path, handle: Any) -> None:
    """After the simulator stopped: nothing of the runtime survives outside ``root``."""
    assert handle.leftovers_found == [], handle.leftovers_found
    assert processes_mentioning(str(root / "rt")) == []
    assert mounts_under(str(root)) == []


async def start_rt_node(stack: AsyncExitStack, root: Path, url: str, images: Path, gpus: FakeGpus | None,
                        sim_overrides: dict[str, Any] | None = None, **overrides: Any) -> RtNode:
    sim = await start_rt_sim(root, images, **(sim_overrides or {}))
    handle = sim.runtime

    async def stop() -> None:
        await sim.stop()
        assert_nothing_left(root, handle)

    stack.push_async_callback(stop)
    # The vmanager asks this containerd for a registering container's name, as on a real node
    overrides = {"container_runtime_endpoint": str(handle.containerd.socket), **overrides}
    return RtNode(sim=sim, settings=rt_settings(root, url, gpus, **overrides), gpus=gpus)


async def start_services_in_process(stack: AsyncExitStack, node: RtNode, *, vcore: int = 400) -> None:
    from services.allocator import app as allocator_app
    from services.registrar import app as registrar_app
    from services.vmanager import app as vmanager_app
    from services.watchdog import app as watchdog_app

    s = node.settings
    node.services = {
        "allocator": await stack.enter_async_context(allocator_app.service(s)),
        "watchdog": await stack.enter_async_context(watchdog_app.service(s, reconcile_period=1.0)),
        "vmanager": await stack.enter_async_context(vmanager_app.service(s)),
        "registrar": await stack.enter_async_context(registrar_app.service(s)),
    }
    await wait_for_gpu_resources(node.sim, vcore, timeout=20)
