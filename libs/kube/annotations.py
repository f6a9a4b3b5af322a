"""The annotations a GPU pod should carry, given its allocations (gpu-manager-reference.md 3.3).

One rule, used by the allocator (which writes them after Allocate, a correction and PreStartContainer)
and by the watchdog (which repairs a running pod whose annotations disagree). Two rules that differ
in any detail would patch the same pod back and forth forever, so both call this one.

- ``tencent.com/predicate-gpu-idx-<i>``: ``<i>`` is the container's index in ``spec.containers``; the
  value is its GPUs' minor numbers (not ledger indexes), comma-joined in the grant's order. Init
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
from libs.ledger.state import Allocation

__all__ = ["disagreeing", "ready_annotations", "started"]


def ready_annotations(allocations: Iterable[Allocation], *, assigned: bool) -> dict[str, str]:
    """gpu-manager's getReadyAnnotations(pod, assigned) computed from the ledger's grants."""
    held = sorted(allocations, key=lambda a: (a.container_index, a.granted_seq))
    if not held:
        return {}
    minors: dict[int, list[str]] = {}
    for alloc in held:
        if alloc.init_container or alloc.container_index < 0:
            continue
        listed = minors.setdefault(alloc.container_index, [])
        listed.extend(m for m in (str(s.minor) for s in alloc.shares) if m not in listed)
    out = {f"{ANNOTATION_PREDICATE_IDX}{i}": ",".join(m) for i, m in sorted(minors.items()) if m}
    out[ANNOTATION_GPU_ASSIGNED] = "true" if assigned else "false"
    return out


def started(phase: str) -> bool:
    """Whether a pod in this phase has passed PreStartContainer (its gpu-assigned is ``"true"``)."""
    return phase == "Running"


def disagreeing(have: Mapping[str, str], wanted: Mapping[str, str]) -> dict[str, str]:
    """The wanted annotations that are missing from ``have`` or differ there."""
    return {k: v for k, v in wanted.items() if have.get(k) != v}
