"""Pods that failed admission (gpu-manager-reference.md 4.3): free them and, when a controller owns
them, delete them so that the controller creates a replacement; a naked pod is left as it is.

Such a pod is terminal for its object: it failed with ``UnexpectedAdmissionError`` (an Allocate the
plugin refused) or a container waits on the PreStartContainer check. Deleting it is the only way
its Deployment/Job/... gets a fresh attempt.
"""

from __future__ import annotations

import asyncio

from lightkube import ApiError, AsyncClient
from lightkube.resources.core_v1 import Pod as KubePod

from libs.kube.pods import Pod
from libs.logger import get_logger

__all__ = ["PRESTART_FAILED", "UNEXPECTED_ADMISSION", "AdmissionCleanup", "admission_failed", "controller_owned"]

_logger = get_logger("watchdog")
UNEXPECTED_ADMISSION = "UnexpectedAdmissionError"
PRESTART_FAILED = "PreStartContainer check failed"
RETRY_FOR = 10.0  # gpu-manager: retry every 1 s for up to 10 s on conflicts and timeouts


def admission_failed(pod: Pod) -> bool:
    """gpu-manager's ShouldDelete, on a Failed or Pending GPU pod."""
    if not pod.wants_gpu or pod.status.phase not in ("Failed", "Pending"):
        return False
    if pod.status.reason == UNEXPECTED_ADMISSION:
        return True
    for status in pod.all_statuses():
        waiting = status.state.get("waiting") or {}
        if PRESTART_FAILED in str(waiting.get("message", "")):
            return True
    return False


def controller_owned(pod: Pod) -> bool:
    """Owned by a controller (an ownerReference with controller: true) that is not itself a Pod."""
    return any(ref.controller and ref.kind != "Pod" for ref in pod.metadata.owner_references)


class AdmissionCleanup:
    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.deleted: list[str] = []  # pod keys, for logs and tests
        self._done: set[str] = set()  # uids already deleted or left alone: act (and log) once per pod

    def forget(self, pod_uid: str) -> None:
        self._done.discard(pod_uid)

    async def delete_if_owned(self, pod: Pod) -> bool:
        """Delete a controller-owned pod that failed admission; True when this call deleted it."""
        if pod.uid in self._done:
            return False
        if not controller_owned(pod):
            self._done.add(pod.uid)
            _logger.info("pod failed admission; left in place (no controller owns it)", pod=pod.key)
            return False
        self._done.add(pod.uid)  # now: a second call while this one retries does nothing
        try:
            await self._delete(pod)
        except BaseException:
            self._done.discard(pod.uid)  # a later event or reconciliation pass tries again
            raise
        self.deleted.append(pod.key)
        _logger.info("deleted a pod that failed admission, so that its controller recreates it", pod=pod.key,
                  reason=pod.status.reason or PRESTART_FAILED)
        return True

    async def _delete(self, pod: Pod) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETRY_FOR
        while True:
            try:
                await self.client.delete(KubePod, pod.metadata.name, namespace=pod.metadata.namespace)
                return
            except ApiError as exc:
                if exc.status.code == 404:
                    return
                if exc.status.code not in (409, 429, 500, 503, 504) or loop.time() >= deadline:
                    raise
                await asyncio.sleep(1.0)
