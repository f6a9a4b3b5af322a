"""Which strings may become path components under the vm root (pod UIDs, container ids and names).

Every name that reaches the file system comes from a request (NATS or a container's gRPC call), so
each is checked against the exact form Kubernetes and the runtimes produce; nothing else is a path.
"""

from __future__ import annotations

import re

__all__ = ["is_container_id", "is_container_name", "is_pod_uid"]

# Canonical 8-4-4-4-12 hex (Kubernetes writes lowercase; either case is accepted).
_POD_UID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
# containerd / CRI-O ids are 64 hex; allow what runtimes may use, never '/' or a leading '.'.
_CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# Kubernetes container names are DNS-1123 labels.
_CONTAINER_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


# fullmatch, not match with '$': '$' would accept a trailing newline.
def is_pod_uid(value: str) -> bool:
    return _POD_UID.fullmatch(value) is not None


def is_container_id(value: str) -> bool:
    return _CONTAINER_ID.fullmatch(value) is not None


def is_container_name(value: str) -> bool:
    return _CONTAINER_NAME.fullmatch(value) is not None
