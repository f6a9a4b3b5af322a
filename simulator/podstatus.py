"""Building the `status` of a Pod the way a kubelet reports it (containers, phase, conditions)."""

from __future__ import annotations

import secrets
from typing import Any

from .podspec import app_containers, init_containers, is_sidecar

__all__ = [
    "container_id",
    "pod_conditions",
    "pod_phase",
    "qos_class",
    "running",
    "terminated",
    "waiting",
]

Status = dict[str, Any]


def container_id() -> str:
    return "containerd://" + secrets.token_hex(32)


def _base(container: dict[str, Any]) -> Status:
    return {
        "name": container["name"],
        "image": container.get("image", ""),
        "imageID": "",
        "lastState": {},
        "restartCount": 0,
    }


def waiting(container: dict[str, Any], reason: str, message: str = "") -> Status:
    state: dict[str, Any] = {"reason": reason}
    if message:
        state["message"] = message
    return {**_base(container), "state": {"waiting": state}, "ready": False, "started": False}


def running(container: dict[str, Any], cid: str, started_at: str) -> Status:
    return {
        **_base(container),
        "state": {"running": {"startedAt": started_at}},
        "ready": True,
        "started": True,
        "containerID": cid,
    }


def terminated(
    container: dict[str, Any], cid: str, started_at: str, finished_at: str, *, exit_code: int = 0,
    reason: str = "Completed",
) -> Status:
    return {
        **_base(container),
        "state": {
            "terminated": {
                "exitCode": exit_code,
                "reason": reason,
                "startedAt": started_at,
                "finishedAt": finished_at,
                "containerID": cid,
            }
        },
        "ready": False,
        "started": False,
        "containerID": cid,
    }


def _state(status: Status) -> str:
    return next(iter(status.get("state") or {"waiting": {}}))


def _init_done(pod: dict[str, Any], statuses: dict[str, Status]) -> bool:
    for container in init_containers(pod):
        status = statuses.get(container["name"])
        if status is None:
            return False
        if is_sidecar(container):
            if _state(status) != "running":
                return False
        elif _state(status) != "terminated" or status["state"]["terminated"].get("exitCode") != 0:
            return False
    return True


def pod_phase(pod: dict[str, Any], init_statuses: dict[str, Status], app_statuses: dict[str, Status]) -> str:
    """The kubelet's getPhase for a pod whose containers never exit on their own."""
    if not _init_done(pod, init_statuses):
        return "Pending"
    states = [_state(app_statuses.get(c["name"], {})) for c in app_containers(pod)]
    if not states or any(s == "waiting" for s in states):
        return "Pending"
    return "Running"


def pod_conditions(
    pod: dict[str, Any], init_statuses: dict[str, Status], app_statuses: dict[str, Status], now: str,
    previous: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """PodScheduled, Initialized, ContainersReady, Ready; transition times kept while unchanged."""
    initialized = _init_done(pod, init_statuses)
    sidecars_ready = all(
        init_statuses.get(c["name"], {}).get("ready", False) for c in init_containers(pod) if is_sidecar(c)
    )
    apps_ready = all(app_statuses.get(c["name"], {}).get("ready", False) for c in app_containers(pod))
    ready = initialized and sidecars_ready and apps_ready
    old = {c.get("type"): c for c in previous or []}

    def cond(kind: str, value: bool) -> dict[str, Any]:
        status = "True" if value else "False"
        prior = old.get(kind)
        since = prior.get("lastTransitionTime") if prior and prior.get("status") == status else now
        return {"type": kind, "status": status, "lastProbeTime": None, "lastTransitionTime": since}

    return [
        cond("PodScheduled", True),
        cond("Initialized", initialized),
        cond("ContainersReady", ready),
        cond("Ready", ready),
    ]


def qos_class(pod: dict[str, Any]) -> str:
    """Guaranteed / Burstable / BestEffort from cpu and memory requests and limits."""
    containers = [*init_containers(pod), *app_containers(pod)]
    any_set = False
    guaranteed = True
    for container in containers:
        resources = container.get("resources") or {}
        limits = resources.get("limits") or {}
        requests = {**limits, **(resources.get("requests") or {})}
        for name in ("cpu", "memory"):
            if name in limits or name in requests:
                any_set = True
            if name not in limits or str(requests.get(name)) != str(limits.get(name)):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"
