"""The gpu-client never hangs: a missing socket or a socket nobody serves ends in a clear error in time."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import grpc
import pytest

from libs.vcuda import VcudaClientError, register_vdevice
from tests.vmanager.builders import new_container_id, new_pod_uid


async def test_no_socket_times_out(workdir: Path) -> None:
    path = workdir / "vcuda.sock"
    started = time.monotonic()
    with pytest.raises(VcudaClientError, match=f"no socket at {path}") as info:
        await register_vdevice(str(path), pod_uid=new_pod_uid(), container_id=new_container_id(), timeout=0.5)
    assert time.monotonic() - started < 2.0
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_socket_without_listener_times_out(workdir: Path) -> None:
    path = workdir / "vcuda.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # bound, never listening: what a crashed server leaves behind
    try:
        started = time.monotonic()
        with pytest.raises(VcudaClientError, match="no answer from the vmanager"):
            await register_vdevice(str(path), pod_uid=new_pod_uid(), container_name="main", timeout=0.5)
        assert time.monotonic() - started < 2.0
    finally:
        stale.close()


@pytest.mark.parametrize("kwargs", [
    {},
    {"container_id": "abc", "container_name": "main"},
])
async def test_exactly_one_of_id_and_name(kwargs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        await register_vdevice("/nonexistent/vcuda.sock", pod_uid=new_pod_uid(), **kwargs)


async def test_pod_uid_required() -> None:
    with pytest.raises(ValueError, match="pod_uid"):
        await register_vdevice("/nonexistent/vcuda.sock", pod_uid="", container_name="main")
