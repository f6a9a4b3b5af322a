"""``gpuledger up --demo --runtime containerd``: the demo's pods as real containers.

When the machine allows it (root, containerd, runc, a static busybox and a C compiler: see
``simulator.runtime.runtime_unavailable_reason``), the demo's simulator runs every admitted pod on a
private containerd (``gpuledger sim --runtime containerd``), the agent sees the real ``/proc`` and
cgroup tree, and the fake GPUs are real character devices (``/dev/nvidia<minor>``, major 195, made
here and removed at exit, a reaper process removing them even if ``up`` is killed), so the Allocate
response's device nodes exist for runc. The trainer's registration then happens inside its
container, through the runtime's exec (CRI ``ExecSync``, as ``kubectl exec`` would): the static
``vcuda-register`` client of the container image calls ``RegisterVDevice`` on the mounted
``vcuda.sock`` from the container's own PID namespace, and the container reads its own
``vcuda.config``. Otherwise one line says why, and the demo's containers stay simulated.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click

from libs.config import Settings
from libs.vcuda.config import VcudaConfig
from libs.vcuda.config import decode as decode_vcuda_config

__all__ = ["RUNTIMES", "DemoRuntime", "demo_runtime"]

RUNTIMES = ("none", "containerd")
VCUDA_DIR = "/etc/vcuda"  # where the Allocate response mounts the pod's directory in the container


@dataclass
class DemoRuntime:
    work: Path  # the simulator's containerd: config, root, state and socket (a short path: a unix socket)
    gpu_file: Path  # the fake-GPU file naming the minors of the /dev nodes made for this run

    @property
    def socket(self) -> Path:
        return self.work / "containerd.sock"

    def settings(self, settings: Settings) -> Settings:
        """The agent sees what real containers are: the host's /proc and cgroup tree, our fake GPUs, and
        the runtime itself (the vmanager names registering containers through its CRI)."""
        return settings.replace(proc_root="/proc", cgroup_root="/sys/fs/cgroup", gpus=f"fake:{self.gpu_file}",
                                driver_volumes=False, container_runtime_endpoint=str(self.socket))

    def sim_args(self) -> list[str]:
        return ["--runtime", "containerd", "--runtime-dir", str(self.work)]

    async def register_inside(self, container_id: str, pod_uid: str) -> tuple[str, VcudaConfig]:
        """RegisterVDevice from inside the container, then the container's own read of its
        vcuda.config (``od`` inside it, decoded here); (the client's words, the config)."""
        from simulator.runtime.cri import CriClient

        client = CriClient(self.socket)
        try:
            sock = f"{VCUDA_DIR}/vcuda.sock"
            done = await client.exec_sync(container_id, ["/bin/vcuda-register", sock, pod_uid, container_id], 20)
            said = (done.stdout + done.stderr).decode(errors="replace").strip()
            if done.exit_code != 0:
                raise click.ClickException(f"vcuda-register inside the container failed ({done.exit_code}): {said}")
            path = f"{VCUDA_DIR}/{container_id}/vcuda.config"
            read = await client.exec_sync(container_id, ["od", "-An", "-v", "-tx1", path], 20)
            if read.exit_code != 0:
                raise click.ClickException(f"the container cannot read {path}: {read.stderr.decode(errors='replace')}")
            return said, decode_vcuda_config(bytes(int(b, 16) for b in read.stdout.split()))
        finally:
            await client.close()


@contextlib.contextmanager
def demo_runtime(wanted: str) -> Iterator[DemoRuntime | None]:
    """The real runtime for the demo when ``wanted`` is containerd and the machine allows it; None
    (after one line saying why) otherwise. Fake GPU nodes exist for the length of the block."""
    if wanted != "containerd":
        yield None
        return
    from simulator.runtime import runtime_unavailable_reason

    reason = runtime_unavailable_reason()
    if reason is not None:
        click.secho(f"--runtime containerd: {reason}; the demo's containers stay simulated", fg="yellow", err=True)
        yield None
        return
    from simulator.runtime.fakegpus import fake_gpus_on_host
    from simulator.runtime.hostlock import RuntimeBusy

    root = Path(tempfile.mkdtemp(prefix="gldemo", dir="/tmp"))  # short: containerd's socket lives here
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        try:
            gpus = stack.enter_context(fake_gpus_on_host(root, count=4))
        except RuntimeBusy as exc:
            click.secho(f"--runtime containerd: {exc}; the demo's containers stay simulated", fg="yellow", err=True)
            yield None
            return
        click.secho(f"gpuledger demo: real containers on a private containerd under {root / 'rt'}; "
                    f"fake GPUs {', '.join(gpus.node(i) for i in range(len(gpus.minors)))}", bold=True)
        yield DemoRuntime(work=root / "rt", gpu_file=gpus.profile)
