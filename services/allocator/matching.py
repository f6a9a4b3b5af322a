"""Which pod and container an Allocate is for.

The kubelet's Allocate carries only device IDs, so, like gpu-manager (gpu-manager-reference.md 3.1),
we pick among the node's pending GPU pods: first a pod that is part-way through admission (the kubelet
admits one pod at a time, container after container), else pods ordered by the scheduler extender's
``tencent.com/predicate-time`` (else creation time); in each, the next container without an
allocation, init containers first as the kubelet walks them, whose vcore limit equals the request.
Unlike gpu-manager, the order is fully deterministic and init containers count.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from libs.errors import ServiceError
from libs.kube.pods import ANNOTATION_GPU_ASSIGNED, Container, Pod, is_active, parse_time_ns, predicate_time
from libs.ledger.state import LedgerState

__all__ = ["Candidate", "candidates", "find_candidate"]


class Candidate(msgspec.Struct, frozen=True):
    pod: Pod
    container: Container
    index: int        # position in spec.initContainers or spec.containers
    init: bool


def _kubelet_order(pod: Pod) -> Iterable[Candidate]:
    for i, c in enumerate(pod.spec.init_containers):
        yield Candidate(pod, c, i, True)
    for i, c in enumerate(pod.spec.containers):
        yield Candidate(pod, c, i, False)


def find_candidate(pods: Iterable[Pod], state: LedgerState, cores: int) -> Candidate | None:
    """The guess: the first of ``candidates``."""
    found = candidates(pods, state, cores)
    return found[0] if found else None


def candidates(pods: Iterable[Pod], state: LedgerState, cores: int) -> list[Candidate]:
    """Every pod's container the request could be for, best guess first; only the pod part-way
    through admission when there is one (the kubelet admits one pod at a time)."""
    out: list[Candidate] = []
    held = {(a.pod_uid, a.container) for a in state.allocations.values()}
    started = {uid for uid, _ in held}
    pending = [
        p for p in pods
        if p.status.phase == "Pending" and is_active(p) and p.wants_gpu
        and p.metadata.annotations.get(ANNOTATION_GPU_ASSIGNED) != "true"
    ]
    pending.sort(key=lambda p: (
        p.uid not in started,            # a pod part-way through admission comes first
        predicate_time(p),
        parse_time_ns(p.metadata.creation_timestamp),
        p.metadata.namespace,
        p.metadata.name,
    ))
    for pod in pending:
        todo = [c for c in _kubelet_order(pod) if c.container.vcore > 0 and (pod.uid, c.container.name) not in held]
        if not todo:
            continue
        if pod.uid in started:
            nxt = todo[0]
            if nxt.container.vcore != cores:
                raise ServiceError(409, (
                    f"allocation request mismatch for pod {pod.key} ({pod.uid}): its next container "
                    f"{nxt.container.name} wants {nxt.container.vcore} vcuda-core, the kubelet asked for {cores}"
                ))
            return [nxt]
        out.extend([c for c in todo if c.container.vcore == cores][:1])
    return out
