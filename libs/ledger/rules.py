"""The folding rules both folds of the log apply: ``LedgerState`` (every field, for the allocator) and
the audit fold (``holdings``: narrow views, a million events in under two seconds).

Each rule is stated once, here, so that the two folds cannot drift apart; each fold keeps its own
bookkeeping (the audit fold indexes what it needs instead of scanning, because of its speed goal).

- a correction (``alloc.corrected``) moves a grant to its real owner: it takes the fields in
  ``CORRECTION_MOVES`` from the correction; the cores, the kubelet device IDs and whether the grant is
  charged stay;
- an app container takes over its init container's hold (``takes_over``);
- a GPU's health is the last ``gpu.health`` transition of its UUID, and ``health_reason`` spells why.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

import msgspec

__all__ = ["CORRECTION_MOVES", "HealthTransition", "health_reason", "move_to_real_owner", "takes_over"]

# What an ``alloc.corrected`` moves, as it names them (AllocationCorrected's fields): the real owner
# and its limits. A fold's grant that lacks one of these (the audit views hold no response) moves the
# rest. Not moved: the cores (the kubelet asked for them), the kubelet device IDs, whether it is charged.
CORRECTION_MOVES = (
    "pod_uid", "namespace", "pod_name", "container", "container_index", "init_container", "memory", "shares",
    "core_limit", "response",
)

S = TypeVar("S", bound=msgspec.Struct)


def move_to_real_owner(grant: S, correction: msgspec.Struct) -> S:
    """``grant`` as it stands after ``correction`` (a new value; ``grant`` is left alone)."""
    held = grant.__struct_fields__
    return msgspec.structs.replace(grant, **{f: getattr(correction, f) for f in CORRECTION_MOVES if f in held})


def takes_over(app_device_ids: Iterable[str], init_device_ids: Iterable[str]) -> bool:
    """Whether an app container's grant takes over the hold of a charged init-container grant of the
    same pod: it does when their kubelet device IDs overlap. The init container has run to completion
    by the time the app container starts, so the GPUs are charged once, for the later container."""
    return not set(app_device_ids).isdisjoint(init_device_ids)


class HealthTransition(Protocol):
    """The fields of a ``gpu.health`` event the reason is spelled from (the full event or its view)."""

    @property
    def healthy(self) -> bool: ...

    @property
    def reason(self) -> str: ...

    @property
    def xid(self) -> int: ...


def health_reason(transition: HealthTransition | None) -> str:
    """Why a GPU is unhealthy, as ``GpuUsage.health_reason`` spells it ("" when healthy or never reported)."""
    if transition is None or transition.healthy:
        return ""
    return f"xid {transition.xid}" if transition.reason == "xid" else transition.reason
