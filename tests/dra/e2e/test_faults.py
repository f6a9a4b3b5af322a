"""Claims through faults: the agent crashing, or the kubelet restarting, between prepare and container
start; the DRA driver absent for a while; a stale prepare after the unprepare; the CDI directory wiped
while the state directory is kept. The ledger stays the one record: nothing is prepared twice,
nothing is lost, nothing stale comes back."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import grpc

from libs.cdi import decode_spec, device_id, spec_file_name
from libs.kubelet.dra.v1 import api_pb2 as v1
from libs.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from libs.vcuda.client import register_vdevice
from libs.vcuda.config import decode
from tests.dra.e2e.helpers import SERVICE_ORDER, DraNode, claim_pod, claim_templates, container_id
from tests.polling import eventually


def _shared_claim(node: DraNode, name: str) -> dict[str, Any]:
    """A ResourceClaim of its own (not from a template: it outlives its pods), a 30-core share."""
    share = next(t for t in claim_templates() if t["metadata"]["name"] == "gpu-share")
    return node.sim.dra_objects.claims.create({"metadata": {"name": name, "namespace": "default"},
                                               "spec": share["spec"]["spec"]})


async def _held_after_prepare(node: DraNode, pod_name: str, template: str = "gpu-share") -> str:
    """Create the pod with the kubelet holding it between prepare and container start; its claim's uid."""
    assert node.sim.dra is not None
    node.sim.dra.gate = asyncio.Event()
    await node.sim.create_pod(claim_pod(pod_name, template))
    await eventually(lambda: node.prepared_uids(), timeout=10, interval=0.05, what="the claim prepared")
    pod = node.sim.get_pod("default", pod_name)
    assert pod is not None and pod["status"]["phase"] == "Pending", pod and pod["status"]
    assert pod["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] == "ContainerCreating"
    return node.claim_of(pod_name)["metadata"]["uid"]


async def _vcuda_config(node: DraNode, pod: dict[str, Any]) -> tuple[int, int]:
    uid = pod["metadata"]["uid"]
    vm_dir = node.settings.vm_root / node.claim_of(pod["metadata"]["name"])["metadata"]["uid"]
    node.enter_container(uid, container_id(pod))
    await register_vdevice(str(vm_dir / "vcuda.sock"), pod_uid=uid, container_name="main", timeout=5)
    cfg = decode((vm_dir / "main" / "vcuda.config").read_bytes())
    return cfg.utilization, cfg.gpu_memory


async def test_agent_crash_between_prepare_and_container_start(dra_node: DraNode) -> None:
    node = dra_node
    claim_uid = await _held_after_prepare(node, "held")
    await node.stop_all()  # the whole agent goes away with the claim prepared, the container not started
    for name in SERVICE_ORDER:
        await node.start_service(name)
    await node.wait_registered()
    assert claim_uid in await node.claim_grants()  # replayed from the event log, not from a checkpoint

    assert node.sim.dra is not None and node.sim.dra.gate is not None
    node.sim.dra.gate.set()
    pod = await node.sim.wait_for_pod("default", "held", lambda p: p["status"].get("phase") == "Running", 20)
    assert node.prepared_uids() == [claim_uid]  # the kubelet's claim cache: no second prepare
    opts = node.sim.container_run_options("default", "held", "main")
    assert opts["cdi_devices"] == [device_id(claim_uid)] and opts["envs"]["NVIDIA_VISIBLE_DEVICES"]
    assert await _vcuda_config(node, pod) == (30, 4 << 30)  # the restarted vmanager serves the claim


async def test_kubelet_restart_between_prepare_and_container_start(dra_node: DraNode) -> None:
    node = dra_node
    claim_uid = await _held_after_prepare(node, "held")
    registrations = len(node.calls("GetInfo"))
    await node.sim.restart_kubelet()
    await eventually(lambda: len(node.calls("GetInfo")) > registrations and node.sim.plugin_watcher is not None
                     and node.sim.plugin_watcher.client("gpu.gpuledger.io") is not None,
                     timeout=10, interval=0.05, what="the DRA plugin registered again after the kubelet restart")
    registrar = node.services["registrar"]
    assert registrar.dra.registration.status.plugin_registered

    assert node.sim.dra is not None and node.sim.dra.gate is not None
    node.sim.dra.gate.set()
    await node.sim.wait_for_pod("default", "held", lambda p: p["status"].get("phase") == "Running", 20)
    assert node.prepared_uids() == [claim_uid]  # restored from dra_manager_state, not prepared blindly again

    await node.sim.delete_pod("default", "held")
    await eventually(lambda: [c for c in node.calls("NodeUnprepareResources") if c.ok], timeout=10,
                     interval=0.05, what="the claim unprepared after the restart")
    assert claim_uid not in await node.claim_grants()


async def test_pod_waits_in_container_creating_while_the_driver_is_away(dra_node: DraNode) -> None:
    node = dra_node
    await node.stop_service("registrar")
    await node.sim.create_pod(claim_pod("early", "gpu-share"))

    def waiting_message() -> str:
        pod = node.sim.get_pod("default", "early")
        state = (pod["status"].get("containerStatuses") or [{}])[0].get("state", {}) if pod else {}
        return str(state.get("waiting", {}).get("message", ""))

    message = await eventually(waiting_message, timeout=10, interval=0.05, what="the prepare error on the pod")
    assert "failed to prepare dynamic resources" in message
    assert "gpu.gpuledger.io not found in the list of registered DRA plugins" in message
    assert node.sim.get_pod("default", "early")["status"]["phase"] == "Pending"  # type: ignore[index]

    await node.start_service("registrar")
    pod = await node.sim.wait_for_pod("default", "early", lambda p: p["status"].get("phase") == "Running", 20)
    assert "message" not in pod["status"]["containerStatuses"][0]["state"].get("running", {})


async def test_stale_prepare_after_unprepare_is_refused(dra_node: DraNode) -> None:
    node = dra_node
    _shared_claim(node, "mine")
    await node.run_pod(claim_pod("user", claim="mine"))
    as_prepared = node.sim.dra_objects.claims.get("default", "mine")
    assert as_prepared is not None
    claim_uid = as_prepared["metadata"]["uid"]
    await node.sim.delete_pod("default", "user")
    await eventually(lambda: [c for c in node.calls("NodeUnprepareResources") if c.ok], timeout=10,
                     interval=0.05, what="the claim unprepared")

    # A retry that lost the race with its unprepare: the claim still reads as it did when prepared.
    def as_before(c: dict[str, Any]) -> None:
        c["status"] = as_prepared["status"]

    node.sim.dra_objects.claims.update("default", "mine", as_before)
    endpoint = node.services["registrar"].dra.endpoint
    async with grpc.aio.insecure_channel(f"unix://{endpoint}") as ch:
        resp = await v1_grpc.DRAPluginStub(ch).NodePrepareResources(v1.NodePrepareResourcesRequest(
            claims=[v1.Claim(namespace="default", uid=claim_uid, name="mine")]), timeout=45)
    assert "stale prepare refused" in resp.claims[claim_uid].error
    assert claim_uid not in await node.claim_grants()
    assert not (Path(node.settings.cdi_dir) / spec_file_name(claim_uid)).exists()


async def test_cdi_specs_rebuilt_after_the_cdi_directory_is_wiped(dra_node: DraNode) -> None:
    node = dra_node
    _shared_claim(node, "shared")
    first = await node.run_pod(claim_pod("first", claim="shared"))
    assert first["status"]["phase"] == "Running", first["status"]
    claim_uid = node.claim_of("first")["metadata"]["uid"]
    spec = Path(node.settings.cdi_dir) / spec_file_name(claim_uid)
    before = decode_spec(spec.read_bytes())

    # A "reboot": the agent stops, /var/run/cdi (a tmpfs) comes back empty, the state dir is kept.
    await node.stop_all()
    shutil.rmtree(node.settings.cdi_dir)
    for name in SERVICE_ORDER:
        await node.start_service(name)
    await node.wait_registered()
    after = decode_spec(spec.read_bytes())
    assert (after.kind, after.devices) == (before.kind, before.devices)

    # A second pod of the same claim: no new prepare (the kubelet has it prepared), the CDI ID resolves.
    second = await node.run_pod(claim_pod("second", claim="shared"))
    assert second["status"]["phase"] == "Running", second["status"]
    assert node.prepared_uids() == [claim_uid]
    assert node.sim.container_run_options("default", "second", "main")["envs"] == \
        node.sim.container_run_options("default", "first", "main")["envs"]
