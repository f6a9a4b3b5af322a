"""Walkthrough: ``gpuledger up --demo-exit --runtime containerd``, the demo with real
containers. The trainer registers from inside its container (the runtime's exec runs the image's
vcuda-register against the mounted vcuda.sock) and the walkthrough prints the container's own read
of its vcuda.config; afterwards nothing of the run is left: no containerd or shim, no fake
/dev/nvidia node, no mount, no pod cgroup, no scratch dir."""

from __future__ import annotations

import glob
import re
import subprocess
import sys
from pathlib import Path

from tests.processes import processes_mentioning
from tests.runtime.helpers import mounts_under, pod_cgroup_dirs


def test_demo_runs_its_pods_as_real_containers(short_dir: Path) -> None:
    nodes_before = set(glob.glob("/dev/nvidia*"))
    scratch_before = set(glob.glob("/tmp/gldemo*"))
    run = subprocess.run(
        [sys.executable, "-m", "gpuledger", "up", "--demo-exit", "--runtime", "containerd",
         "--state-dir", str(short_dir / "s")],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    assert "stay simulated" not in run.stderr, run.stderr  # no fall-back on a machine that allows it
    assert "real containers on a private containerd" in out
    assert "Demo complete." in out and "removed: True" in out

    # The registration ran inside the trainer's container, and the container read its own file:
    # the trainer's 50 cores and 4 x 256 MiB, under its own name.
    assert re.search(r"inside container [0-9a-f]{13}: /bin/vcuda-register /etc/vcuda/vcuda.sock", out), out
    assert "the container's own read of /etc/vcuda/" in out
    assert re.search(r"utilization=50 gpu_memory=1024 MiB .* container_name=trainer", out), out

    # Nothing left behind.
    uids = re.findall(r"running \(uid ([0-9a-f-]{36})\)", out)
    assert uids, out
    scratch = sorted(set(glob.glob("/tmp/gldemo*")) - scratch_before)
    assert scratch == [], scratch
    assert set(glob.glob("/dev/nvidia*")) == nodes_before
    assert processes_mentioning("/tmp/gldemo") == []
    assert mounts_under("/tmp/gldemo") == [] and mounts_under(str(short_dir)) == []
    assert [d for uid in uids for d in pod_cgroup_dirs(uid)] == []
