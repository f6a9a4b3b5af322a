"""Settings shared by every process, built once by the CLI (flag > environment > config file > default).

Every path and endpoint the agent touches is here, so that it runs without root and against any
kubelet directory or API server. The CLI gives each one a flag, a ``GPULEDGER_<FIELD>`` variable and a
key in the ``--config`` YAML file (the field name; dashes or underscores).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import msgspec

from libs.dra import DRIVER_NAME

__all__ = ["Settings", "default_state_dir", "parse_node_labels", "parse_xids"]

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
    # Kubernetes integration: gpu-manager's --node-labels and --allocation-check-period
    node_labels: str = ""   # k=v,k2=v2: labels the watchdog keeps on the node (plus the GPU model label)
    allocation_check_period: float = 30.0  # seconds between reconciliations (allocations vs pods)
    # Observability: metrics, status view and GPU health
    metrics_port: int = 0                # base port: allocator +0, registrar +1, vmanager +2, watchdog +3; 0 = off
    metrics_host: str = "127.0.0.1"      # loopback; the DaemonSet sets the pod address Prometheus scrapes
    usage_interval: float = 5.0          # seconds between background NVML usage samples (never per scrape)
    health_checks: bool = True           # watch XID/ECC events and mark GPUs unhealthy
    health_ignored_xids: str = "13,31,43,45,68,109"  # application-caused XIDs that say nothing of the GPU
    health_recovery_seconds: float = 60.0  # an unhealthy GPU needs this long without a critical event...
    health_recovery_checks: int = 3        # ...and this many clean NVML probes in a row to be healthy again
    health_check_interval: float = 10.0    # seconds between probes of unhealthy GPUs
    # Limit delivery (vcuda | hami-core), pid discovery, caller checks, driver volumes
    limit_delivery: str = "vcuda"            # vcuda: gpu-manager's vcuda.config; hami-core: HAMi-core's env
    cgroup_root: str = "/sys/fs/cgroup"      # where the host's cgroup hierarchies are mounted
    proc_root: str = "/proc"                 # the host's /proc (the vmanager runs with hostPID)
    # CRI runtime socket (a path or unix://PATH): the vmanager asks it (ContainerStatus) which container
    # a registering id is, as gpu-manager did; empty, or no answer in time: the pod's status via the watchdog
    container_runtime_endpoint: str = ""
    hami_library: str = "/usr/local/vgpu/libvgpu.so"  # host path of HAMi-core's libvgpu.so
    hami_mount_dir: str = "/usr/local/vgpu"  # HAMi's <hookPath>/vgpu inside the container
    hami_lock_dir: str = "/tmp/vgpulock"     # host-wide lock directory HAMi-core expects, same in container
    ld_cache: str = "/etc/ld.so.cache"       # where the driver volumes find the host's NVIDIA libraries
    driver_bin_dirs: str = "/usr/bin:/usr/local/bin:/usr/local/nvidia/bin"  # NVIDIA binaries, ':'-separated
    vcuda_control_library: str = ""          # libcuda-control.so; empty: found through ld.so.cache
    driver_volumes: bool = True              # build <vdriver>/nvidia and origin at vmanager start
    # Pod identity: grants are checked against the kubelet's pod-resources at PreStartContainer and every
    # identity_check_period seconds (0: only at PreStartContainer); extra_config is gpu-manager's
    # --extra-config JSON, whose "default" devices go into every Allocate response
    identity_check_period: float = 30.0
    extra_config: str = ""
    # Fleet: the node's embedded broker joins the central cluster as a leaf node (empty: a lone node,
    # nothing changes); the credentials file holds the node's user and password there. For the fleet
    # recorder: its database (a SQLAlchemy URL; empty: SQLite at <state_dir>/fleet.sqlite) and when a
    # node that sent nothing counts as silent.
    # DRA driver: which GPUs DRA serves (the rest stay with the device plugin; "" = none, "all", or
    # indexes/UUIDs, comma-separated); the kubelet's plugin directories; where CDI spec files go; the
    # longest a NodePrepareResources may take (well within the kubelet's 45 s)
    dra_gpus: str = ""
    kubelet_plugins_dir: str = "/var/lib/kubelet/plugins"
    plugins_registry_dir: str = "/var/lib/kubelet/plugins_registry"
    cdi_dir: str = "/var/run/cdi"
    dra_prepare_timeout: float = 20.0
    fleet_url: str = ""
    fleet_credentials: str = ""
    fleet_db: str = ""
    fleet_silent_after: float = 600.0
    # Outside witness: the node signs a checkpoint of its log's Merkle tree (origin gpuledger/<cluster>/<node>)
    # every checkpoint_every events or checkpoint_interval seconds and asks the witness to cosign it;
    # checkpoint_every 0 turns the checkpointer off
    cluster_name: str = "default"
    checkpoint_every: int = 1000
    checkpoint_interval: float = 60.0
    # Bounded log growth: keep this many events in the live log; the allocator moves older ones into
    # compressed archive segments (libs/store/archive.py) as it goes. 0: never archive by itself.
    log_retention_events: int = 0

    def __post_init__(self) -> None:
        if not self.node_name:
            raise msgspec.ValidationError("node_name must not be empty")
        if not self.cluster_name or "+" in self.cluster_name or any(c.isspace() for c in self.cluster_name):
            raise msgspec.ValidationError(f"cluster_name must be non-empty, without spaces or '+': "
                                          f"{self.cluster_name!r}")
        if self.limit_delivery not in LIMIT_DELIVERIES:
            raise msgspec.ValidationError(
                f"limit_delivery must be one of {', '.join(LIMIT_DELIVERIES)}, not {self.limit_delivery!r}")
        if self.allocate_timeout <= 0 or self.request_timeout <= 0:
            raise msgspec.ValidationError("timeouts must be positive")
        if self.runtime_socket is not None and not self.runtime_socket.is_absolute():
            raise msgspec.ValidationError(
                f"container_runtime_endpoint must be an absolute socket path or unix:///PATH, "
                f"not {self.container_runtime_endpoint!r}")
        if self.allocation_check_period <= 0:
            raise msgspec.ValidationError("allocation_check_period must be positive")
        try:
            parse_node_labels(self.node_labels)
        except ValueError as exc:
            raise msgspec.ValidationError(str(exc)) from exc
        if not 0 <= self.metrics_port <= 65532:
            raise msgspec.ValidationError("metrics_port must be 0 (off) or a port with 3 free ports after it")
        if self.usage_interval <= 0 or self.health_check_interval <= 0 or self.health_recovery_seconds < 0:
            raise msgspec.ValidationError("usage_interval and health_check_interval must be positive")
        if self.health_recovery_checks < 1:
            raise msgspec.ValidationError("health_recovery_checks must be at least 1")
        try:
            parse_xids(self.health_ignored_xids)
        except ValueError as exc:
            raise msgspec.ValidationError(str(exc)) from None
        if self.fleet_url and not self.fleet_credentials:
            raise msgspec.ValidationError("fleet_url needs fleet_credentials (the node's user in the central cluster)")
        if self.fleet_silent_after <= 0:
            raise msgspec.ValidationError("fleet_silent_after must be positive")
        if not 0 < self.dra_prepare_timeout < 45:
            raise msgspec.ValidationError("dra_prepare_timeout must be between 0 and the kubelet's 45 s")
        if self.identity_check_period < 0:
            raise msgspec.ValidationError("identity_check_period must not be negative")
        if self.log_retention_events < 0:
            raise msgspec.ValidationError("log_retention_events must be 0 (keep everything live) or positive")

    @property
    def log_path(self) -> Path:
        return Path(self.state_dir) / "ledger.sqlite"

    @property
    def fleet_db_url(self) -> str:
        return self.fleet_db or f"sqlite:///{Path(self.state_dir) / 'fleet.sqlite'}"

    @property
    def vm_root(self) -> Path:
        return Path(self.vm_dir or Path(self.state_dir) / "vm")

    @property
    def dra_plugin_socket(self) -> Path:
        """The DRA service's socket: ``<kubelet plugins dir>/<driver>/dra.sock``."""
        return Path(self.kubelet_plugins_dir) / DRIVER_NAME / "dra.sock"

    @property
    def dra_registration_socket(self) -> Path:
        """The plugin-watcher socket: ``<plugins_registry>/<driver>-reg.sock``."""
        return Path(self.plugins_registry_dir) / f"{DRIVER_NAME}-reg.sock"

    @property
    def vdriver_root(self) -> Path:
        return Path(self.vdriver_dir or Path(self.state_dir) / "vdriver")

    @property
    def node_label_map(self) -> dict[str, str]:
        return parse_node_labels(self.node_labels)

    @property
    def runtime_socket(self) -> Path | None:
        """The CRI runtime's unix socket from ``container_runtime_endpoint`` (``unix://`` taken off);
        None when no endpoint is set."""
        endpoint = self.container_runtime_endpoint
        return Path(endpoint.removeprefix("unix://")) if endpoint else None

    @property
    def hami_preload(self) -> Path:
        """The ld.so.preload file the vmanager writes for hami-core mode (mounted at /etc/ld.so.preload)."""
        return self.vdriver_root / "hami" / "ld.so.preload"

    def replace(self, **changes: object) -> Settings:
        return msgspec.structs.replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """``GPULEDGER_<FIELD>`` for every field: the environment that rebuilds these Settings."""
        out = {}
        for name in self.__struct_fields__:
            value = getattr(self, name)
            out[f"GPULEDGER_{name.upper()}"] = ("true" if value else "false") if isinstance(value, bool) else str(value)
        return out


_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def parse_node_labels(spec: str) -> dict[str, str]:
    """gpu-manager's ``--node-labels`` syntax, ``k=v,k2=v2``; a malformed item is an error (gpu-manager
    only logged it). Keys and values must be valid Kubernetes label keys and values."""
    labels: dict[str, str] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise ValueError(f"node label {item!r} is not key=value")
        prefix, slash, name = key.rpartition("/")
        if not _LABEL_NAME.match(name) or (slash and not _LABEL_PREFIX.match(prefix)):
            raise ValueError(f"node label key {key!r} is not a valid Kubernetes label key")
        if value and not _LABEL_NAME.match(value):
            raise ValueError(f"node label value {value!r} (key {key!r}) is not a valid Kubernetes label value")
        labels[key] = value
    return labels


def parse_xids(text: str) -> frozenset[int]:
    """``"13, 31,43"`` -> {13, 31, 43}; an empty text ignores nothing. ValueError names a bad entry.

    Here, not in libs.gpu.health which uses it: validating the settings must not import the GPU package
    (NVML, the fake profiles' YAML: about 2 MB in the services that read no GPU)."""
    out = set()
    for part in text.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"XID list: {part!r} is not a number (write e.g. 13,31,43)") from None
        if value < 0:
            raise ValueError(f"XID list: {value} is negative")
        out.add(value)
    return frozenset(out)
