"""The scheduler extender's annotations (gpu-admission, gpu-manager-reference.md 3.3 and 3.8).

- A pod the extender predicated carries ``predicate-time``, ``gpu-assigned=false`` and, per app
  container ``i``, ``predicate-gpu-idx-<i>`` (GPU minors). In share mode the allocator checks the
  container's GPU against it with gpu-manager's error text. Unlike gpu-manager, which only compares
  its own pick with the extender's and refuses on any difference, the extender's GPU is used when
  the share fits there: the scheduler and the node then agree by construction.
- The allocator writes its own choice back: ``predicate-gpu-idx-<i>`` for every allocated app
  container plus ``gpu-assigned`` (``false`` after Allocate of a pod nobody predicated, ``true``
  once PreStartContainer succeeded), computed by libs/kube/annotations.py, the same rule the
  watchdog's repair uses (two rules would patch a pod back and forth), as a merge patch,
  retried for up to 10 s like gpu-manager.
  Patches go through one queue so that they reach the API server in the order they were decided;
  unlike gpu-manager, the kubelet's Allocate does not wait for them (the grant is already durable
  in the log, and the annotations are derived from it). When a correction leaves a pod holding
  nothing, the keys written for it are removed again.
  The writes an Allocate and a PreStartContainer ask for wait ``WRITE_DELAY_S``, and a later word
  about the same pod replaces a waiting one (a correction writes at once): a pod whose containers
  start within that time (its image present) is patched once, after they started, with
  ``gpu-assigned=true``, instead of once per step. A PATCH to a pod is a pod update for everyone
  watching it, the kubelet included, which would handle it in the middle of starting the pod's
  containers; the extender learns of a pod's GPU at most that much later.
- ``tencent.com/vcuda-core-limit`` (a soft utilisation cap, clamped to 0..100) is recorded with
  the grant and becomes the vcuda.config limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod as KubePod
from lightkube.types import PatchType

from libs.errors import ServiceError
from libs.events.schema import GpuShare
from libs.kube.annotations import extender_indexes, ready_annotations
from libs.kube.pods import (
    ANNOTATION_CORE_LIMIT,
    ANNOTATION_GPU_ASSIGNED,
    ANNOTATION_PREDICATE_IDX,
    ANNOTATION_PREDICATE_TIME,
    Pod,
)
from libs.ledger.state import MODE_DRA, Allocation, GpuUsage
from libs.logger import get_logger

__all__ = [
    "PREDICATE_CHECK_ERROR",
    "AnnotationWriter",
    "core_limit",
    "is_predicated",
    "predicated_minor",
]

PREDICATE_CHECK_ERROR = "PreStartContainerCheckErr"
_PATCH_RETRY_FOR = 10.0
WRITE_DELAY_S = 1.0  # how long an Allocate's or a PreStart's write waits for a later one (see above)
_logger = get_logger("allocator")


def core_limit(pod: Pod) -> int | None:
    raw = pod.metadata.annotations.get(ANNOTATION_CORE_LIMIT)
    if raw is None:
        return None
    try:
        return max(0, min(int(raw), 100))
    except ValueError:
        return None


def is_predicated(pod: Pod) -> bool:
    """gpu-manager's IsGPUPredicatedPod: vcore and vmemory asked for (app containers), the
    extender's predicate time present, and gpu-assigned present and not "true"."""
    ann = pod.metadata.annotations
    if ANNOTATION_PREDICATE_TIME not in ann or ann.get(ANNOTATION_GPU_ASSIGNED, "true") == "true":
        return False  # the annotations first: most pods have none, and the sums parse quantities
    return sum(c.vcore for c in pod.spec.containers) > 0 and sum(c.vmemory for c in pod.spec.containers) > 0


def predicated_minor(pod: Pod, index: int, gpus: Sequence[GpuUsage]) -> GpuUsage:
    """The GPU the extender chose for app container ``index`` (texts as gpu-manager's), among ``gpus``
    (the device-plugin GPUs): the extender's number is ``extender_indexes``', which is the minor on a
    node without DRA GPUs."""
    raw = pod.metadata.annotations.get(f"{ANNOTATION_PREDICATE_IDX}{index}")
    if raw is None:
        raise ServiceError(409, f"failed to find predicate idx for pod {pod.uid}")
    try:
        number = int(raw.split(",")[0])
    except ValueError:
        raise ServiceError(409, f"failed to parse predicate idx {raw!r} for pod {pod.uid}") from None
    numbered = extender_indexes(gpus)
    for gpu in gpus:
        if gpu.mode != MODE_DRA and numbered[gpu.minor] == number:
            return gpu
    raise ServiceError(409, (
        f"failed to find predicate device {number} of pod {pod.uid} on this node: the extender numbers "
        f"its {len(numbered)} device-plugin GPU(s) 0..{len(numbered) - 1}"))


def mismatch(pod: Pod, container: str, picked: Sequence[GpuShare], predicate: GpuUsage) -> ServiceError:
    pick = ",".join(f"/dev/nvidia{s.minor}" for s in picked)
    return ServiceError(409, (
        f"Nvidia node mismatch for pod {pod.metadata.name}({container}), "
        f"pick up:{pick}  predicate: /dev/nvidia{predicate.minor}"
    ))


class AnnotationWriter:
    """One queue of pod patches, applied in order by one task, each retried for a bounded time."""

    def __init__(self, client: AsyncClient | None, allocations_of: Callable[[str], list[Allocation]],
                 gpus: Callable[[], Iterable[GpuUsage]] | None = None) -> None:
        self.client = client
        self.allocations_of = allocations_of
        self.gpus = gpus  # the node's GPUs now, for the extender's numbering (None: minors)
        self.queue: asyncio.Queue[tuple[str, str, str, bool]] = asyncio.Queue()
        self.written = 0
        self._keys: dict[str, set[str]] = {}  # pod uid -> the annotation keys this process wrote there
        self.defer_for = WRITE_DELAY_S
        self._deferred: dict[str, asyncio.TimerHandle] = {}  # pod uid -> its write waiting for a later word

    def publish(self, namespace: str, name: str, pod_uid: str, *, assigned: bool, defer: bool = False) -> None:
        """Write the pod's annotations as the ledger holds them when the write runs; ``defer``: not
        before ``defer_for`` seconds, and a later ``publish`` for the same pod replaces this one."""
        if self.client is None:
            return
        if (waiting := self._deferred.pop(pod_uid, None)) is not None:
            waiting.cancel()
        item = (namespace, name, pod_uid, assigned)
        if defer:
            self._deferred[pod_uid] = asyncio.get_running_loop().call_later(self.defer_for, self._due, item)
        else:
            self.queue.put_nowait(item)

    def close(self) -> None:
        """Drop the writes still waiting (the watchdog's repair writes a running pod's annotations)."""
        for waiting in self._deferred.values():
            waiting.cancel()
        self._deferred.clear()

    def _due(self, item: tuple[str, str, str, bool]) -> None:
        self._deferred.pop(item[2], None)
        self.queue.put_nowait(item)

    async def run(self) -> None:
        while True:
            namespace, name, pod_uid, assigned = await self.queue.get()
            # One loop turn first: the answer whose grant queued this (an Allocate's reply) is then
            # written before a patch's HTTP request takes the loop.
            await asyncio.sleep(0)
            held = self.allocations_of(pod_uid)  # as of now: corrections included
            indexes = extender_indexes(self.gpus()) if self.gpus is not None else None
            wanted = ready_annotations(held, assigned=assigned, indexes=indexes)
            if wanted:
                self._keys.setdefault(pod_uid, set()).update(wanted)
                await self._patch(namespace, name, wanted)
            elif pod_uid in self._keys:
                # A correction moved every grant away: withdraw what was written for the wrong guess,
                # else it reads as an extender's choice (or an assigned GPU) the pod does not hold.
                await self._patch(namespace, name, dict.fromkeys(sorted(self._keys.pop(pod_uid))))
            self.queue.task_done()

    async def _patch(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> None:
        assert self.client is not None
        body = {"metadata": {"annotations": annotations}}
        deadline = asyncio.get_running_loop().time() + _PATCH_RETRY_FOR
        while True:
            try:
                await self.client.patch(KubePod, name, body, namespace=namespace,
                                        patch_type=PatchType.MERGE)
                self.written += 1
                return
            except Exception as exc:  # conflicts, timeouts, a pod already gone
                if getattr(getattr(exc, "status", None), "code", None) == 404 or \
                        asyncio.get_running_loop().time() > deadline:
                    _logger.warning("pod annotations not written", pod=f"{namespace}/{name}", error=str(exc))
                    return
                await asyncio.sleep(1.0)

    async def fail_pod(self, namespace: str, name: str, message: str) -> None:
        """gpu-manager's ALLOCATE_FAIL: the pod becomes Failed (reason PreStartContainerCheckErr)."""
        if self.client is None:
            return
        body = {"status": {"phase": "Failed", "reason": PREDICATE_CHECK_ERROR, "message": message}}
        try:
            await self.client.patch(KubePod.Status, name, body, namespace=namespace,
                                    patch_type=PatchType.MERGE)
        except Exception as exc:
            _logger.warning("pod not marked failed", pod=f"{namespace}/{name}", error=str(exc))

