"""The pod-facing half of the simulated kubelet: admission, container start and pod deletion.

* Admission is serial, in creation order, one pod at a time (the kubelet's HandlePodAdditions):
  device-manager Allocate for every init container, then every app container. Any error rejects
  the pod: phase Failed, reason UnexpectedAdmissionError, message
  "Pod was rejected: Allocate failed due to <error>, which is unexpected". No retry.
* After admission each pod gets its own worker task (so one pod's PreStartContainer may overlap
  the next pod's admission, as in a kubelet): init containers one by one, then app containers.
  A container whose device options fail (PreStartContainer error, stopped endpoint ...) stays
  waiting with reason CreateContainerConfigError, which is what the kubelet reports for errors
  from GenerateRunContainerOptions, and is tried again, as the kubelet's pod sync does, after
  ``container_retry_backoff`` seconds, doubling up to 10 s, while the pod is active
  (``container_retry_backoff=0``: no retry, the pod stays Pending).
* With a real runtime (``runtime``, simulator/runtime) the pod's sandbox is created first
  (RunPodSandbox, before any container's options: PreStartContainer comes after it, as in the
  kubelet's SyncPod), then each container is created and started through CRI with its options; a
  refusal there is reported as the kubelet does (CreateContainerError, RunContainerError) and
  retried the same way. Init containers really run
  to their exit; a deleted pod's containers and sandbox are stopped and removed before the object goes.
* Deleting a pod: deletionTimestamp set and running containers terminated (one MODIFIED), then
  the object is removed (DELETED). Devices come back only at the next GC trigger.
* DRA (``dra``, simulator/dra/manager.py, when the node has a plugins_registry): before the first
  container, the pod's claims are prepared; while that fails the containers stay waiting
  (PodInitializing / ContainerCreating) with the error as their message, tried again with the same
  backoff. Each container's claims' CDI device IDs join the device plugins' and, with a ``cdi_dir``,
  are resolved into device nodes, mounts and envs before CreateContainer (an unresolvable ID is a
  CreateContainerError, as from a runtime). The manager unprepares after the pod is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from .config import SimConfig
from .devicemanager import AllocationError, ContainerStartError, DeviceManager
from .dra.cdi_resolve import CdiResolveError, merge_into_options, resolve
from .dra.manager import DraManager, DraPrepareError
from .errors import ApiError
from .logger import logger
from .podspec import app_containers, init_containers, is_sidecar, pod_key, pod_uid
from .podstatus import container_id, pod_conditions, pod_phase, running, terminated, waiting
from .store import PodStore, now_rfc3339

__all__ = ["REJECT_REASON", "Kubelet", "is_pod_active"]

REJECT_REASON = "UnexpectedAdmissionError"
CREATE_CONFIG_ERROR = "CreateContainerConfigError"
RUNTIME_STOP_GRACE = 10  # cap on the grace a real container gets at deletion

_logger = logger("kubelet")


def is_pod_active(pod: dict[str, Any]) -> bool:
    """Not terminal, and not a deleted pod whose containers have all stopped."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        return False
    if pod.get("metadata", {}).get("deletionTimestamp"):
        statuses = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
        if not any("running" in (s.get("state") or {}) for s in statuses):
            return False
    return True


class Kubelet:
    def __init__(self, cfg: SimConfig, store: PodStore, manager: DeviceManager) -> None:
        self._cfg = cfg
        self._store = store
        self._manager = manager
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._admission_task: asyncio.Task[None] | None = None
        # Held for each pod's admission; kubelet restart takes it so it never splits an admission.
        self.admission_lock = asyncio.Lock()
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._removals: dict[str, asyncio.Task[None]] = {}
        self.run_options: dict[tuple[str, str], dict[str, Any]] = {}
        # UIDs the kubelet has taken up (its pod manager): a pod is added right before its own
        # admission, so pods still queued behind it are not known yet (PodResources lists known pods).
        self.known: set[str] = set()
        self._next_ip = 0
        self.runtime: Any = None  # simulator.runtime.PodRuntime when real containers are run
        self.dra: DraManager | None = None  # the DRA manager when the node watches a plugins_registry

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._admission_task = asyncio.create_task(self._admission_loop(), name="kubelet-admission")

    async def stop(self) -> None:
        tasks = [t for t in (self._admission_task, *self._workers.values(), *self._removals.values()) if t]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        self._admission_task = None

    # -- which pods are ours and alive ---------------------------------------------------------

    def bound_here(self, pod: dict[str, Any]) -> bool:
        return (pod.get("spec") or {}).get("nodeName") == self._cfg.node_name

    def peek_active_pods(self) -> list[dict[str, Any]]:
        """This node's active pods in creation order (the kubelet's GetActivePods), the stored objects
        themselves: read them, never change them."""
        return self._store.peek_all(lambda p: self.bound_here(p) and is_pod_active(p))

    def active_pod_uids(self) -> set[str]:
        return {pod_uid(p) for p in self.peek_active_pods()}

    def is_uid_active(self, uid: str) -> bool:
        pod = self._store.peek_by_uid(uid)
        return pod is not None and self.bound_here(pod) and is_pod_active(pod)

    # -- admission -----------------------------------------------------------------------------

    def pod_created(self, pod: dict[str, Any]) -> None:
        if self.bound_here(pod):
            self._queue.put_nowait(pod_uid(pod))

    async def _admission_loop(self) -> None:
        while True:
            uid = await self._queue.get()
            self.known.add(uid)
            try:
                async with self.admission_lock:
                    pod = self._store.get_by_uid(uid)
                    if pod is None or not is_pod_active(pod):
                        continue  # deleted or finished before its turn
                    admitted = await self._admit(pod)
                if admitted:
                    worker = asyncio.create_task(self._run_pod(uid), name=f"pod-{uid}")
                    self._workers[uid] = worker
                    worker.add_done_callback(lambda _t, u=uid: self._workers.pop(u, None))
            except asyncio.CancelledError:
                raise
            except Exception:
                _logger.exception("admission crashed", pod=uid)

    async def _admit(self, pod: dict[str, Any]) -> bool:
        ns, name = pod_key(pod)
        for container in [*init_containers(pod), *app_containers(pod)]:
            try:
                await self._manager.allocate(pod, container)
            except AllocationError as err:
                self._reject(ns, name, REJECT_REASON, f"Allocate failed due to {err}, which is unexpected")
                return False
        _logger.info("pod admitted", pod=f"{ns}/{name}")
        return True

    def _reject(self, ns: str, name: str, reason: str, message: str) -> None:
        _logger.info("pod rejected", pod=f"{ns}/{name}", reason=reason, message=message)

        def mutate(p: dict[str, Any]) -> None:
            qos = (p.get("status") or {}).get("qosClass")
            p["status"] = {"phase": "Failed", "reason": reason, "message": "Pod was rejected: " + message}
            if qos:
                p["status"]["qosClass"] = qos

        with contextlib.suppress(ApiError):
            self._store.update(ns, name, mutate)

    # -- container start -----------------------------------------------------------------------

    def _pod_ip(self) -> str:
        self._next_ip += 1
        return f"10.88.{self._next_ip // 250}.{self._next_ip % 250 + 2}"

    async def _run_pod(self, uid: str) -> None:
        try:
            await self._start_pod_containers(uid)
        except asyncio.CancelledError:
            raise
        except Exception:
            _logger.exception("pod worker crashed", pod=uid)

    async def _start_pod_containers(self, uid: str) -> None:
        pod = self._store.get_by_uid(uid)
        if pod is None:
            return
        inits = init_containers(pod)
        apps = app_containers(pod)
        init_st = {c["name"]: waiting(c, "PodInitializing") for c in inits}
        app_st = {c["name"]: waiting(c, "PodInitializing" if inits else "ContainerCreating") for c in apps}
        extra = {"startTime": now_rfc3339(), "hostIP": "127.0.0.1", "podIP": self._pod_ip()}
        extra["podIPs"] = [{"ip": extra["podIP"]}]
        extra["hostIPs"] = [{"ip": "127.0.0.1"}]
        if not self._write_status(pod, init_st, app_st, extra):
            return
        claims = (pod.get("spec") or {}).get("resourceClaims")
        if self.dra is not None and claims and not await self._prepare_claims(pod, (init_st, app_st, extra)):
            return
        for container in inits:
            started = now_rfc3339()
            cid = await self._start_with_retries(pod, container, init_st, (init_st, app_st, extra))
            if cid is None:
                return
            if is_sidecar(container):
                init_st[container["name"]] = running(container, cid, started)
            elif self.runtime is None:
                # The simulated program exits 0 at once; the next init container starts after it.
                init_st[container["name"]] = terminated(container, cid, started, now_rfc3339())
            else:
                init_st[container["name"]] = running(container, cid, started)
                if not self._write_status(pod, init_st, app_st, extra):
                    return
                code = await self.runtime.wait_exited(cid.split("://", 1)[1], self._cfg.init_container_timeout)
                init_st[container["name"]] = terminated(container, cid, started, now_rfc3339(), exit_code=code,
                                                        reason="Completed" if code == 0 else "Error")
            if not self._write_status(pod, init_st, app_st, extra):
                return
        for container in apps:
            started = now_rfc3339()
            cid = await self._start_with_retries(pod, container, app_st, (init_st, app_st, extra))
            if cid is not None:
                app_st[container["name"]] = running(container, cid, started)
        self._write_status(pod, init_st, app_st, extra)

    async def _prepare_claims(
        self, pod: dict[str, Any], status: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
    ) -> bool:
        """NodePrepareResources for the pod's claims, tried again with backoff while the pod is active;
        each failure is shown on every waiting container. False when the pod gave up or went away."""
        assert self.dra is not None
        init_st, app_st, _ = status
        uid = pod_uid(pod)
        delay = self._cfg.container_retry_backoff
        while True:
            try:
                await self.dra.prepare_pod(self._store.get_by_uid(uid) or pod)
                break
            except DraPrepareError as err:
                message = f"failed to prepare dynamic resources: {err}"
                _logger.info("claims not prepared", pod=uid, error=str(err))
            for states in (init_st, app_st):
                for name, st in states.items():
                    states[name] = {**st, "state": {"waiting": {**st["state"]["waiting"], "message": message}}}
            if not self._write_status(pod, *status) or delay <= 0 or not self.is_uid_active(uid):
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
        for states in (init_st, app_st):
            for st in states.values():
                st["state"]["waiting"].pop("message", None)
        if self.dra.gate is not None:  # fault injection: hold the pod between prepare and its containers
            try:
                await asyncio.wait_for(self.dra.gate.wait(), 120)
            except TimeoutError:
                _logger.warning("DRA gate not opened within 120 s; starting the containers", pod=uid)
        return self._write_status(pod, *status)

    async def _start_with_retries(
        self, pod: dict[str, Any], container: dict[str, Any], states: dict[str, Any],
        status: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
    ) -> str | None:
        """Start one container, trying again with backoff while it fails and the pod is active; its
        container ID, or None. Each failure is published with the kubelet's waiting reason."""
        delay = self._cfg.container_retry_backoff
        while True:
            started = await self._start_container(pod, container)
            if isinstance(started, str):
                return started
            reason, error = started
            states[container["name"]] = waiting(container, reason, error)
            if not self._write_status(pod, *status) or delay <= 0 or not self.is_uid_active(pod_uid(pod)):
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def _start_container(self, pod: dict[str, Any], container: dict[str, Any]) -> str | tuple[str, str]:
        """Device options for one container (PreStartContainer included), then the container itself
        when a runtime runs them: its ``containerd://<id>``, or (waiting reason, error text)."""
        uid = pod_uid(pod)
        if not self.is_uid_active(uid):
            return CREATE_CONFIG_ERROR, "pod is no longer active"
        if self.runtime is not None:
            from .runtime import ContainerCreateError  # (with a runtime only: it loads the CRI stubs)

            try:  # the sandbox first, as the kubelet's SyncPod: then each container's options, then it
                await self.runtime.ensure_sandbox(pod)
            except ContainerCreateError as err:
                _logger.info("pod sandbox not created", pod=uid, error=str(err))
                return err.reason, str(err)
        try:
            opts = await self._manager.run_container_options(pod, container, self.is_uid_active)
        except (ContainerStartError, AllocationError) as err:
            _logger.info("container start failed", pod=uid, container=container["name"], error=str(err))
            return CREATE_CONFIG_ERROR, str(err)
        if self.dra is not None:
            claimed = self.dra.container_cdi_ids(pod, container)
            opts["cdi_devices"] += [i for i in claimed if i not in opts["cdi_devices"]]
        if opts["cdi_devices"] and self._cfg.cdi_dir is not None:
            # Resolved here, not by the runtime: containerd 1.6 ignores CRI's CDI devices.
            try:
                merge_into_options(opts, await asyncio.to_thread(resolve, self._cfg.cdi_dir, opts["cdi_devices"]))
            except CdiResolveError as err:
                _logger.info("CDI devices not resolved", pod=uid, container=container["name"], error=str(err))
                return "CreateContainerError", str(err)
            opts["cdi_resolved"] = True
        self.run_options[(uid, container["name"])] = opts
        if self.runtime is None:
            return container_id()
        try:
            return "containerd://" + await self.runtime.start_container(pod, container, opts)
        except ContainerCreateError as err:
            _logger.info("container create failed", pod=uid, container=container["name"], reason=err.reason,
                      error=str(err))
            return err.reason, str(err)

    def _write_status(
        self, pod: dict[str, Any], init_st: dict[str, Any], app_st: dict[str, Any], extra: dict[str, Any]
    ) -> bool:
        """Publish the container states; False when the pod is gone or being deleted."""
        ns, name = pod_key(pod)
        current = self._store.peek(ns, name)
        if current is None or current["metadata"].get("uid") != pod_uid(pod):
            return False
        if current["metadata"].get("deletionTimestamp"):
            return False

        def mutate(p: dict[str, Any]) -> None:
            status = p.setdefault("status", {})
            status.update(extra)
            status["phase"] = pod_phase(pod, init_st, app_st)
            status["conditions"] = pod_conditions(
                pod, init_st, app_st, now_rfc3339(), status.get("conditions")
            )
            if init_st:
                status["initContainerStatuses"] = [init_st[c["name"]] for c in init_containers(pod)]
            status["containerStatuses"] = [app_st[c["name"]] for c in app_containers(pod)]

        self._store.update(ns, name, mutate)
        return True

    # -- containers exiting on their own -------------------------------------------------------

    def set_phase(
        self, ns: str, name: str, phase: str, reason: str = "", message: str = ""
    ) -> dict[str, Any]:
        """Report a phase as the kubelet would after the containers' own exit: for Succeeded every
        running container terminates with exit code 0, for Failed with 1; other phases are set as is.
        A terminal pod is no longer active, so its devices return at the next GC trigger."""
        pod = self._store.peek(ns, name)
        if pod is None:
            raise ApiError.not_found("pods", name)
        if phase in ("Succeeded", "Failed"):
            worker = self._workers.pop(pod_uid(pod), None)
            if worker is not None:
                worker.cancel()
        now = now_rfc3339()
        exit_code, exit_reason = (0, "Completed") if phase == "Succeeded" else (1, "Error")

        def mutate(p: dict[str, Any]) -> None:
            status = p.setdefault("status", {})
            status["phase"] = phase
            if reason:
                status["reason"] = reason
            if message:
                status["message"] = message
            if phase not in ("Succeeded", "Failed"):
                return
            for key in ("initContainerStatuses", "containerStatuses"):
                for st in status.get(key) or []:
                    _terminate(st, now, exit_code, exit_reason)
            _unready(status, now)

        return self._store.update(ns, name, mutate)

    # -- deletion ------------------------------------------------------------------------------

    def begin_delete(self, ns: str, name: str) -> dict[str, Any]:
        """Mark the pod terminating and stop its containers; the removal follows (maybe later)."""
        pod = self._store.get(ns, name)
        if pod is None:
            raise ApiError.not_found("pods", name)
        uid = pod_uid(pod)
        if uid in self._removals or pod["metadata"].get("deletionTimestamp"):
            return pod
        worker = self._workers.pop(uid, None)
        if worker is not None:
            worker.cancel()
        now = now_rfc3339()

        def mutate(p: dict[str, Any]) -> None:
            p["metadata"]["deletionTimestamp"] = now
            p["metadata"]["deletionGracePeriodSeconds"] = 0
            status = p.setdefault("status", {})
            for key in ("initContainerStatuses", "containerStatuses"):
                for st in status.get(key) or []:
                    _terminate(st, now, 0, "Completed")
            _unready(status, now)

        terminating = self._store.update(ns, name, mutate)
        if self.runtime is not None:
            task = asyncio.create_task(self._teardown_then_remove(ns, name, uid), name=f"delete-{uid}")
            self._removals[uid] = task
            task.add_done_callback(lambda _t: self._removals.pop(uid, None))
        elif self._cfg.deletion_delay > 0:
            task = asyncio.create_task(self._remove_later(ns, name, uid), name=f"delete-{uid}")
            self._removals[uid] = task
            task.add_done_callback(lambda _t: self._removals.pop(uid, None))
        else:
            self._remove(ns, name, uid)
        return terminating

    async def delete(self, ns: str, name: str) -> None:
        pod = self.begin_delete(ns, name)
        task = self._removals.get(pod_uid(pod))
        if task is not None:
            await task

    async def _teardown_then_remove(self, ns: str, name: str, uid: str) -> None:
        """Real containers: stop and remove them and the sandbox, then the object goes."""
        try:
            await self.runtime.remove_pod(uid, grace=RUNTIME_STOP_GRACE)
        except Exception:
            _logger.exception("runtime teardown failed", pod=uid)
        await self._remove_later(ns, name, uid)

    async def _remove_later(self, ns: str, name: str, uid: str) -> None:
        await asyncio.sleep(self._cfg.deletion_delay)
        self._remove(ns, name, uid)

    def _remove(self, ns: str, name: str, uid: str) -> None:
        current = self._store.peek(ns, name)
        if current is not None and current["metadata"].get("uid") == uid:
            self._store.remove(ns, name)
        for key in [k for k in self.run_options if k[0] == uid]:
            del self.run_options[key]
        self.known.discard(uid)


def _terminate(st: dict[str, Any], now: str, exit_code: int, reason: str) -> None:
    """Turn a running container status into a terminated one (others are left alone)."""
    state = st.get("state") or {}
    if "running" not in state:
        return
    st["state"] = {
        "terminated": {
            "exitCode": exit_code,
            "reason": reason,
            "startedAt": state["running"].get("startedAt", now),
            "finishedAt": now,
            "containerID": st.get("containerID", ""),
        }
    }
    st["ready"] = False
    st["started"] = False


def _unready(status: dict[str, Any], now: str) -> None:
    for cond in status.get("conditions") or []:
        if cond.get("type") in ("Ready", "ContainersReady") and cond.get("status") == "True":
            cond["status"] = "False"
            cond["lastTransitionTime"] = now
