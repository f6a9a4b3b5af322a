"""The part of a Kubernetes Pod gpuledger reads, as msgspec Structs with the API's field names.

Decoding a full Pod JSON into ``Pod`` keeps only these fields, so the watchdog can hand pods to the
other services over NATS compactly, and every service reads them the same way.
"""

from __future__ import annotations

import functools
import re
from datetime import datetime

import msgspec

__all__ = [
    "ANNOTATION_CORE_LIMIT",
    "ANNOTATION_GPU_ASSIGNED",
    "ANNOTATION_PREDICATE_IDX",
    "ANNOTATION_PREDICATE_TIME",
    "RESOURCE_VCORE",
    "RESOURCE_VMEMORY",
    "Container",
    "ContainerStatus",
    "Pod",
    "is_active",
    "parse_quantity",
    "parse_time_ns",
    "predicate_time",
    "vcore_device_ids",
]

RESOURCE_VCORE = "tencent.com/vcuda-core"
RESOURCE_VMEMORY = "tencent.com/vcuda-memory"
ANNOTATION_PREDICATE_TIME = "tencent.com/predicate-time"
ANNOTATION_PREDICATE_IDX = "tencent.com/predicate-gpu-idx-"
ANNOTATION_GPU_ASSIGNED = "tencent.com/gpu-assigned"
ANNOTATION_CORE_LIMIT = "tencent.com/vcuda-core-limit"

_QUANTITY = re.compile(r"^([0-9]+)(k|M|G|T|Ki|Mi|Gi|Ti)?$")
_FACTORS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_quantity(value: str | int) -> int:
    """An integer Kubernetes quantity (extended resources must be whole numbers)."""
    if isinstance(value, int):
        return value
    return _parse_text(value)


@functools.lru_cache(maxsize=1024)  # a node's pods spell the same few quantities again and again
def _parse_text(value: str) -> int:
    m = _QUANTITY.match(value.strip())
    if not m:
        raise ValueError(f"not a whole-number quantity: {value!r}")
    return int(m.group(1)) * _FACTORS[m.group(2)]


def vcore_device_ids(count: int) -> tuple[str, ...]:
    """The vcore device IDs of a node that has ``count`` of them (100 per GPU), as gpu-manager names them:
    ``tencent.com/vcuda-core-<i>``."""
    return tuple(f"{RESOURCE_VCORE}-{i}" for i in range(count))


def parse_time_ns(value: str | None) -> int:
    if not value:
        return 0
    return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1e9)


class EnvVar(msgspec.Struct):
    name: str
    value: str = ""


class Resources(msgspec.Struct):
    limits: dict[str, str | int] = {}
    requests: dict[str, str | int] = {}


class Container(msgspec.Struct, rename="camel"):
    name: str
    resources: Resources = msgspec.field(default_factory=Resources)
    env: list[EnvVar] = []
    restart_policy: str | None = None  # "Always" on an init container = a sidecar

    def limit(self, resource: str) -> int:
        raw = self.resources.limits.get(resource)
        return parse_quantity(raw) if raw is not None else 0

    @property
    def vcore(self) -> int:
        return self.limit(RESOURCE_VCORE)

    @property
    def vmemory(self) -> int:
        return self.limit(RESOURCE_VMEMORY)

    def env_value(self, name: str) -> str | None:
        for var in self.env:
            if var.name == name:
                return var.value
        return None

    @property
    def compat32(self) -> bool:
        """gpu-manager's ``compat32`` env: the container's driver libraries are the 32-bit ones."""
        return (self.env_value("compat32") or "").lower() == "true"


class OwnerReference(msgspec.Struct, rename="camel"):
    kind: str = ""
    name: str = ""
    uid: str = ""
    controller: bool = False


class ObjectMeta(msgspec.Struct, rename="camel"):
    name: str = ""
    namespace: str = "default"
    uid: str = ""
    resource_version: str = ""
    creation_timestamp: str | None = None
    deletion_timestamp: str | None = None
    annotations: dict[str, str] = {}
    labels: dict[str, str] = {}
    owner_references: list[OwnerReference] = []


class PodResourceClaim(msgspec.Struct, rename="camel"):
    """``spec.resourceClaims[]``: a claim by name, or one the control plane makes from a template."""

    name: str = ""
    resource_claim_name: str | None = None
    resource_claim_template_name: str | None = None


class PodResourceClaimStatus(msgspec.Struct, rename="camel"):
    """``status.resourceClaimStatuses[]``: the ResourceClaim made for a template entry."""

    name: str = ""
    resource_claim_name: str | None = None


class PodSpec(msgspec.Struct, rename="camel"):
    node_name: str = ""
    containers: list[Container] = []
    init_containers: list[Container] = []
    resource_claims: list[PodResourceClaim] = []


class ContainerStatus(msgspec.Struct, rename="camel"):
    name: str
    container_id: str = msgspec.field(default="", name="containerID")
    ready: bool = False
    restart_count: int = 0
    state: dict[str, dict[str, object]] = {}

    @property
    def runtime_id(self) -> str:
        """The bare container id, without the ``containerd://`` style runtime prefix."""
        return self.container_id.split("://", 1)[-1]


class PodStatus(msgspec.Struct, rename="camel"):
    phase: str = "Pending"
    reason: str = ""
    message: str = ""
    qos_class: str = ""
    container_statuses: list[ContainerStatus] = []
    init_container_statuses: list[ContainerStatus] = []
    resource_claim_statuses: list[PodResourceClaimStatus] = []


class Pod(msgspec.Struct):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PodSpec = msgspec.field(default_factory=PodSpec)
    status: PodStatus = msgspec.field(default_factory=PodStatus)

    @property
    def uid(self) -> str:
        return self.metadata.uid

    @property
    def key(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"

    @property
    def wants_gpu(self) -> bool:
        """Some container, init containers included, asks for tencent.com/vcuda-core."""
        return any(c.vcore > 0 for c in (*self.spec.init_containers, *self.spec.containers))

    def all_statuses(self) -> list[ContainerStatus]:
        return [*self.status.init_container_statuses, *self.status.container_statuses]

    def claim_names(self) -> set[str]:
        """The ResourceClaims (in the pod's namespace) the pod uses: named ones, and those made for its
        template entries."""
        named = {c.resource_claim_name for c in self.spec.resource_claims if c.resource_claim_name}
        made = {s.resource_claim_name for s in self.status.resource_claim_statuses if s.resource_claim_name}
        return named | made


def is_active(pod: Pod) -> bool:
    """gpu-manager's "active" (gpu-manager-reference.md 4.1): not terminated.

    Terminated = phase Failed or Succeeded, or being deleted with every container stopped (all
    statuses terminated or waiting, or no statuses at all).
    """
    if pod.status.phase in ("Failed", "Succeeded"):
        return False
    if pod.metadata.deletion_timestamp:
        statuses = pod.all_statuses()
        if not statuses or all("running" not in s.state for s in statuses):
            return False
    return True


def predicate_time(pod: Pod) -> int:
    """The scheduler extender's decision time, else the creation time, in ns (the candidate order)."""
    raw = pod.metadata.annotations.get(ANNOTATION_PREDICATE_TIME)
    if raw is not None:
        try:
            return int(raw)
        except ValueError:
            pass
    return parse_time_ns(pod.metadata.creation_timestamp)
