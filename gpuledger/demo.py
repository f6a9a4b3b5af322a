"""``gpuledger up --demo``: walk a multi-container GPU pod through a simulated node and narrate it.

``DemoNode`` is what ``up --demo`` adds to a plain ``up``: a scratch state directory, the node
simulator as one more child of the launcher, and the walkthrough (``run_demo``) next to the agent.

Everything goes through the real interfaces: pods are created and deleted with a Kubernetes client
(lightkube) against the simulator's API; the simulated kubelet calls our registrar over gRPC; events
are read the way an operator would, with a plain (core) NATS subscription; the container registration
goes through the pod's real vcuda.sock.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import click
from lightkube import AsyncClient, KubeConfig
from lightkube.resources.core_v1 import Pod as KubePod

from gpuledger.demo_runtime import DemoRuntime
from gpuledger.launcher import Launcher
from libs.bus.client import Bus
from libs.cgroups import container_cgroup_paths
from libs.commands import StateReply, StateRequest
from libs.config import MIB, Settings
from libs.events.codec import StoredEvent
from libs.events.schema import AllocationGranted, AllocationRefused, AllocationReleased, AnyEvent, InventoryRecorded
from libs.events.subjects import Subjects
from libs.kube.pods import RESOURCE_VCORE
from libs.vcuda.client import register_vdevice
from libs.vcuda.config import decode as decode_vcuda_config

__all__ = ["DEMO_POD", "NEXT_POD", "DemoNode", "run_demo"]

def _pod(name: str, *containers: tuple[str, str, dict[str, str]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": [{"name": c, "image": image, "resources": {"limits": limits}}
                                for c, image, limits in containers]},
    }


CUDA = "nvidia/cuda:12.4.1-base-ubuntu22.04"
DEMO_POD = _pod(
    "demo-train",
    ("trainer", CUDA, {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "4"}),
    ("evaluator", CUDA, {"tencent.com/vcuda-core": "100"}),
)
NEXT_POD = _pod(
    "demo-next",
    ("notebook", "jupyter/base-notebook", {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "4"}),
)


def say(text: str = "", **style: Any) -> None:
    click.secho(text, **style)


class EventPrinter:
    """Counts and prints committed events as a plain NATS subscriber sees them."""

    def __init__(self, subjects: Subjects) -> None:
        self.subjects = subjects
        self.seen: list[StoredEvent] = []
        self._arrived = asyncio.Condition()

    async def on_event(self, stored: StoredEvent) -> None:
        subject = self.subjects.event(stored.type)  # the subject it was published on
        say(f"    [nats {subject}] seq={stored.seq} {_detail(stored.event)}", fg="cyan")
        async with self._arrived:
            self.seen.append(stored)
            self._arrived.notify_all()

    async def wait_for(self, type_name: str, count: int, timeout: float) -> None:
        async with asyncio.timeout(timeout), self._arrived:
            await self._arrived.wait_for(lambda: sum(r.type == type_name for r in self.seen) >= count)


def _detail(ev: AnyEvent) -> str:
    if type(ev) is AllocationGranted:  # not its subclass AllocationImported
        return f"{ev.namespace}/{ev.pod_name}:{ev.container} cores={ev.cores} " \
               f"GPU{','.join(str(s.index) for s in ev.shares)}"
    if isinstance(ev, AllocationReleased):
        return f"pod {ev.pod_uid[:8]}…:{ev.container} ({ev.reason})"
    if isinstance(ev, AllocationRefused):
        return ev.reason
    if isinstance(ev, InventoryRecorded):
        return f"{len(ev.gpus)} GPUs ({ev.backend})"
    return ""


async def _wait(fetch: Callable[[], Any], ok: Callable[[Any], bool], timeout: float, what: str) -> Any:
    async with asyncio.timeout(timeout):
        while True:
            value = await fetch()
            if ok(value):
                return value
            await asyncio.sleep(0.2)
    raise AssertionError(what)  # pragma: no cover


async def _pod(client: AsyncClient, name: str, phase: str, timeout: float = 30) -> KubePod:
    async def fetch() -> KubePod:
        return await client.get(KubePod, name=name, namespace="default")

    try:
        return await _wait(fetch, lambda p: p.status and p.status.phase in (phase, "Failed"), timeout, name)
    except TimeoutError:
        pod = await fetch()
        raise click.ClickException(f"pod {name} did not reach {phase}: {pod.status}") from None


def _show_response(name: str, opts: dict[str, Any]) -> None:
    say(f"  container {name}:", bold=True)
    say(f"    devices     {', '.join(d['container_path'] for d in opts.get('devices', []))}")
    for key, value in sorted(opts.get("envs", {}).items()):
        say(f"    env         {key}={value}")
    for m in opts.get("mounts", []):
        say(f"    mount       {m['container_path']} <- {m['host_path']} ({'ro' if m.get('read_only') else 'rw'})")
    for key, value in sorted(opts.get("annotations", {}).items()):
        say(f"    annotation  {key}={value}")


async def _show_gpus(bus: Bus, timeout: float) -> None:
    snap = (await bus.request(bus.subjects.state, StateRequest(), StateReply, timeout=timeout)).snapshot
    for g in snap.gpus:
        bar = "#" * (g.cores_used // 10) + "." * (10 - min(10, g.cores_used // 10))
        say(f"    GPU{g.index} [{bar}] cores {g.cores_used:>3}/100  memory {g.memory_used // MIB:>6}/"
            f"{g.memory_total // MIB} MiB")


def _as_container_process(settings: Settings, pod_uid: str, container_id: str) -> None:
    """The simulator runs no containers: make this process one of the trainer's, as the vmanager sees
    it (its caller check reads <proc_root>/<pid>/cgroup; pids.config comes from <cgroup_root>)."""
    rel = container_cgroup_paths(pod_uid, container_id, "Burstable")[2]  # systemd + containerd scope
    cgroup = Path(settings.cgroup_root)
    (cgroup / rel).mkdir(parents=True, exist_ok=True)
    (cgroup / "cgroup.controllers").write_text("memory pids\n")
    (cgroup / rel / "cgroup.procs").write_text(f"{os.getpid()}\n")
    proc = Path(settings.proc_root) / str(os.getpid())
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "cgroup").write_text(f"0::/{rel}\n")


async def run_demo(settings: Settings, api_url: str, kubeconfig: Path, *, runtime: DemoRuntime | None = None) -> None:
    """``runtime``: the pods run as real containers (gpuledger/demo_runtime.py), and the trainer
    registers from inside its container instead of through a simulated /proc."""
    bus = await Bus.connect(settings.nats_url, name="demo", node=settings.node_name)
    printer = EventPrinter(bus.subjects)
    client = AsyncClient(config=KubeConfig.from_file(kubeconfig))
    http = aiohttp.ClientSession(base_url=api_url)
    try:
        for subject in bus.subjects.event_subjects():
            await bus.subscribe_events(subject, printer.on_event)
        say("\n1. Waiting for the registrar to register with the simulated kubelet…", bold=True)

        async def resources() -> dict[str, Any]:
            async with http.get("/simulator/v1/resources") as resp:
                return await resp.json()

        res = await _wait(resources, lambda r: r.get(RESOURCE_VCORE, {}).get("allocatable", 0) > 0, 60, "registration")
        for name, counts in sorted(res.items()):
            say(f"    {name}: {counts['allocatable']} devices advertised")

        say("\n2. Creating pod default/demo-train: trainer (50 cores + 4 x 256 MiB) and evaluator (100 cores)",
            bold=True)
        await client.create(KubePod.from_dict(DEMO_POD))
        pod = await _pod(client, "demo-train", "Running", 120 if runtime else 30)  # containerd starts first
        if pod.status.phase != "Running":
            raise click.ClickException(f"demo-train was not admitted: {pod.status.reason}: {pod.status.message}")
        uid = pod.metadata.uid
        say(f"    admitted and running (uid {uid}); the kubelet handed the containers:")
        for c in ("trainer", "evaluator"):
            async with http.get(f"/simulator/v1/pods/default/demo-train/containers/{c}") as resp:
                _show_response(c, await resp.json())
        await printer.wait_for("alloc.granted", 2, 10)
        await _show_gpus(bus, settings.request_timeout)

        say("\n3. The trainer's CUDA library registers through the pod's vcuda.sock", bold=True)
        cid = next(s.containerID for s in pod.status.containerStatuses if s.name == "trainer").split("://")[-1]
        pod_dir = settings.vm_root / uid
        if runtime is not None:
            said, cfg = await runtime.register_inside(cid, uid)
            say(f"    inside container {cid[:13]}: /bin/vcuda-register /etc/vcuda/vcuda.sock {uid} {cid[:13]}… "
                f"({said or 'registered'})")
            say(f"    the vmanager wrote {pod_dir / cid / 'vcuda.config'}; the container's own read of "
                f"/etc/vcuda/{cid[:13]}…/vcuda.config:")
        else:
            _as_container_process(settings, uid, cid)
            await register_vdevice(str(pod_dir / "vcuda.sock"), pod_uid=uid, container_id=cid, timeout=10)
            cfg = decode_vcuda_config((pod_dir / cid / "vcuda.config").read_bytes())
            say(f"    wrote {pod_dir / cid / 'vcuda.config'} (8240 bytes):")
        say(f"    utilization={cfg.utilization} gpu_memory={cfg.gpu_memory // MIB} MiB hard_limit={cfg.hard_limit}"
            f" enable={cfg.enable} container_name={cfg.container_name}")

        say("\n4. Deleting the pod: the watchdog sees it go and its GPU shares are recycled at once", bold=True)
        await client.delete(KubePod, name="demo-train", namespace="default")
        await printer.wait_for("alloc.released", 2, 20)
        await _show_gpus(bus, settings.request_timeout)
        gone = await _wait(lambda: _exists(pod_dir), lambda e: not e, 10, "vm dir removal")
        say(f"    {pod_dir} removed: {not gone}")

        say("\n5. A new pod gets the recycled share", bold=True)
        await client.create(KubePod.from_dict(NEXT_POD))
        nxt = await _pod(client, "demo-next", "Running", 60 if runtime else 30)
        if nxt.status.phase != "Running":
            raise click.ClickException(f"demo-next was not admitted: {nxt.status.message}")
        await printer.wait_for("alloc.granted", 3, 10)
        await _show_gpus(bus, settings.request_timeout)
        say("\nDemo complete.", bold=True, fg="green")
    finally:
        await http.close()
        await client.close()
        await bus.close()


async def _exists(path: Path) -> bool:
    return path.exists()


@dataclass(frozen=True)
class DemoNode:
    """Where ``up --demo`` runs: its own state directory and a node simulator serving ``api_url``."""

    settings: Settings  # the agent's settings, pointed at the scratch directory and the simulator
    directory: Path
    api_url: str
    runtime: DemoRuntime | None = None  # real containers through containerd, when the machine allows it

    @classmethod
    def prepare(cls, settings: Settings, runtime: DemoRuntime | None = None) -> DemoNode:
        directory = Path(settings.state_dir) / "demo"
        shutil.rmtree(directory, ignore_errors=True)  # our own scratch area: every demo starts clean
        directory.mkdir(parents=True)
        settings = settings.replace(
            node_name="demo-node", state_dir=str(directory), vm_dir="", vdriver_dir="",
            device_plugin_dir=str(directory / "device-plugins"),
            pod_resources_socket=str(directory / "pod-resources" / "kubelet.sock"),
            kubeconfig=str(directory / "kubeconfig"),
            proc_root=str(directory / "proc"), cgroup_root=str(directory / "cgroup"),  # simulated containers
        )
        if runtime is not None:
            settings = runtime.settings(settings)  # real containers: the host's /proc and cgroups
        return cls(settings=settings, directory=directory, api_url=f"http://127.0.0.1:{_free_port()}",
                   runtime=runtime)

    @property
    def log_dir(self) -> Path:
        return self.directory / "logs"

    async def start_simulator(self, launcher: Launcher) -> None:
        settings = self.settings
        click.secho(f"gpuledger demo: state, sockets and logs under {self.directory}", bold=True)
        await launcher.start_child("sim", [
            "sim", "--node-name", settings.node_name, "--device-plugin-dir", settings.device_plugin_dir,
            "--pod-resources-socket", settings.pod_resources_socket, "--api-port", self.api_url.rsplit(":", 1)[1],
            "--kubeconfig-out", settings.kubeconfig, *(self.runtime.sim_args() if self.runtime else []),
        ])
        await _wait_file(Path(settings.kubeconfig), 30)

    async def walk_through(self, launcher: Launcher, stop: asyncio.Event, *, exit_after: bool) -> int | None:
        """Run the demo until it ends or ``stop`` is set: the exit code when ``up`` should end now,
        None when the agent keeps running (until ``stop``)."""
        task = asyncio.create_task(run_demo(launcher.settings, self.api_url, Path(self.settings.kubeconfig),
                                            runtime=self.runtime))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not task.done():
            task.cancel()
        elif task.exception() is not None:
            click.secho(f"demo failed: {task.exception()}", fg="red", err=True)
            click.secho(f"service logs: {self.log_dir}", err=True)
            return 1
        if exit_after or stop.is_set():
            return 0
        cli = command_name()
        activate = "" if cli == "gpuledger" else (
            f"(or `. {Path(cli).parent / 'activate'}` first, then plain `gpuledger ...`)\n")
        click.secho(
            f"\nThe agent keeps running. In another terminal, from this directory:\n"
            f"  {cli} status --state-dir {self.directory}\n"
            f"  {cli} events --state-dir {self.directory}\n"
            f"  {cli} replay --state-dir {self.directory}\n"
            f"{activate}"
            f"Press Ctrl-C to stop.", bold=True)
        return None


def command_name() -> str:
    """How to call this gpuledger from the current directory: plain ``gpuledger`` when that is the one on
    the PATH, else the script next to this interpreter (``.venv/bin/gpuledger`` after ``make demo``)."""
    script = Path(sys.executable).parent / "gpuledger"
    on_path = shutil.which("gpuledger")
    if on_path and Path(on_path).resolve() == script.resolve():
        return "gpuledger"
    if not script.exists():
        return f"{sys.executable} -m gpuledger"
    try:
        relative = Path(os.path.abspath(script)).relative_to(Path.cwd())
    except ValueError:
        return str(script)
    return str(relative) if relative.parent != Path() else f"./{relative}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_file(path: Path, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not path.exists():  # noqa: ASYNC110 (a file written by another process: poll it)
            await asyncio.sleep(0.1)
