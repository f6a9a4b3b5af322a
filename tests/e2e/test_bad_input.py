"""Bad input at every door gets a clear error, writes nothing outside its place, and loses nothing."""

from __future__ import annotations

from pathlib import Path

import grpc
import nats
import pytest

from libs.commands import AllocateReply, AllocateRequest, ReleaseReply, ReleaseRequest
from libs.errors import RemoteError
from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from libs.vcuda.client import VcudaClientError, register_vdevice
from tests.builders import gpu_pod
from tests.e2e.helpers import Node

VCORE = "tencent.com/vcuda-core"


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
async def plugin(node: Node):  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(f"unix://{node.settings.device_plugin_dir}/vcore.sock") as ch:
        yield pb_grpc.DevicePluginStub(ch)


def alloc(*ids: str) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))])


@pytest.mark.parametrize(
    ("request_", "code", "text"),
    [
        (pb.AllocateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "exactly one container request"),
        (pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"{VCORE}-1"])] * 2),
         grpc.StatusCode.INVALID_ARGUMENT, "exactly one container request"),
        (alloc(), grpc.StatusCode.INVALID_ARGUMENT, "no tencent.com/vcuda-core device IDs"),
        (alloc(f"{VCORE}-3", f"{VCORE}-3"), grpc.StatusCode.INVALID_ARGUMENT, "duplicate device IDs"),
        (alloc(f"{VCORE}-400"), grpc.StatusCode.INVALID_ARGUMENT, "never advertised"),
        (alloc("tencent.com/vcuda-memory-268435456-0"), grpc.StatusCode.INVALID_ARGUMENT, "never advertised"),
        (alloc(*(f"{VCORE}-{i}" for i in range(100_000))), grpc.StatusCode.INVALID_ARGUMENT, "100000"),
        (alloc(f"{VCORE}-7"), grpc.StatusCode.NOT_FOUND, "candidate pod not found"),
    ],
)
async def test_bad_allocates_are_refused_clearly(node: Node, plugin, request_, code, text) -> None:  # type: ignore[no-untyped-def]
    before = await node.snapshot()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plugin.Allocate(request_, timeout=15)
    assert err.value.code() == code
    assert text in err.value.details()
    after = await node.snapshot()
    assert after.allocations == before.allocations and after.gpus == before.gpus


async def test_prestart_for_devices_nobody_holds(node: Node, plugin) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plugin.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[f"{VCORE}-9"]), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details().startswith("PreStartContainer check failed")


async def test_allocator_requests_are_validated_and_refusals_recorded(node: Node) -> None:
    pod = await node.run_pod(gpu_pod("keep", ("c", 50, 2)))
    before = await node.snapshot()
    with pytest.raises(RemoteError) as err:
        await node.bus.request(node.bus.subjects.allocate, AllocateRequest(
            request_id="r1", resource="nvidia.com/gpu", device_ids=[f"{VCORE}-1"]), AllocateReply, timeout=5)
    assert err.value.code == 400 and "not 'nvidia.com/gpu'" in err.value.message
    with pytest.raises(RemoteError) as err:
        await node.bus.request(node.bus.subjects.allocate, AllocateRequest(
            request_id="r2", resource=VCORE, device_ids=["../../etc/passwd"]), AllocateReply, timeout=5)
    assert err.value.code == 400
    nc = await nats.connect(node.settings.nats_url)
    reply = await nc.request(node.bus.subjects.allocate, b"{not json", timeout=5)
    await nc.close()
    assert reply.headers and reply.headers["Nats-Service-Error-Code"] == "400"
    released = await node.bus.request(node.bus.subjects.release,
                                      ReleaseRequest(pod_uid="no-such-pod", reason="test"), ReleaseReply, timeout=5)
    assert released.released == []

    after = await node.snapshot()
    assert after.allocations == before.allocations  # nothing already recorded was lost
    refusals = await node.tap.wait("alloc.refused", 2)
    assert {r.data["request_id"] for r in refusals} >= {"r1", "r2"}
    assert pod["status"]["phase"] == "Running"


@pytest.mark.parametrize(
    ("pod_uid", "cont_id", "cont_name", "code"),
    [
        ("../../etc", "abc123", "", grpc.StatusCode.INVALID_ARGUMENT),
        ("11111111-2222-3333-4444-555555555555", "abc123", "", grpc.StatusCode.INVALID_ARGUMENT),
        (None, "../../../etc", "", grpc.StatusCode.INVALID_ARGUMENT),
        (None, "a/b", "", grpc.StatusCode.INVALID_ARGUMENT),
        (None, "", "../x", grpc.StatusCode.INVALID_ARGUMENT),
        (None, "f" * 64, "", grpc.StatusCode.NOT_FOUND),
    ],
)
async def test_register_vdevice_cannot_escape_the_pod_directory(node: Node, pod_uid, cont_id, cont_name, code) -> None:  # type: ignore[no-untyped-def]
    pod = await node.run_pod(gpu_pod("reg", ("c", 50, 2)))
    uid = pod["metadata"]["uid"]
    root = node.settings.vm_root
    own = next(s["containerID"] for s in pod["status"]["containerStatuses"]).split("://", 1)[1]
    node.enter_container(uid, cont_id if cont_id == "f" * 64 else own)  # the caller: a process of the pod
    before = tree(root)
    with pytest.raises(VcudaClientError) as err:
        await register_vdevice(str(root / uid / "vcuda.sock"), pod_uid=pod_uid or uid,
                               container_id=cont_id, container_name=cont_name, timeout=10)
    assert err.value.code == code
    assert tree(root) == before
    assert not (root.parent / "etc").exists()
