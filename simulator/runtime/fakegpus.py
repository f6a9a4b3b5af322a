"""Fake GPUs a real container can be handed: ``/dev/nvidia<minor>`` character devices (major 195,
minors no real GPU uses here), ``/dev/nvidiactl`` and a stand-in ``/dev/nvidia-uvm`` when absent, and
the fake-GPU file (``gpus: fake:<file>``) naming those minors, so the agent's Allocate responses list
device nodes that exist and runc can put them into the container and its device cgroup.

Every node made is written down in the run's ``Leftovers`` before it is made, so ``clean()`` (or the
reaper, when the process is killed) removes it; ``fake_gpus_on_host()`` does all of that around a block.
Used by the real-runtime tests, ``bench.pod_start`` and ``gpuledger up --demo --runtime containerd``.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import hostlock
from .leftovers import Leftovers, clean, start_reaper, stop_reaper, survivors

__all__ = ["CTL_MINOR", "NVIDIA_MAJOR", "UVM_MINOR", "FakeGpus", "fake_gpus_on_host", "make_fake_gpus",
           "remove_fake_gpus"]

NVIDIA_MAJOR = 195
CTL_MINOR = 255  # /dev/nvidiactl
UVM_MINOR = 254  # our stand-in /dev/nvidia-uvm (the real one has a dynamic major)


@dataclass
class FakeGpus:
    """``count`` GPUs whose minors have no /dev node yet; the nodes made here, and the fake file."""

    minors: list[int]
    profile: Path
    leftovers: Leftovers
    made: list[str] = field(default_factory=list)

    def node(self, index: int) -> str:
        return f"/dev/nvidia{self.minors[index]}"


def _mknod(path: str, minor: int, lo: Leftovers) -> bool:
    """A character device 195:minor, mode 0666 (chmod: mknod's mode goes through the umask)."""
    if os.path.lexists(path):
        return False
    lo.add_dev_node(path)  # written down first: the reaper removes it if this process dies
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, minor))
    os.chmod(path, 0o666)
    return True


def make_fake_gpus(root: Path, lo: Leftovers, count: int = 4, *, name: str = "Tesla T4",
                   memory: str = "16GiB") -> FakeGpus:
    """``count`` fake GPUs on free minors; their file is ``root/gpus.yaml``."""
    minors = [m for m in range(0, 250) if not os.path.lexists(f"/dev/nvidia{m}")][:count]
    if len(minors) < count:
        raise RuntimeError(f"only {len(minors)} free /dev/nvidia minors below 250, {count} wanted")
    gpus = FakeGpus(minors, root / "gpus.yaml", lo)
    lines = ["profile: rt-test", 'driver_version: "535.104.05"', f"name: {name}", f"memory: {memory}", "gpus:"]
    lines += [f"  - {{minor: {m}}}" for m in minors]
    gpus.profile.write_text("\n".join(lines) + "\n")
    for path, minor in [*((f"/dev/nvidia{m}", m) for m in minors), ("/dev/nvidiactl", CTL_MINOR),
                        ("/dev/nvidia-uvm", UVM_MINOR)]:
        if _mknod(path, minor, lo):
            gpus.made.append(path)
    return gpus


def remove_fake_gpus(gpus: FakeGpus) -> None:
    for path in gpus.made:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def fake_gpus_on_host(root: Path, count: int = 4, **kwargs: str) -> Iterator[FakeGpus]:
    """Fake GPUs for the length of the block, with a reaper that removes the nodes even if this
    process is killed; raises RuntimeError naming what survived the cleanup, and hostlock.RuntimeBusy
    when another run holds the host (hostlock.py)."""
    with hostlock.holding():  # /dev/nvidiactl and /dev/nvidia-uvm are shared by every run on the host
        lo = Leftovers(root / "devnodes.json", work="", remove_work=False)
        lo.save()
        reaper = start_reaper(lo)
        try:
            yield make_fake_gpus(root, lo, count, **kwargs)
        finally:
            clean(lo)
            stop_reaper(reaper)
        left = survivors(lo)
    if left:
        raise RuntimeError(f"fake GPU nodes survived the cleanup: {left}")
