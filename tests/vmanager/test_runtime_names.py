"""A registering container's name from the CRI runtime (--container-runtime-endpoint), gpu-manager's
way, and the fallback to the pod's status through the watchdog when the runtime cannot say.

The runtime is a real gRPC server on a unix socket answering ``runtime.v1`` ContainerStatus (the
project's own stubs); the vmanager, its ledger and the watchdog's subject are the usual real parts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from libs.bus import Bus
from libs.config import Settings
from libs.vcuda import VcudaClientError, register_vdevice
from services.vmanager.metrics import VmanagerCollector
from tests.builders.cgroups import enter_container
from tests.vmanager.helpers import (
    BLOCK,
    FakeRuntime,
    FakeWatchdog,
    Ledger,
    granted,
    new_container_id,
    new_pod_uid,
    pod,
    prepared,
    register,
    running_vmanager,
    with_runtime,
)


async def test_the_runtime_names_the_container_before_the_pod_status_does(
    settings: Settings, ledger: Ledger, watchdog: FakeWatchdog, client_bus: Bus, runtime: FakeRuntime
) -> None:
    # The watchdog knows nothing of the pod yet (the kubelet has not written the status): only the
    # runtime can name the container, as it does from the container's creation.
    uid, cid = new_pod_uid(), new_container_id()
    runtime.add(cid, "trainer", uid)
    async with running_vmanager(with_runtime(settings, runtime.socket, scheme=True)) as svc:
        sock = await prepared(ledger, client_bus, uid, granted(uid, "trainer", cores=30, memory=3 * BLOCK))
        await register(sock, pod_uid=uid, container_id=cid, timeout=5)
        written = (settings.vm_root / uid / cid / "vcuda.config").read_bytes()
        assert written[0x1000:0x1007] == b"trainer"
        assert runtime.calls == [cid]
        assert watchdog.calls == []
        assert svc.registrations.names.resolved == {"runtime": 1}
        # /metrics says so too
        collected = {f.name: f for f in VmanagerCollector(svc.tracker, svc.sockets, svc.registrations.names).collect()}
        samples = {s.labels["via"]: s.value for s in collected["gpuledger_vmanager_container_names"].samples}
        assert samples == {"runtime": 1, "watchdog": 0}


async def test_a_container_of_another_pod_is_refused_by_the_runtime(
    settings: Settings, ledger: Ledger, watchdog: FakeWatchdog, client_bus: Bus, runtime: FakeRuntime
) -> None:
    uid, other, cid = new_pod_uid(), new_pod_uid(), new_container_id()
    runtime.add(cid, "trainer", other)  # the id is another pod's container
    watchdog.add(pod(uid, {"trainer": cid}))  # even a pod status that claims it does not win
    async with running_vmanager(with_runtime(settings, runtime.socket)):
        sock = await prepared(ledger, client_bus, uid, granted(uid, "trainer"))
        with pytest.raises(VcudaClientError) as err:
            await register(sock, pod_uid=uid, container_id=cid, timeout=5)
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert f"is a container of pod {other}" in str(err.value)
        assert not (settings.vm_root / uid / cid).exists()


async def test_the_runtime_is_asked_when_an_admitted_caller_connects(
    settings: Settings, ledger: Ledger, watchdog: FakeWatchdog, client_bus: Bus, runtime: FakeRuntime
) -> None:
    # The gate asks for the caller's own container as soon as it has admitted the connection, while
    # the request is still on its way; the registration then uses that answer instead of asking again.
    uid, other, cid, stranger = new_pod_uid(), new_pod_uid(), new_container_id(), new_container_id()
    runtime.add(cid, "trainer", uid)
    async with running_vmanager(with_runtime(settings, runtime.socket)) as svc:
        sock = await prepared(ledger, client_bus, uid, granted(uid, "trainer", cores=30, memory=3 * BLOCK))
        enter_container(sock.parents[2], uid, cid)
        _reader, writer = await asyncio.open_unix_connection(str(sock))  # connected, nothing sent
        try:
            async with asyncio.timeout(5):
                while runtime.calls != [cid]:  # noqa: ASYNC110 (the fake runtime records the call)
                    await asyncio.sleep(0.01)
        finally:
            writer.close()
        await register(sock, pod_uid=uid, container_id=cid, timeout=5)  # a new connection: one more call
        assert runtime.calls == [cid, cid]
        assert svc.registrations.names.resolved == {"runtime": 1}

        # A caller the gate refuses (another pod's process) starts nothing.
        enter_container(sock.parents[2], other, stranger)
        _reader, writer = await asyncio.open_unix_connection(str(sock))
        writer.close()
        with pytest.raises(VcudaClientError) as err:
            await register_vdevice(str(sock), pod_uid=uid, container_id=stranger, timeout=5)
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert runtime.calls == [cid, cid]
        assert watchdog.calls == []


@pytest.mark.parametrize("trouble", ["absent", "slow", "unknown container", "no kubelet labels"])
async def test_the_watchdog_answers_when_the_runtime_cannot(
    settings: Settings, ledger: Ledger, watchdog: FakeWatchdog, client_bus: Bus, runtime: FakeRuntime,
    trouble: str,
) -> None:
    uid, cid = new_pod_uid(), new_container_id()
    watchdog.add(pod(uid, {"trainer": cid}))
    socket = runtime.socket
    if trouble == "absent":
        socket = runtime.socket.with_name("none.sock")
    elif trouble == "slow":
        runtime.add(cid, "trainer", uid)
        runtime.delay = 3.0  # far beyond the vmanager's wait (half its 1 s lookup patience)
    elif trouble == "no kubelet labels":
        runtime.add(cid, "trainer", uid)
        runtime.labelled = False
    async with running_vmanager(with_runtime(settings, socket)) as svc:
        sock = await prepared(ledger, client_bus, uid, granted(uid, "trainer", cores=30, memory=3 * BLOCK))
        await register(sock, pod_uid=uid, container_id=cid, timeout=5)
        assert (settings.vm_root / uid / cid / "vcuda.config").read_bytes()[0x1000:0x1007] == b"trainer"
        assert svc.registrations.names.resolved == {"watchdog": 1}
        assert [call.uid for call in watchdog.calls][:1] == [uid]
        assert runtime.calls == ([] if trouble == "absent" else [cid])


async def test_without_a_runtime_endpoint_the_runtime_is_never_asked(
    settings: Settings, ledger: Ledger, watchdog: FakeWatchdog, client_bus: Bus, runtime: FakeRuntime
) -> None:
    uid, cid = new_pod_uid(), new_container_id()
    runtime.add(cid, "trainer", uid)
    watchdog.add(pod(uid, {"trainer": cid}))
    assert settings.container_runtime_endpoint == ""
    async with running_vmanager(settings) as svc:
        sock = await prepared(ledger, client_bus, uid, granted(uid, "trainer"))
        await register(sock, pod_uid=uid, container_id=cid, timeout=5)
        assert svc.registrations.names.resolved == {"watchdog": 1}
        assert runtime.calls == []


def test_a_relative_runtime_endpoint_is_refused() -> None:
    with pytest.raises(Exception, match="container_runtime_endpoint must be an absolute socket path"):
        Settings(container_runtime_endpoint="run/containerd.sock")
    assert Settings(container_runtime_endpoint="unix:///run/c.sock").runtime_socket == Path("/run/c.sock")


async def test_an_answer_that_does_not_parse_names_nothing(tmp_path: Path) -> None:
    """A runtime whose ContainerStatus answer is not a ContainerStatusResponse: no name (the caller
    falls back to the watchdog), and the lookup itself does not fail."""
    from services.vmanager.runtimenames import RuntimeNames

    async def garbage(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"\xff\xff\xff"

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "runtime.v1.RuntimeService", {"ContainerStatus": grpc.unary_unary_rpc_method_handler(garbage)}),))
    socket = tmp_path / "garbage.sock"
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    names = RuntimeNames(socket, timeout=1.0)
    try:
        assert await names.lookup(new_pod_uid(), new_container_id()) is None
        assert await names.lookup(new_pod_uid(), new_container_id(), quiet=True) is None
    finally:
        await names.close()
        await server.stop(0)
