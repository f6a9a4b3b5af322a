"""A simulated node running gpuledger as its DRA driver, end to end.

Real nats-server, the simulator (API server over HTTP with the resource.k8s.io/v1 objects, its
scheduler-side allocator, the kubelet's plugin watcher and DRA manager over gRPC unix sockets, CDI
resolution), and the four services in this process, each started and stopped on its own so a test can
take one away (an agent crash) and bring it back. The DeviceClass and the example
ResourceClaimTemplates are the ones in deploy/dra/.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml

from libs.bus.client import Bus
from libs.commands import StateReply, StateRequest
from libs.config import Settings
from libs.dra import DRIVER_NAME
from libs.kube.pods import RESOURCE_VCORE
from libs.ledger.state import CLAIM_PREFIX, LedgerSnapshot
from services.allocator import app as allocator_app
from services.registrar import app as registrar_app
from services.vmanager import app as vmanager_app
from services.watchdog import app as watchdog_app
from simulator import NodeSimulator, SimConfig
from simulator.calls import RpcCall
from tests.builders import NODE, settings_for
from tests.builders.cgroups import enter_container
from tests.polling import eventually

REPO = Path(__file__).resolve().parents[3]
PROFILES = REPO / "libs" / "gpu" / "profiles"
DEPLOY = REPO / "deploy" / "dra"
SERVICE_ORDER = ("allocator", "watchdog", "vmanager", "registrar")
_APPS = {"allocator": allocator_app, "watchdog": watchdog_app, "vmanager": vmanager_app, "registrar": registrar_app}


def dra_settings(root: Path, url: str, *, dra_gpus: str, profile: str = "pcie-4gpu.yaml") -> Settings:
    base = settings_for(root, url, dra_gpus=dra_gpus, kubelet_plugins_dir=str(root / "plugins"),
                        plugins_registry_dir=str(root / "reg"), cdi_dir=str(root / "cdi"), health_checks=False)
    return msgspec.structs.replace(base, gpus=f"fake:{PROFILES / profile}")


def sim_config(root: Path, settings: Settings) -> SimConfig:
    return SimConfig(node_name=NODE, device_plugin_dir=Path(settings.device_plugin_dir),
                     pod_resources_socket=Path(settings.pod_resources_socket), kubeconfig_path=root / "kubeconfig",
                     seed=7, plugins_registry_dir=Path(settings.plugins_registry_dir), cdi_dir=Path(settings.cdi_dir),
                     dra_state_dir=root / "kubelet", container_retry_backoff=0.2)


def claim_templates() -> list[dict[str, Any]]:
    with open(DEPLOY / "examples" / "claimtemplates.yaml") as f:
        return [{**doc, "metadata": {**doc["metadata"], "namespace": "default"}} for doc in yaml.safe_load_all(f)]


def deviceclass() -> dict[str, Any]:
    with open(DEPLOY / "deviceclass.yaml") as f:
        return yaml.safe_load(f)


def claim_pod(name: str, template: str = "", *, claim: str = "", containers: tuple[str, ...] = ("main",)) -> dict:
    """A pod with one claim entry ``gpu``, from a template or naming an existing claim, used by every container."""
    entry = {"name": "gpu", **({"resourceClaimName": claim} if claim else {"resourceClaimTemplateName": template})}
    return {"metadata": {"name": name, "namespace": "default"}, "spec": {
        "resourceClaims": [entry],
        "containers": [{"name": c, "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}
                       for c in containers]}}


@dataclass
class DraNode:
    sim: NodeSimulator
    settings: Settings
    bus: Bus
    services: dict[str, Any] = field(default_factory=dict)
    _running: dict[str, AbstractAsyncContextManager[Any]] = field(default_factory=dict)

    # -- services ------------------------------------------------------------------------------------

    async def start_service(self, name: str) -> Any:
        app = _APPS[name]
        cm = app.service(self.settings, reconcile_period=1.0) if name == "watchdog" else app.service(self.settings)
        self.services[name] = await cm.__aenter__()
        self._running[name] = cm
        return self.services[name]

    async def stop_service(self, name: str) -> None:
        cm = self._running.pop(name, None)
        self.services.pop(name, None)
        if cm is not None:
            await cm.__aexit__(None, None, None)

    async def stop_all(self) -> None:
        for name in reversed(SERVICE_ORDER):
            await self.stop_service(name)

    # -- the ledger ----------------------------------------------------------------------------------

    async def snapshot(self) -> LedgerSnapshot:
        reply = await self.bus.request(self.bus.subjects.state, StateRequest(), StateReply, timeout=5)
        return reply.snapshot

    async def claim_grants(self) -> dict[str, Any]:
        """claim uid -> its grant in the ledger's state."""
        snap = await self.snapshot()
        return {a.alloc_id[len(CLAIM_PREFIX):]: a for a in snap.allocations if a.alloc_id.startswith(CLAIM_PREFIX)}

    # -- the simulated cluster -----------------------------------------------------------------------

    async def wait_registered(self, timeout: float = 20) -> None:
        watcher = self.sim.plugin_watcher
        assert watcher is not None
        await eventually(lambda: watcher.client(DRIVER_NAME) is not None, timeout=timeout, interval=0.05,
                         what="the DRA driver registered through the plugin watcher")

    async def wait_slice(self, devices: int, timeout: float = 20) -> dict[str, Any]:
        def published() -> dict[str, Any] | None:
            slices = self.sim.dra_objects.slices.list()
            if slices and len(slices[0]["spec"]["devices"]) == devices:
                return slices[0]
            return None

        return await eventually(published, timeout=timeout, interval=0.05,
                                what=f"the node's ResourceSlice with {devices} devices")

    async def run_pod(self, manifest: dict[str, Any], timeout: float = 20) -> dict[str, Any]:
        created = await self.sim.create_pod(manifest)
        return await self.sim.wait_for_pod("default", created["metadata"]["name"],
                                           lambda p: p["status"].get("phase") in ("Running", "Failed"), timeout)

    def claim_of(self, pod_name: str) -> dict[str, Any]:
        """The ResourceClaim of the pod's (first) claim entry."""
        pod = self.sim.get_pod("default", pod_name)
        assert pod is not None
        entry = pod["spec"]["resourceClaims"][0]
        name = entry.get("resourceClaimName") or next(
            s["resourceClaimName"] for s in pod["status"]["resourceClaimStatuses"] if s["name"] == entry["name"])
        claim = self.sim.dra_objects.claims.get("default", name)
        assert claim is not None, f"ResourceClaim default/{name} not found"
        return claim

    def calls(self, method: str) -> list[RpcCall]:
        return [c for c in self.sim.calls if c.method == method]

    def prepared_uids(self) -> list[str]:
        """Claim UIDs in successful NodePrepareResources calls, one entry per call and claim."""
        return [c["uid"] for call in self.calls("NodePrepareResources") if call.ok for c in call.request["claims"]]

    def enter_container(self, pod_uid: str, container_id: str) -> list[int]:
        """Make this test process a process of that container, as the vmanager sees it (fake /proc, cgroups)."""
        return enter_container(Path(self.settings.proc_root).parent, pod_uid, container_id)


async def start_dra_node(stack: AsyncExitStack, root: Path, url: str, settings: Settings, *,
                         device_plugin_cores: int, dra_devices: int) -> DraNode:
    sim = NodeSimulator(sim_config(root, settings))
    await sim.start()
    stack.push_async_callback(sim.stop)
    sim.dra_objects.classes.create(deviceclass())
    for template in claim_templates():
        sim.dra_objects.templates.create(template)
    bus = await Bus.connect(url, name="test", node=NODE)
    stack.push_async_callback(bus.close)
    node = DraNode(sim=sim, settings=settings, bus=bus)
    stack.push_async_callback(node.stop_all)
    for name in SERVICE_ORDER:
        await node.start_service(name)
    await sim.wait_for_resource(RESOURCE_VCORE, device_plugin_cores, timeout=20)
    await node.wait_registered()
    await node.wait_slice(dra_devices)
    return node


def container_id(pod: dict[str, Any], index: int = 0) -> str:
    return str(pod["status"]["containerStatuses"][index]["containerID"]).split("://", 1)[1]
