"""Settings of one simulated node (`SimConfig`) and the kubelet behaviour profiles."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PROFILE", "LEGACY_PROFILE", "MAIN_PROFILE", "PROFILES", "SimConfig", "check_profile"]

DEFAULT_PROFILE = "1.25-1.36"
LEGACY_PROFILE = "legacy-1.24"
MAIN_PROFILE = "main-2026"
PROFILES = (LEGACY_PROFILE, DEFAULT_PROFILE, MAIN_PROFILE)

# (pod, container name) -> preferred NUMA nodes, or None for "no hint" (topology policy `none`).
NumaHint = Callable[[dict[str, Any], str], "set[int] | None"]


@dataclass
class SimConfig:
    """Everything one `NodeSimulator` needs. Only `device_plugin_dir` is required.

    The kubelet has no deadline on GetDevicePluginOptions, GetPreferredAllocation and Allocate; the
    simulator caps them (`options_timeout`, `allocate_timeout`) so that a hung plugin fails a test
    instead of hanging it. Those caps are the only deliberate departures from kubelet timing.
    """

    device_plugin_dir: Path  # kubelet.sock is served here; plugins put their sockets here
    node_name: str = "sim-node"
    pod_resources_socket: Path | None = None  # serve v1.PodResourcesLister there when set
    api_host: str = "127.0.0.1"
    api_port: int = 0  # 0 = pick a free port
    kubeconfig_path: Path | None = None  # write a kubeconfig pointing at the API there when set
    profile: str = DEFAULT_PROFILE
    seed: int | None = None  # seeds resource order and device-ID shuffling
    endpoint_grace: float = 300.0  # stopped-endpoint removal grace (kubelet: 5 min)
    allocate_timeout: float = 60.0  # cap on Allocate and GetPreferredAllocation (kubelet: none)
    options_timeout: float = 30.0  # cap on GetDevicePluginOptions during Register (kubelet: none)
    dial_timeout: float = 10.0  # blocking dial of a plugin socket at Register (kubelet: 10 s)
    prestart_timeout: float = 30.0  # PreStartContainer deadline (kubelet: 30 s)
    container_retry_backoff: float = 1.0  # first wait before a failed container start is tried again; 0: never
    bookmark_interval: float = 5.0  # seconds between watch BOOKMARK events when asked for
    watch_history: int = 1000  # watch events kept for resumption by resourceVersion
    deletion_delay: float = 0.0  # time a deleted pod stays "terminating" before it disappears
    write_checkpoint: bool = True  # keep <dir>/kubelet_internal_checkpoint like the kubelet does
    pod_resources_qps: float = 100.0  # PodResources rate limit (kubelet: 100/s, burst 10)
    pod_resources_burst: int = 10
    numa_hint: NumaHint | None = None  # topology-manager hint per container; None = policy "none"
    # Real containers (simulator/runtime): "containerd" starts a private containerd in runtime_dir
    # (a temp dir when None) and creates every admitted pod's containers through CRI.
    runtime: str = "none"
    runtime_dir: Path | None = None
    runtime_images: Path | None = None  # prebuilt image layouts (simulator/runtime/images.py); built when None
    init_container_timeout: float = 120.0  # a real init container must exit within this
    # DRA, the kubelet's half (simulator/dra/watcher.py, manager.py): with a plugins_registry_dir the
    # plugin watcher registers DRA drivers there and pods' claims are prepared before their containers.
    plugins_registry_dir: Path | None = None
    cdi_dir: Path | None = None  # CDI specs the kubelet resolves CDI device IDs from (None: not resolved)
    dra_state_dir: Path | None = None  # where dra_manager_state is kept; None: the device-plugin dir's parent
    dra_timeout: float = 45.0  # NodePrepareResources / NodeUnprepareResources deadline (kubelet: 45 s)

    def __post_init__(self) -> None:
        self.device_plugin_dir = Path(self.device_plugin_dir)
        if self.pod_resources_socket is not None:
            self.pod_resources_socket = Path(self.pod_resources_socket)
        if self.kubeconfig_path is not None:
            self.kubeconfig_path = Path(self.kubeconfig_path)
        for name in ("plugins_registry_dir", "cdi_dir", "dra_state_dir"):
            if getattr(self, name) is not None:
                setattr(self, name, Path(getattr(self, name)))
        if self.runtime not in ("none", "containerd"):
            raise ValueError(f"unknown container runtime {self.runtime!r}; known: none, containerd")


def check_profile(profile: str) -> None:
    """Refuse unknown profiles, so a test never silently runs the wrong kubelet."""
    if profile in PROFILES:
        return
    raise ValueError(f"unknown kubelet profile {profile!r}; known profiles: {', '.join(PROFILES)}")
