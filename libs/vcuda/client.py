"""The host-side gpu-client: one RegisterVDevice call on a pod's vcuda.sock, always bounded in time.

gpu-manager's gpu-client dials with a blocking dial and no deadline, so a missing manager hangs the
CUDA application forever (gpu-manager-reference.md 5.7). Here the whole call, dial included, ends
within ``timeout`` seconds, with an error that says what was missing.
"""

from __future__ import annotations

import asyncio
import os

import grpc

from libs.errors import GpuledgerError
from libs.vcuda import api_pb2 as pb
from libs.vcuda import api_pb2_grpc as pb_grpc

__all__ = ["VcudaClientError", "register_vdevice"]

# A short-lived client should notice a socket that appears a moment later, not back off for seconds.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    # A connection of its own, never one shared with other channels of this process: the vmanager
    # judges the caller once per connection (SO_PEERCRED at connect time).
    ("grpc.use_local_subchannel_pool", 1),
]


class VcudaClientError(GpuledgerError):
    """RegisterVDevice failed; ``code`` is the gRPC status when the server answered one."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


async def register_vdevice(
    addr: str,
    *,
    pod_uid: str,
    bus_id: str = "",
    container_id: str = "",
    container_name: str = "",
    timeout: float = 10.0,
) -> None:
    """Register one container with the vmanager listening on the unix socket ``addr``."""
    if bool(container_id) == bool(container_name):
        raise ValueError("give exactly one of container_id and container_name")
    if not pod_uid:
        raise ValueError("pod_uid is required")
    if timeout <= 0:
        raise ValueError("timeout must be positive")
    path = os.path.abspath(addr)  # unix://<path> wants an absolute path
    request = pb.VDeviceRequest(
        bus_id=bus_id, pod_uid=pod_uid, container_name=container_name, container_id=container_id
    )
    try:
        # The outer bound is a safety net: grpc's own deadline below should always fire first.
        async with asyncio.timeout(timeout + 1.0):
            async with grpc.aio.insecure_channel(f"unix://{path}", options=_CHANNEL_OPTIONS) as channel:
                stub = pb_grpc.VCUDAServiceStub(channel)
                await stub.RegisterVDevice(request, timeout=timeout, wait_for_ready=True)
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise VcudaClientError(_unreachable(path, timeout), code) from None
        message = f"RegisterVDevice on {path} failed: {code.name}: {exc.details()}"
        raise VcudaClientError(message, code) from None
    except TimeoutError:
        raise VcudaClientError(_unreachable(path, timeout), grpc.StatusCode.DEADLINE_EXCEEDED) from None


def _unreachable(path: str, timeout: float) -> str:
    if not os.path.exists(path):
        return (f"no socket at {path}: is the gpuledger vmanager running and was the pod prepared? "
                f"(waited {timeout:g}s)")
    return f"no answer from the vmanager on {path} within {timeout:g}s (socket present, nobody listening?)"
