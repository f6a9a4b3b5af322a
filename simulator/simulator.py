"""`NodeSimulator`: one simulated node (kubelet device manager + PodResources + a Kubernetes-shaped
API server for its pods), all on the caller's asyncio loop; and `run_simulator` for the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import random
import secrets
import signal
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from aiohttp import web

from .apiserver import build_app
from .calls import CallLog, RpcCall
from .config import SimConfig, check_profile
from .devicemanager import DeviceManager, ResourceInfo
from .dra.manager import DraManager
from .dra.scheduler import DraScheduler, has_claims
from .dra.store import DraObjects
from .dra.watcher import PluginWatcher
from .errors import ApiError
from .kubelet import Kubelet
from .logger import logger
from .node import NodeObject, write_kubeconfig
from .poddevices import empty_run_options
from .podresources import PodResourcesServer
from .podspec import app_containers, init_containers, pod_uid
from .podstatus import qos_class
from .registration import RegistrationServer
from .store import PodStore

__all__ = ["NodeSimulator", "run_simulator"]

_logger = logger("simulator")

_NAME_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # what the API server uses for generateName


class NodeSimulator:
    """Async context manager: `async with NodeSimulator(cfg) as sim: ...`."""

    def __init__(self, cfg: SimConfig) -> None:
        check_profile(cfg.profile)
        self.cfg = cfg
        self._rng = random.Random(cfg.seed)
        self._call_log = CallLog()
        self.calls: list[RpcCall] = self._call_log.calls
        self.call_log = self._call_log  # the API server records pod PATCHes here too
        self.store = PodStore(cfg.watch_history)
        self.dra_objects = DraObjects(self.store, cfg.watch_history)  # resource.k8s.io/v1
        self.manager = DeviceManager(cfg, self._call_log, self._rng, lambda: self.kubelet.active_pod_uids())
        self.kubelet = Kubelet(cfg, self.store, self.manager)
        # pods with spec.resourceClaims: claims allocated and reserved, then bound (the control plane's part)
        self.dra_scheduler = DraScheduler(cfg.node_name, self.store, self.dra_objects, self.kubelet.pod_created)
        self.registration = RegistrationServer(cfg, self.manager, self._call_log)
        # The kubelet's DRA half: plugin watcher + DRA manager, when the node has a plugins_registry.
        self.plugin_watcher: PluginWatcher | None = None
        self.dra: DraManager | None = None
        if cfg.plugins_registry_dir is not None:
            self.plugin_watcher = PluginWatcher(cfg.plugins_registry_dir, self._call_log,
                                                dial_timeout=cfg.dial_timeout)
            self.dra = DraManager(self.dra_objects, self.plugin_watcher,
                                  cfg.dra_state_dir or cfg.device_plugin_dir.parent, self._pod_done,
                                  timeout=cfg.dra_timeout)
            self.kubelet.dra = self.dra
        self.node = NodeObject(cfg.node_name, self._node_capacity, self.store.next_rv)
        self.pod_resources = (
            PodResourcesServer(cfg.pod_resources_socket, self.store, self.kubelet, self.manager,
                               self._call_log, qps=cfg.pod_resources_qps, burst=cfg.pod_resources_burst)
            if cfg.pod_resources_socket is not None
            else None
        )
        self.api_url = ""
        self._api_port = 0
        self._background: set[asyncio.Task[None]] = set()
        self._runner: web.AppRunner | None = None
        self._running = False
        self.runtime: Any = None  # simulator.runtime.RuntimeHandle with cfg.runtime == "containerd"

    @property
    def kubelet_socket(self) -> Path:
        return self.registration.socket_path

    def _node_capacity(self) -> tuple[dict[str, int], dict[str, int], set[str]]:
        capacity, allocatable, _ = self.manager.get_capacity()
        return capacity, allocatable, set(self.manager.removed)

    def _pod_done(self, uid: str) -> bool:
        """The pod's containers are over: the object is gone, or the pod is terminal."""
        pod = self.store.get_by_uid(uid)
        return pod is None or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> NodeSimulator:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        try:
            # Kubelet start order: read the checkpoint, then wipe sockets and serve.
            self.manager.load_checkpoint()
            if self.dra is not None:
                self.dra.load_checkpoint()
            await self.registration.start()
            if self.pod_resources is not None:
                await self.pod_resources.start()
            await self.start_api()
            if self.cfg.kubeconfig_path is not None:
                write_kubeconfig(self.cfg.kubeconfig_path, self.api_url)
            if self.cfg.runtime == "containerd":
                from .runtime import start_runtime  # grpc stubs and containerd only when asked for

                self.runtime = await start_runtime(self.cfg)
                self.kubelet.runtime = self.runtime.pods
            self.kubelet.start()
            task = asyncio.create_task(self.dra_scheduler.run(self.kubelet.is_uid_active), name="dra-scheduler")
            self._background.add(task)
            if self.dra is not None and self.plugin_watcher is not None:
                await self.plugin_watcher.start()
                task = asyncio.create_task(self.dra.run(self.store.changes), name="dra-unprepare")
                self._background.add(task)
        except BaseException:
            await self.stop()
            raise
        _logger.info("node simulator started", node=self.cfg.node_name, api_url=self.api_url,
                  kubelet_socket=str(self.registration.socket_path))

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        for task in list(self._background):
            task.cancel()
        self.store.close()  # ends watch streams, so the HTTP server can shut down at once
        self.dra_objects.close()
        await self.kubelet.stop()
        if self.plugin_watcher is not None:
            await self.plugin_watcher.stop()
        if self.runtime is not None:
            runtime, self.runtime = self.runtime, None
            self.kubelet.runtime = None
            await runtime.close()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self.pod_resources is not None:
            await self.pod_resources.stop()
        await self.registration.stop()
        _logger.info("node simulator stopped", node=self.cfg.node_name)

    async def start_api(self) -> None:
        """Serve the HTTP API (again): on the configured port, or on the one used before."""
        if self._runner is not None:
            return
        runner = web.AppRunner(build_app(self), shutdown_timeout=1.0, access_log=None)
        await runner.setup()
        port = self._api_port or self.cfg.api_port
        site = web.TCPSite(runner, self.cfg.api_host, port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        host, self._api_port = runner.addresses[0][:2]
        self.api_url = f"http://[{host}]:{self._api_port}" if ":" in host else f"http://{host}:{self._api_port}"

    @property
    def api_serving(self) -> bool:
        return self._runner is not None

    async def stop_api(self) -> None:
        """Fault injection: the API server goes away (open watches are cut, connections refused);
        the kubelet side keeps running. `start_api()` brings it back on the same port."""
        self.store.drop_watches()
        self.dra_objects.drop_watches()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def schedule_api_outage(self, seconds: float) -> None:
        async def outage() -> None:
            await asyncio.sleep(0.05)  # let the HTTP answer that asked for it go out first
            await self.stop_api()
            await asyncio.sleep(seconds)
            if self._running:
                await self.start_api()

        task = asyncio.create_task(outage(), name="api-outage")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def restart_kubelet(self) -> None:
        """Spec 4.1 restart(): drop plugin connections and kubelet.sock, wipe the sockets, rebuild
        device state from the checkpoint (capacity 0, stopped endpoints, allocations kept), serve
        again. Plugins must notice and register again. Pods are not re-admitted."""
        async with self.kubelet.admission_lock:
            if self.pod_resources is not None:
                await self.pod_resources.stop()
            await self.registration.stop()
            if self.plugin_watcher is not None:
                await self.plugin_watcher.stop()  # DRA drivers are registered anew from plugins_registry
            self.manager.restart()
            if self.dra is not None:
                await self.dra.reload()  # the claim cache as the checkpoint has it
            await self.registration.start()
            if self.plugin_watcher is not None:
                await self.plugin_watcher.start()
            if self.pod_resources is not None:
                await self.pod_resources.start()
        _logger.info("kubelet restarted", node=self.cfg.node_name)

    def tick(self) -> None:
        """One node-status sync: drops resources whose stopped endpoint outlived the grace."""
        self.manager.get_capacity()

    def lightkube_config(self, namespace: str | None = None) -> Any:
        """A `lightkube.KubeConfig` for this API. (lightkube 1.0's `KubeConfig.from_server` has no
        user entry, which its clients then refuse with "Missing user"; this one has an empty user.)"""
        from lightkube import KubeConfig
        from lightkube.config.models import Cluster, User

        return KubeConfig.from_one(cluster=Cluster(server=self.api_url), user=User(), namespace=namespace)

    # -- pods ----------------------------------------------------------------------------------

    async def create_pod(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create a pod as the API server would (defaults, status Pending); bound to this node if
        it names no node. The kubelet admits it in its turn."""
        pod = copy.deepcopy(manifest)
        pod["apiVersion"], pod["kind"] = "v1", "Pod"
        meta = pod.setdefault("metadata", {})
        meta["namespace"] = meta.get("namespace") or "default"
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError.invalid(
                    "pods", "", "metadata.name: Required value: name or generateName is required"
                )
            suffix = "".join(secrets.choice(_NAME_SUFFIX_CHARS) for _ in range(5))
            meta["name"] = meta["generateName"] + suffix
        for field in ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp"):
            meta.pop(field, None)
        spec = pod.setdefault("spec", {})
        containers = spec.get("containers")
        if not isinstance(containers, list) or not containers:
            raise ApiError.invalid("pods", meta["name"], "spec.containers: Required value")
        for container in [*init_containers(pod), *app_containers(pod)]:
            if not isinstance(container, dict) or not container.get("name"):
                raise ApiError.invalid("pods", meta["name"], "spec.containers[].name: Required value")
            resources = container.setdefault("resources", {})
            # API defaulting: requests default to limits.
            if resources.get("limits"):
                resources["requests"] = {**resources["limits"], **(resources.get("requests") or {})}
        if not spec.get("nodeName") and not has_claims(pod):
            spec["nodeName"] = self.cfg.node_name
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        pod["status"] = {"phase": "Pending", "qosClass": qos_class(pod)}
        stored = self.store.create(pod)
        if has_claims(stored):
            self.dra_scheduler.try_schedule(stored)  # binds and hands it to the kubelet when its claims fit
            return self.store.get(meta["namespace"], meta["name"]) or stored
        self.kubelet.pod_created(stored)
        return stored

    async def delete_pod(self, namespace: str, name: str) -> None:
        """Terminate and remove the pod (MODIFIED, then DELETED); devices return at the next GC."""
        try:
            await self.kubelet.delete(namespace, name)
        except ApiError as err:
            if err.code == 404:
                raise KeyError(f"pod {namespace}/{name} not found") from err
            raise

    async def set_pod_phase(
        self, namespace: str, name: str, phase: str, *, reason: str = "", message: str = ""
    ) -> dict[str, Any]:
        """Make the pod's containers "exit": Succeeded (exit 0) or Failed (exit 1) end every running
        container; the pod stops being active, so its devices return at the next GC trigger."""
        try:
            return self.kubelet.set_phase(namespace, name, phase, reason, message)
        except ApiError as err:
            if err.code == 404:
                raise KeyError(f"pod {namespace}/{name} not found") from err
            raise

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.store.get(namespace, name)

    async def wait_for_pod(
        self, namespace: str, name: str, condition: Callable[[dict[str, Any]], bool], timeout: float
    ) -> dict[str, Any]:
        """Wait until the pod exists and `condition(pod)` holds; return that pod."""
        found: list[dict[str, Any]] = []

        def check() -> bool:
            pod = self.store.get(namespace, name)
            if pod is not None and condition(pod):
                found.append(pod)
                return True
            return False

        try:
            await self.store.changes.wait_until(check, timeout)
        except TimeoutError:
            pod = self.store.get(namespace, name)
            last = json.dumps(pod.get("status")) if pod else "pod does not exist"
            raise TimeoutError(
                f"pod {namespace}/{name} did not reach the condition within {timeout:g}s; last status: {last}"
            ) from None
        return found[-1]

    async def wait_for_resource(self, resource: str, allocatable: int, timeout: float) -> None:
        """Wait until the node reports exactly `allocatable` of the resource."""
        try:
            await self.manager.changes.wait_until(lambda: self.allocatable(resource) == allocatable, timeout)
        except TimeoutError:
            raise TimeoutError(
                f"{resource}: allocatable did not become {allocatable} within {timeout:g}s "
                f"(capacity {self.capacity(resource)}, allocatable {self.allocatable(resource)})"
            ) from None

    # -- device views --------------------------------------------------------------------------

    def capacity(self, resource: str) -> int:
        return self.manager.get_capacity()[0].get(resource, 0)

    def allocatable(self, resource: str) -> int:
        return self.manager.get_capacity()[1].get(resource, 0)

    def registered_resources(self) -> dict[str, ResourceInfo]:
        return self.manager.registered_resources()

    def container_run_options(self, namespace: str, name: str, container: str) -> dict[str, Any]:
        """The merged Allocate responses the container was (or would be) started with."""
        pod = self.store.peek(namespace, name)
        if pod is None:
            raise KeyError(f"pod {namespace}/{name} not found")
        uid = pod_uid(pod)
        opts = self.kubelet.run_options.get((uid, container))
        if opts is not None:
            return copy.deepcopy(opts)
        if not self.manager.pod_devices.container_allocations(uid, container):
            return empty_run_options()
        # Not started yet: merge now, with a private RNG so the simulation's sequence is untouched.
        return self.manager.pod_devices.run_container_options(uid, container, random.Random(0))

    def allocated_device_ids(self, pod_uid: str, container: str, resource: str) -> list[str]:
        alloc = self.manager.pod_devices.allocation(pod_uid, container, resource)
        return alloc.ids() if alloc is not None else []


async def run_simulator(cfg: SimConfig, *, stop: asyncio.Event | None = None) -> None:
    """Run a simulator until `stop` is set (or SIGINT/SIGTERM when no event is given)."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
    try:
        async with NodeSimulator(cfg) as sim:
            _logger.info(
                "simulator running",
                api_url=sim.api_url,
                kubeconfig=str(cfg.kubeconfig_path) if cfg.kubeconfig_path else None,
                kubelet_socket=str(sim.registration.socket_path),
                pod_resources_socket=str(cfg.pod_resources_socket) if cfg.pod_resources_socket else None,
                # for the agent's --container-runtime-endpoint
                container_runtime_endpoint=str(sim.runtime.containerd.socket) if sim.runtime else None,
            )
            await stop.wait()  # the one unbounded wait: the CLI runs until told to stop
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
