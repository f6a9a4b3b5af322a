"""What the control plane does for a pod with ``spec.resourceClaims`` before the kubelet sees it.

* The resourceclaim controller: a claim named by ``resourceClaimTemplateName`` is created from the
  template as ``<pod>-<entry>-<5 chars>``, owned by the pod and annotated with the entry's name, and
  the pod's ``status.resourceClaimStatuses`` maps the entry to it. When a pod is gone or finished,
  it is removed from its claims' ``reservedFor``; a claim reserved for nobody is deallocated, or
  deleted when it was made for the pod from a template.
* The scheduler's DRA plugin: each claim not yet allocated gets an allocation on this node from the
  node's slices (``simulator.dra.allocator``), every claim gets the pod in ``reservedFor``, then the
  pod is bound (``spec.nodeName``). Nothing is written unless every claim fits: an unschedulable pod
  stays Pending with the condition PodScheduled=False, reason Unschedulable, and is tried again
  whenever a DRA object or a pod changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable
from typing import Any

from ..errors import ApiError
from ..logger import logger
from ..podspec import pod_key, pod_uid
from ..store import PodStore, now_rfc3339
from .store import DraObjects

__all__ = ["POD_CLAIM_ANNOTATION", "DraScheduler", "has_claims"]

POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
_logger = logger("dra-scheduler")


def has_claims(pod: dict[str, Any]) -> bool:
    return bool((pod.get("spec") or {}).get("resourceClaims"))


class DraScheduler:
    def __init__(self, node: str, pods: PodStore, objects: DraObjects, on_bound: Callable[[dict[str, Any]], None]):
        self.node = node
        self.pods = pods
        self.objects = objects
        self.on_bound = on_bound
        self.pending: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    # -- one attempt -------------------------------------------------------------------------------

    def _claim_for(self, pod: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
        ns, name = pod_key(pod)
        claims = self.objects.claims
        if entry.get("resourceClaimName"):
            claim = claims.get(ns, entry["resourceClaimName"])
            if claim is None:
                raise ApiError.not_found("resourceclaims", entry["resourceClaimName"])
            return claim
        template_name = entry.get("resourceClaimTemplateName")
        if not template_name:
            raise ApiError.invalid("pods", name, f"resourceClaims[{entry.get('name')}]: names no claim or template")
        for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            if status.get("name") == entry["name"] and claims.get(ns, status.get("resourceClaimName", "")):
                return claims.get(ns, status["resourceClaimName"])  # type: ignore[return-value]
        template = self.objects.templates.get(ns, template_name)
        if template is None:
            raise ApiError.not_found("resourceclaimtemplates", template_name)
        claim = claims.create({"metadata": {
            "name": f"{name}-{entry['name']}-{secrets.token_hex(3)[:5]}", "namespace": ns,
            "annotations": {POD_CLAIM_ANNOTATION: entry["name"]},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod_uid(pod),
                                 "controller": True, "blockOwnerDeletion": True}]},
            "spec": template["spec"]["spec"]})

        def record(p: dict[str, Any]) -> None:
            statuses = p.setdefault("status", {}).setdefault("resourceClaimStatuses", [])
            statuses.append({"name": entry["name"], "resourceClaimName": claim["metadata"]["name"]})

        self.pods.update(ns, name, record)
        return claim

    def try_schedule(self, pod: dict[str, Any]) -> bool:
        """Allocate, reserve and bind; False (and the pod marked Unschedulable) when it does not fit."""
        from .allocator import AllocationFailed, allocate  # celpy only when a pod asks for claims

        ns, name = pod_key(pod)
        uid = pod_uid(pod)
        try:
            claims = [self._claim_for(pod, e) for e in pod["spec"]["resourceClaims"]]
            classes = {c["metadata"]["name"]: c for c in self.objects.classes.list()}
            slices = self.objects.slices.list()
            allocated = [c for c in self.objects.claims.list() if (c.get("status") or {}).get("allocation")]
            plans: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
            for claim in claims:
                if (claim.get("status") or {}).get("allocation"):
                    plans.append((claim, None))
                    continue
                allocation = allocate(claim, classes, slices, allocated, self.node)
                allocated.append({**claim, "status": {"allocation": allocation}})
                plans.append((claim, allocation))
        except (AllocationFailed, ApiError) as err:
            self._unschedulable(ns, name, str(err))
            self.pending.add(uid)
            return False
        for claim, allocation in plans:
            def reserve(c: dict[str, Any], allocation: dict[str, Any] | None = allocation) -> None:
                status = c.setdefault("status", {})
                if allocation is not None:
                    status["allocation"] = allocation
                reserved = status.setdefault("reservedFor", [])
                if all(r.get("uid") != uid for r in reserved):
                    reserved.append({"resource": "pods", "name": name, "uid": uid})

            self.objects.claims.update(ns, claim["metadata"]["name"], reserve)

        def bind(p: dict[str, Any]) -> None:
            p["spec"]["nodeName"] = self.node
            conditions = [c for c in (p.get("status") or {}).get("conditions") or [] if c.get("type") != "PodScheduled"]
            conditions.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": now_rfc3339()})
            p.setdefault("status", {})["conditions"] = conditions

        bound = self.pods.update(ns, name, bind)
        self.pending.discard(uid)
        _logger.info("pod scheduled with claims", pod=f"{ns}/{name}", claims=[c["metadata"]["name"] for c in claims])
        self.on_bound(bound)
        return True

    def _unschedulable(self, ns: str, name: str, message: str) -> None:
        def mark(p: dict[str, Any]) -> None:
            status = p.setdefault("status", {})
            status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                     "message": f"0/1 nodes are available: {message}",
                                     "lastTransitionTime": now_rfc3339()}]

        with contextlib.suppress(ApiError):
            self.pods.update(ns, name, mark)

    # -- the controller's side: reservations of pods that are gone ---------------------------------

    def release_gone(self, is_active: Callable[[str], bool]) -> None:
        for claim in self.objects.claims.list():
            status = claim.get("status") or {}
            reserved = status.get("reservedFor") or []
            live = [r for r in reserved if r.get("resource") != "pods" or is_active(r.get("uid", ""))]
            if len(live) == len(reserved):
                continue
            ns, name = claim["metadata"]["namespace"], claim["metadata"]["name"]
            owned = any(o.get("kind") == "Pod" for o in claim["metadata"].get("ownerReferences") or [])
            if not live and owned:
                self.objects.claims.remove(ns, name)
                continue

            def unreserve(c: dict[str, Any], live: list[dict[str, Any]] = live) -> None:
                c["status"]["reservedFor"] = live
                if not live:
                    c["status"].pop("allocation", None)

            self.objects.claims.update(ns, name, unreserve)

    async def run(self, is_active: Callable[[str], bool], interval: float = 0.2) -> None:
        """Retry pending pods and drop gone pods' reservations, on every change (and every ``interval``)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await self.objects.changes.wait_until(lambda: False, interval, poll=interval)
            self.release_gone(is_active)
            for uid in list(self.pending):
                pod = self.pods.get_by_uid(uid)
                if pod is None or pod["metadata"].get("deletionTimestamp"):
                    self.pending.discard(uid)
                    continue
                self.try_schedule(pod)
