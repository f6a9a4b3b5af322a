"""The annotations a GPU pod should carry, given its allocations (gpu-manager-reference.md 3.3).

One rule, used by the allocator (which writes them after Allocate, a correction and PreStartContainer)
and by the watchdog (which repairs a running pod whose annotations disagree). Two rules that differ
in any detail would patch the same pod back and forth forever, so both call this one.

- ``tencent.com/predicate-gpu-idx-<i>``: ``<i>`` is the container's index in ``spec.containers``; the
  value is its GPUs in the extender's numbering (``extender_indexes``: the minor numbers, not ledger
  indexes, on a node without DRA GPUs), comma-joined in the grant's order. Init
  containers carry none; a container holding several grants (never in practice) lists each minor
  once, oldest grant first. Grants without a known container index (``alloc.imported``, index -1)
  carry none either, as gpu-manager skips containers missing from its cache.
- ``tencent.com/gpu-assigned``: ``"false"`` after Allocate, ``"true"`` once PreStartContainer
  succeeded, which for any pod in phase Running it has.
- A pod holding nothing should carry nothing: the empty mapping.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from libs.kube.pods import ANNOTATION_GPU_ASSIGNED, ANNOTATION_PREDICATE_IDX
from libs.ledger.state import MODE_DRA, Allocation, GpuUsage

__all__ = ["disagreeing", "extender_indexes", "ready_annotations", "started"]


def extender_indexes(gpus: Iterable[GpuUsage]) -> dict[int, int]:
    """GPU minor -> the scheduler extender's number for that GPU.

    gpu-admission knows a node's GPUs only from its advertised capacity (``tencent.com/vcuda-core`` / 100,
    memory split evenly) and numbers them 0..n-1; gpu-manager reads that number as a minor, which holds
    on a node whose minors are 0..n-1. The registrar advertises only the device-plugin GPUs, so with GPUs
    in DRA mode the extender's GPU i is the i-th device-plugin GPU in minor order, and the DRA GPUs have
    no number at all: the extender can never offer them to a device-plugin pod. Without DRA GPUs (and
    minors 0..n-1) every GPU's number is its minor, as under gpu-manager."""
    return {minor: i for i, minor in enumerate(sorted(g.minor for g in gpus if g.mode != MODE_DRA))}


def ready_annotations(allocations: Iterable[Allocation], *, assigned: bool,
                      indexes: Mapping[int, int] | None = None) -> dict[str, str]:
    """gpu-manager's getReadyAnnotations(pod, assigned) computed from the ledger's grants; ``indexes``
    is ``extender_indexes`` of the node's GPUs (None: the minors themselves)."""
    held = sorted(allocations, key=lambda a: (a.container_index, a.granted_seq))
    if not held:
        return {}
    minors: dict[int, list[str]] = {}
    for alloc in held:
        if alloc.init_container or alloc.container_index < 0:
            continue
        listed = minors.setdefault(alloc.container_index, [])
        numbers = (str(indexes.get(s.minor, s.minor) if indexes is not None else s.minor) for s in alloc.shares)
        listed.extend(m for m in numbers if m not in listed)
    out = {f"{ANNOTATION_PREDICATE_IDX}{i}": ",".join(m) for i, m in sorted(minors.items()) if m}
    out[ANNOTATION_GPU_ASSIGNED] = "true" if assigned else "false"
    return out


def started(phase: str) -> bool:
    """Whether a pod in this phase has passed PreStartContainer (its gpu-assigned is ``"true"``)."""
    return phase == "Running"


def disagreeing(have: Mapping[str, str], wanted: Mapping[str, str]) -> dict[str, str]:
    """The wanted annotations that are missing from ``have`` or differ there."""
    return {k: v for k, v in wanted.items() if have.get(k) != v}
