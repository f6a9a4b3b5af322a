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
    # issue 3: grants are checked against the kubelet's pod-resources at PreStartContainer and every
    # identity_check_period seconds (0: only at PreStartContainer); extra_config is gpu-manager's
    # --extra-config JSON, whose "default" devices go into every Allocate response
    identity_check_period: float = 30.0
    extra_config: str = ""

    def __post_init__(self) -> None:
        if not self.node_name:
            raise msgspec.ValidationError("node_name must not be empty")
        if self.allocate_timeout <= 0 or self.request_timeout <= 0:
            raise msgspec.ValidationError("timeouts must be positive")
        if self.identity_check_period < 0:
            raise msgspec.ValidationError("identity_check_period must not be negative")

    @property
    def log_path(self) -> Path:
        return Path(self.state_dir) / "ledger.sqlite"

    @property
    def vm_root(self) -> Path:
        return Path(self.vm_dir or Path(self.state_dir) / "vm")

    @property
    def vdriver_root(self) -> Path:
        return Path(self.vdriver_dir or Path(self.state_dir) / "vdriver")

    def replace(self, **changes: object) -> Settings:
        return msgspec.structs.replace(self, **changes)
