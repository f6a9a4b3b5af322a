"""A containerd of our own, for one run: its config, root, state dir and socket under the run's work
directory; the CRI plugin on, cgroupfs driver, runc with its own root, overlayfs (native when an
overlay mount is refused here), the sandbox image ours, no CNI (pods are host-network).

``Containerd(work).start()`` probes the snapshotter, writes the config, starts containerd as a plain
background process (its own session), waits for the socket, and imports our locally built images
with ``ctr images import``: no pull, ever. ``stop()`` removes everything it made, through
``leftovers.clean``, and a reaper process does the same if this process dies first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from ..logger import logger
from . import hostlock
from .images import PAUSE_IMAGE, BuiltImages, ImageBuildError, build_images, find_static_busybox
from .leftovers import RUN_CONTAINERD, Leftovers, clean, start_reaper, stop_reaper, survivors

__all__ = ["Containerd", "RuntimeUnavailable", "runtime_unavailable_reason"]

NAMESPACE = "k8s.io"  # the CRI plugin's containerd namespace
_TOOLS = ("containerd", "ctr", "runc", "containerd-shim-runc-v2")

_logger = logger("containerd")


class RuntimeUnavailable(RuntimeError):
    """This machine cannot run the real runtime (not root, a tool missing ...)."""


def runtime_unavailable_reason() -> str | None:
    """Why containerd cannot run here, or None when it can."""
    if os.name != "posix" or not Path("/proc/self/mountinfo").exists():
        return "not a Linux host"
    if os.geteuid() != 0:
        return "not root (containerd and runc need root)"
    missing = [t for t in _TOOLS if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install containerd runc busybox-static)"
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        return "no C compiler for the pause and client programs (apt-get install gcc libc6-dev)"
    try:
        find_static_busybox()
    except ImageBuildError as err:
        return str(err)
    if not os.access("/sys/fs/cgroup", os.W_OK):
        return "/sys/fs/cgroup is not writable"
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _has_cap_sys_resource() -> bool:
    """Without CAP_SYS_RESOURCE (some sandboxed hosts drop it even for root) runc cannot lower
    oom_score_adj (the sandbox gets -998) and fails with "can't get final child's PID from pipe";
    containerd's restrict_oom_score_adj then clamps the value to its own."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return True


def _config(work: Path, socket: Path, snapshotter: str) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{work}/root"
state = "{work}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{work}/opt"

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  disable_apparmor = true
  enable_selinux = false
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  max_container_log_line_size = 16384
  restrict_oom_score_adj = {"false" if _has_cap_sys_resource() else "true"}

[{cri}.containerd]
  snapshotter = "{snapshotter}"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{work}/state/runc"

[{cri}.cni]
  bin_dir = "{work}/cni/bin"
  conf_dir = "{work}/cni/conf"
"""


def probe_overlay(work: Path) -> bool:
    """Can an overlay be mounted here (in the work dir)? Unmounted again at once."""
    base = work / "overlay-probe"
    dirs = [base / d for d in ("lower", "upper", "work", "merged")]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    lower, upper, wdir, merged = dirs
    done = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lower},upperdir={upper},workdir={wdir}",
         str(merged)], capture_output=True, timeout=10)
    if done.returncode == 0:
        subprocess.run(["umount", str(merged)], capture_output=True, timeout=10)
    shutil.rmtree(base, ignore_errors=True)
    return done.returncode == 0


class Containerd:
    """One private containerd. ``images``: prebuilt layouts (built into the work dir when None)."""

    def __init__(self, work: Path, images: BuiltImages | None = None, *, snapshotter: str | None = None,
                 remove_work: bool = False) -> None:
        self.work = Path(work)
        self.socket = self.work / "containerd.sock"
        self.images = images
        self.snapshotter = snapshotter
        self.leftovers = Leftovers(self.work / "leftovers.json", work=str(self.work), socket=str(self.socket),
                                   remove_work=remove_work)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self._log_file: object = None
        self.start_seconds = 0.0
        self._holding = False  # the host's real-runtime lock (hostlock.py), from start to stop

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout: float = 30.0) -> None:
        reason = runtime_unavailable_reason()
        if reason:
            raise RuntimeUnavailable(reason)
        started = time.monotonic()
        if len(str(self.socket)) > 100:
            raise RuntimeUnavailable(f"work dir path too long for a unix socket: {self.socket}")
        try:
            hostlock.take()  # one run per host: runs share /run/containerd and the kubepods cgroups
        except hostlock.RuntimeBusy as exc:
            raise RuntimeUnavailable(str(exc)) from None
        self._holding = True
        try:  # from here on, a failure stops what started and lets go of the host (``stop``)
            self.work.mkdir(parents=True, exist_ok=True)
            self.leftovers.run_containerd_created = not RUN_CONTAINERD.exists()
            self.leftovers.save()
            self._reaper = start_reaper(self.leftovers)
            if self.images is None:
                self.images = build_images(self.work / "images")
            if self.snapshotter is None:
                self.snapshotter = "overlayfs" if probe_overlay(self.work) else "native"
            config = self.work / "containerd.toml"
            config.write_text(_config(self.work, self.socket, self.snapshotter))
            log = (self.work / "containerd.log").open("ab")
            self._log_file = log
            self._proc = subprocess.Popen([_tool("containerd"), "--config", str(config)], stdout=log, stderr=log,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
            self.leftovers.containerd_pid = self._proc.pid
            self.leftovers.save()
            self._wait_ready(started + timeout)
            for tar in (self.images.pause, self.images.busybox):
                self.ctr("images", "import", "--snapshotter", self.snapshotter, str(tar))
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        _logger.info("containerd started", socket=str(self.socket), snapshotter=self.snapshotter,
                  pid=self._proc.pid, seconds=round(self.start_seconds, 3))

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        while True:
            if self._proc.poll() is not None:
                raise RuntimeUnavailable(f"containerd exited with {self._proc.returncode}: {self.log_tail()}")
            if self.socket.exists():
                done = subprocess.run([_tool("ctr"), "-a", str(self.socket), "version"], capture_output=True,
                                      timeout=10)
                if done.returncode == 0:
                    return
            if time.monotonic() > deadline:
                raise RuntimeUnavailable(f"containerd did not answer on {self.socket}: {self.log_tail()}")
            time.sleep(0.05)

    def ctr(self, *args: str, timeout: float = 60.0) -> str:
        done = subprocess.run([_tool("ctr"), "-a", str(self.socket), "-n", NAMESPACE, *args],
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.work / "containerd.log").read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> list[str]:
        """Stop containerd and remove what the run made outside the work dir; return the survivors."""
        clean(self.leftovers)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            self._proc = None
        if self._log_file is not None:
            with contextlib.suppress(OSError):
                self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None
        if self._reaper is not None:
            stop_reaper(self._reaper)
            self._reaper = None
        left = survivors(self.leftovers)
        if left:
            _logger.error("real-runtime leftovers", leftovers=left)
        if self._holding:  # after the cleanup: the next run must not meet what this one made
            self._holding = False
            hostlock.release()
        return left
