"""The inter-service contract: event types, their encoding, and NATS subject names."""

from libs.events.codec import EventRecord, StoredEvent, from_record, register_upcaster, to_record
from libs.events.schema import (
    EVENT_TYPES,
    AllocationCorrected,
    AllocationGranted,
    AllocationImported,
    AllocationRefused,
    AllocationReleased,
    AnyEvent,
    ContainerResponse,
    DeviceNode,
    Event,
    GpuHealthChanged,
    GpuInfo,
    GpuShare,
    InventoryRecorded,
    MountSpec,
)
from libs.events.subjects import Subjects, escape_token, unescape_token

__all__ = [
    "EVENT_TYPES",
    "AllocationCorrected",
    "AllocationGranted",
    "AllocationImported",
    "AllocationRefused",
    "AllocationReleased",
    "AnyEvent",
    "ContainerResponse",
    "DeviceNode",
    "Event",
    "EventRecord",
    "GpuHealthChanged",
    "GpuInfo",
    "GpuShare",
    "InventoryRecorded",
    "MountSpec",
    "StoredEvent",
    "Subjects",
    "escape_token",
    "from_record",
    "register_upcaster",
    "to_record",
    "unescape_token",
]
