"""The kubelet's side of one device-plugin connection: the gRPC client and the endpoint.

`PluginClient` is upstream's `plugin/v1beta1/client.go` (dial, one ListAndWatch stream, close);
`Endpoint` is `endpoint.go` (options, stop time, and the three RPCs the manager makes, which fail
at once with "endpoint ... has been stopped" after the stream ended).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as dp
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc

from .calls import CallLog, describe_error, message_dict
from .logger import logger

__all__ = ["ChannelClosedError", "DialError", "Endpoint", "PluginClient", "bounded", "unary"]

_logger = logger("endpoints")

# What the stream handler gets for each ListAndWatch message.
SnapshotReceiver = Callable[[str, dp.ListAndWatchResponse], None]


class DialError(Exception):
    pass


CONNECTION_CLOSING = "rpc error: code = Canceled desc = grpc: the client connection is closing"


class ChannelClosedError(ConnectionError):
    """The call died because the kubelet side closed the connection (restart, the re-registration
    bug). grpc.aio reports that as CancelledError, which must not look like task cancellation."""


async def unary(call: grpc.aio.UnaryUnaryCall) -> Any:
    try:
        return await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # we are being cancelled (or timed out): let it through
        raise ChannelClosedError(CONNECTION_CLOSING) from None


async def bounded(call: grpc.aio.UnaryUnaryCall, timeout: float, name: str) -> Any:
    """Await a unary call for at most `timeout`; on expiry cancel it locally (no gRPC deadline,
    so the plugin sees what a kubelet without deadline would send) and raise TimeoutError."""
    try:
        async with asyncio.timeout(timeout):
            return await unary(call)
    except TimeoutError:
        raise TimeoutError(
            f"{name} did not return within {timeout:g}s (a real kubelet would wait forever)"
        ) from None
    finally:
        if not call.done():
            call.cancel()


class PluginClient:
    """One connection to a plugin socket. It is never re-dialled and runs exactly one stream."""

    def __init__(self, resource: str, socket: str, calls: CallLog) -> None:
        self.resource = resource
        self.socket = socket
        self._calls = calls
        self._channel: grpc.aio.Channel | None = None
        self.stub: dp_grpc.DevicePluginStub | None = None

    def __repr__(self) -> str:
        return f"PluginClient({self.resource!r}, {self.socket!r})"

    async def dial(self, timeout: float) -> None:
        """Blocking dial like the kubelet's: wait until the socket answers, at most `timeout`."""
        # Authority "localhost" as the kubelet's unix dialer sends; no keepalive, default 4 MiB
        # receive limit (grpc's default too), so an oversized snapshot kills the stream as upstream.
        channel = grpc.aio.insecure_channel(
            f"unix://{self.socket}", options=[("grpc.default_authority", "localhost")]
        )
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout)
        except TimeoutError:
            await channel.close()
            raise DialError("failed to dial device plugin: context deadline exceeded") from None
        except BaseException:
            await channel.close()
            raise
        self._channel = channel
        self.stub = dp_grpc.DevicePluginStub(channel)

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def run(self, receiver: SnapshotReceiver) -> None:
        """Receive ListAndWatch snapshots until the stream ends, however it ends."""
        call_rec = self._calls.begin("ListAndWatch", self.resource, dp.Empty(), self.socket)
        call_rec.response = {"messages": 0, "last": None}
        try:
            if self.stub is None:
                raise DialError("client is not connected")
            stream = self.stub.ListAndWatch(dp.Empty())
            async for msg in stream:
                call_rec.response = {"messages": call_rec.response["messages"] + 1, "last": message_dict(msg)}
                receiver(self.resource, msg)
            _logger.info("ListAndWatch returned", resource=self.resource)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                call_rec.error = "cancelled"
                raise
            # grpc.aio reports a call cancelled by our own channel close as CancelledError.
            call_rec.error = CONNECTION_CLOSING
        except Exception as err:
            call_rec.error = describe_error(err)
            _logger.info("ListAndWatch ended", resource=self.resource, error=call_rec.error)
        finally:
            call_rec.end = time.monotonic()


class Endpoint:
    """What the manager knows of a registered plugin. `client` is None for endpoints rebuilt from
    the checkpoint at kubelet start: those are stopped from birth and have no options."""

    def __init__(
        self,
        resource: str,
        client: PluginClient | None,
        options: dp.DevicePluginOptions | None,
        calls: CallLog,
        *,
        stopped_at: float | None = None,
    ) -> None:
        self.resource = resource
        self.client = client
        self.options = options
        self.stop_time = stopped_at
        self._calls = calls

    def __str__(self) -> str:
        return f"&{{{self.resource} {self.client.socket if self.client else ''}}}"

    @property
    def socket(self) -> str:
        return self.client.socket if self.client else ""

    def is_stopped(self) -> bool:
        return self.stop_time is not None

    def set_stopped(self) -> None:
        self.stop_time = time.monotonic()

    def grace_expired(self, grace: float) -> bool:
        return self.stop_time is not None and time.monotonic() - self.stop_time > grace

    def _stub(self) -> dp_grpc.DevicePluginStub:
        if self.is_stopped() or self.client is None or self.client.stub is None:
            raise RuntimeError(f"endpoint {self} has been stopped")
        return self.client.stub

    async def allocate(self, ids: list[str], timeout: float) -> dp.AllocateResponse:
        """One ContainerAllocateRequest per call, as the kubelet always sends.

        The kubelet has no deadline here; `timeout` is the simulator's watchdog. It cancels the
        call locally, so the plugin never sees a deadline it would not see from a kubelet.
        """
        req = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)])
        with self._calls.record("Allocate", self.resource, req, self.socket) as rec:
            stub = self._stub()
            resp = await bounded(stub.Allocate(req), timeout, "Allocate")
            rec.response = resp
            return resp

    async def get_preferred_allocation(
        self, available: list[str], must_include: list[str], size: int, timeout: float
    ) -> dp.PreferredAllocationResponse:
        req = dp.PreferredAllocationRequest(
            container_requests=[
                dp.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size
                )
            ]
        )
        with self._calls.record("GetPreferredAllocation", self.resource, req, self.socket) as rec:
            stub = self._stub()
            resp = await bounded(stub.GetPreferredAllocation(req), timeout, "GetPreferredAllocation")
            rec.response = resp
            return resp

    async def pre_start_container(self, ids: list[str], timeout: float) -> dp.PreStartContainerResponse:
        req = dp.PreStartContainerRequest(devices_ids=ids)
        with self._calls.record("PreStartContainer", self.resource, req, self.socket) as rec:
            stub = self._stub()
            # A real deadline this time: the kubelet sends one (30 s).
            resp = await unary(stub.PreStartContainer(req, timeout=timeout))
            rec.response = resp
            return resp
