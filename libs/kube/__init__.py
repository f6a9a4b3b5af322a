"""Kubernetes-facing pieces shared by the services: the Pod model and, in source.py, the pod source."""

from libs.kube.pods import (
    RESOURCE_VCORE,
    RESOURCE_VMEMORY,
    Container,
    ContainerStatus,
    Pod,
    is_active,
    parse_quantity,
    predicate_time,
)

__all__ = [
    "RESOURCE_VCORE",
    "RESOURCE_VMEMORY",
    "Container",
    "ContainerStatus",
    "Pod",
    "is_active",
    "parse_quantity",
    "predicate_time",
]
