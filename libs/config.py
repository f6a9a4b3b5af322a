"""Settings shared by every process, built once by the CLI (flags > environment > defaults).

Every path and endpoint the agent touches is here, so that it runs without root and against any
kubelet directory or API server. The CLI gives each one a flag and a ``GPULEDGER_*`` variable.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import msgspec

__all__ = ["Settings", "default_state_dir"]

MIB = 1 << 20
MEMORY_BLOCK = 256 * MIB  # one tencent.com/vcuda-memory unit
LIMIT_DELIVERIES = ("vcuda", "hami-core")


def default_state_dir() -> str:
    if os.geteuid() == 0:
        return "/var/lib/gpuledger"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "gpuledger")


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    node_name: str = msgspec.field(default_factory=socket.gethostname)
    state_dir: str = msgspec.field(default_factory=default_state_dir)
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    vm_dir: str = ""        # empty: <state_dir>/vm (mounted in containers at /etc/vcuda/...)
    vdriver_dir: str = ""   # empty: <state_dir>/vdriver (driver volumes nvidia/ and origin/)
    nats_url: str = "nats://127.0.0.1:4222"
    kubeconfig: str = ""    # empty: in-cluster service account, else $KUBECONFIG / ~/.kube/config
    gpus: str = "auto"      # auto | nvml | fake:FILE
    share_mode: bool = True
    allocate_timeout: float = 10.0  # the longest the kubelet waits for an Allocate answer
    request_timeout: float = 5.0    # internal service-to-service requests
    log_format: str = "auto"
    log_level: str = "info"
    # issue 4: limit delivery (vcuda | hami-core), pid discovery, caller checks, driver volumes
    limit_delivery: str = "vcuda"            # vcuda: gpu-manager's vcuda.config; hami-core: HAMi-core's env
    cgroup_root: str = "/sys/fs/cgroup"      # where the host's cgroup hierarchies are mounted
    proc_root: str = "/proc"                 # the host's /proc (the vmanager runs with hostPID)
    hami_library: str = "/usr/local/vgpu/libvgpu.so"  # host path of HAMi-core's libvgpu.so
    hami_mount_dir: str = "/usr/local/vgpu"  # HAMi's <hookPath>/vgpu inside the container
    hami_lock_dir: str = "/tmp/vgpulock"     # host-wide lock directory HAMi-core expects, same in container
    ld_cache: str = "/etc/ld.so.cache"       # where the driver volumes find the host's NVIDIA libraries
    driver_bin_dirs: str = "/usr/bin:/usr/local/bin:/usr/local/nvidia/bin"  # NVIDIA binaries, ':'-separated
    vcuda_control_library: str = ""          # libcuda-control.so; empty: found through ld.so.cache
    driver_volumes: bool = True              # build <vdriver>/nvidia and origin at vmanager start

    def __post_init__(self) -> None:
        if not self.node_name:
            raise msgspec.ValidationError("node_name must not be empty")
        if self.limit_delivery not in LIMIT_DELIVERIES:
            raise msgspec.ValidationError(
                f"limit_delivery must be one of {', '.join(LIMIT_DELIVERIES)}, not {self.limit_delivery!r}")
        if self.allocate_timeout <= 0 or self.request_timeout <= 0:
            raise msgspec.ValidationError("timeouts must be positive")

    @property
    def log_path(self) -> Path:
        return Path(self.state_dir) / "ledger.sqlite"

    @property
    def vm_root(self) -> Path:
        return Path(self.vm_dir or Path(self.state_dir) / "vm")

    @property
    def vdriver_root(self) -> Path:
        return Path(self.vdriver_dir or Path(self.state_dir) / "vdriver")

    @property
    def vcuda_backend_socket(self) -> Path:
        """The vmanager's private gRPC socket behind every pod's vcuda.sock (never mounted anywhere)."""
        return Path(self.state_dir) / "run" / "vcuda-backend.sock"

    @property
    def hami_preload(self) -> Path:
        """The ld.so.preload file the vmanager writes for hami-core mode (mounted at /etc/ld.so.preload)."""
        return self.vdriver_root / "hami" / "ld.so.preload"

    def replace(self, **changes: object) -> Settings:
        return msgspec.structs.replace(self, **changes)
