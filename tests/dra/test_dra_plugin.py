"""The DRA kubelet plugin against the running allocator and registrar (real nats-server, real gRPC over
unix sockets, a real HTTP API for ResourceClaims): registration, prepare/unprepare idempotent and
answering every claim, stale prepare and overcommit refused, prepared set replayed after an allocator
restart, CDI specs rebuilt after the CDI directory is wiped, claims on the ledger's history."""

from __future__ import annotations

import json
import shutil
from contextlib import AsyncExitStack
from pathlib import Path

import grpc

from libs.bus.server import NatsServer
from libs.cdi import device_id, spec_file_name
from libs.config import Settings
from libs.kubelet.dra.v1 import api_pb2 as v1
from libs.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from libs.kubelet.dra.v1beta1 import api_pb2 as v1beta1
from libs.kubelet.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from libs.kubelet.drahealth.v1 import api_pb2 as hpb
from libs.kubelet.drahealth.v1 import api_pb2_grpc as hpb_grpc
from libs.kubelet.pluginregistration.v1 import api_pb2 as reg
from libs.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from libs.ledger.timeline import pod_history
from services.allocator import app as allocator_app
from services.registrar import app as registrar_app
from tests.dra.helpers import ClaimApi

GIB = 1 << 30
POD_A = "aaaaaaaa-0000-0000-0000-000000000001"
POD_B = "aaaaaaaa-0000-0000-0000-000000000002"


def _settings(short_dir: Path, nats: NatsServer, kubeconfig: str) -> Settings:
    return Settings(node_name="n1", state_dir=str(short_dir / "s"), device_plugin_dir=str(short_dir / "dp"),
                    nats_url=nats.url, gpus="fake", kubeconfig=kubeconfig, dra_gpus="0,1",
                    kubelet_plugins_dir=str(short_dir / "plugins"), plugins_registry_dir=str(short_dir / "reg"),
                    cdi_dir=str(short_dir / "cdi"), health_checks=False)


def _claim(uid: str, name: str) -> v1.Claim:
    return v1.Claim(namespace="default", uid=uid, name=name)


async def test_dra_plugin_end_to_end(nats_server: NatsServer, short_dir: Path) -> None:
    (short_dir / "dp").mkdir()
    with ClaimApi() as api:
        settings = _settings(short_dir, nats_server, api.kubeconfig(short_dir / "kubeconfig"))
        api.put("default", "share", "c-share", node="n1", devices=[("gpu-0", 60, 2 * GIB)], pods=[("a", POD_A)])
        api.put("default", "big", "c-big", node="n1", devices=[("gpu-0", 50, GIB)], pods=[("b", POD_B)])
        api.put("default", "dp-gpu", "c-dp", node="n1", devices=[("gpu-2", 10, GIB)], pods=[("b", POD_B)])
        async with AsyncExitStack() as stack:
            allocator = await stack.enter_async_context(allocator_app.service(settings))
            registrar = await stack.enter_async_context(registrar_app.service(settings))
            assert registrar.dra is not None
            # The plugin watcher's view: GetInfo on the registration socket.
            async with grpc.aio.insecure_channel(f"unix://{settings.dra_registration_socket}") as ch:
                info = await reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest(), timeout=1)
                assert (info.type, info.name) == ("DRAPlugin", "gpu.gpuledger.io")
                assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
                assert info.endpoint == str(settings.dra_plugin_socket)
                await reg_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=True), timeout=5)
            assert registrar.dra.registration.registered.is_set()

            async with grpc.aio.insecure_channel(f"unix://{info.endpoint}") as ch:
                stub = v1_grpc.DRAPluginStub(ch)
                # The claims of one request are prepared together: of two that overcommit one GPU,
                # either may come first. c-share is prepared alone first, so c-big is the one refused.
                first = await stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=[_claim("c-share", "share")]), timeout=45)
                assert first.claims["c-share"].error == ""
                asked = [_claim("c-share", "share"), _claim("c-missing", "missing"), _claim("c-big", "big"),
                         _claim("c-dp", "dp-gpu")]
                resp = await stub.NodePrepareResources(v1.NodePrepareResourcesRequest(claims=asked), timeout=45)
                assert set(resp.claims) == {"c-share", "c-missing", "c-big", "c-dp"}  # every claim answered
                ok = resp.claims["c-share"]
                assert ok.error == ""
                assert [(d.pool_name, d.device_name, list(d.cdi_device_ids), d.share_id) for d in ok.devices] == \
                    [("n1", "gpu-0", [device_id("c-share")], "s-c-share-0")]
                assert "not found" in resp.claims["c-missing"].error
                assert "overcommit GPU0" in resp.claims["c-big"].error  # 60 + 50 cores > 100
                assert "served by the device plugin" in resp.claims["c-dp"].error
                # Idempotent: the same answer, nothing new on the ledger.
                seq = allocator.ledger.state.seq
                again = await stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=[_claim("c-share", "share")]), timeout=45)
                assert again.claims["c-share"] == ok and allocator.ledger.state.seq == seq
                # v1beta1 speaks the same service (no share_id there).
                beta = await v1beta1_grpc.DRAPluginStub(ch).NodePrepareResources(
                    v1beta1.NodePrepareResourcesRequest(claims=[v1beta1.Claim(namespace="default", uid="c-share",
                                                                              name="share")]), timeout=45)
                assert beta.claims["c-share"].devices[0].device_name == "gpu-0"
                # The CDI spec carries the devices, the GPU, and the claim's vcuda directory.
                spec = json.loads((Path(settings.cdi_dir) / spec_file_name("c-share")).read_text())
                edits = spec["devices"][0]["containerEdits"]
                assert spec["kind"] == "gpuledger.io/claim" and spec["devices"][0]["name"] == "c-share"
                assert any(e.startswith("NVIDIA_VISIBLE_DEVICES=") for e in edits["env"])
                gpu0 = {"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0", "permissions": "rwm"}
                assert gpu0 in edits["deviceNodes"]
                assert any(m["containerPath"] == "/etc/vcuda" and m["hostPath"].endswith("/c-share")
                           for m in edits["mounts"])
                # Health stream: the complete list of DRA GPUs.
                async for msg in hpb_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
                        hpb.NodeWatchResourcesRequest(), timeout=5):
                    assert sorted(d.device.device_name for d in msg.devices) == ["gpu-0", "gpu-1"]
                    assert all(d.health == hpb.HEALTHY for d in msg.devices)
                    break
                # The device plugin no longer advertises GPUs 0 and 1.
                assert len(registrar.catalog.ids("tencent.com/vcuda-core")) == 100 * (
                    len(allocator.ledger.state.gpus) - 2)

        # The allocator "crashes" (stops) between the prepare and the next call: replay gives the prepared set.
        shutil.rmtree(settings.cdi_dir)  # and the CDI directory is wiped (a reboot)
        async with AsyncExitStack() as stack:
            allocator = await stack.enter_async_context(allocator_app.service(settings))
            assert set(allocator.ledger.state.claims()) == {"c-share"}
            registrar = await stack.enter_async_context(registrar_app.service(settings))
            assert (Path(settings.cdi_dir) / spec_file_name("c-share")).is_file()  # rebuilt from the ledger
            async with grpc.aio.insecure_channel(f"unix://{settings.dra_plugin_socket}") as ch:
                stub = v1_grpc.DRAPluginStub(ch)
                req = v1.NodeUnprepareResourcesRequest(claims=[_claim("c-share", "share"), _claim("c-x", "x")])
                un = await stub.NodeUnprepareResources(req, timeout=45)
                assert {k: v.error for k, v in un.claims.items()} == {"c-share": "", "c-x": ""}
                assert not (Path(settings.cdi_dir) / spec_file_name("c-share")).exists()
                un2 = await stub.NodeUnprepareResources(req, timeout=45)  # idempotent
                assert un2.claims["c-share"].error == ""
                # A stale prepare (a retry after the unprepare, for no new pod) is refused.
                stale = await stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=[_claim("c-share", "share")]), timeout=45)
                assert "stale prepare refused" in stale.claims["c-share"].error
                # The claim was freed: the 50-core claim fits now.
                big = await stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=[_claim("c-big", "big")]), timeout=45)
                assert big.claims["c-big"].error == ""

    history = pod_history(settings.log_path, POD_A)
    assert [e.type for e in history] == ["claim.prepared", "claim.unprepared"]
    assert "DRA claim default/share" in history[0].detail
