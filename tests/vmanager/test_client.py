"""The gpu-client never hangs: a missing socket or a socket nobody serves ends in a clear error in time."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from libs.vcuda import VcudaClientError, register_vdevice
from tests.vmanager.helpers import new_container_id, new_pod_uid


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


def _silent_server(path: Path) -> tuple[socket.socket, list[socket.socket], threading.Thread]:
    """Listens, accepts every connection, reads what comes, never answers."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    held: list[socket.socket] = []

    def run() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return server, held, thread


async def test_accepting_but_silent_server_times_out(workdir: Path) -> None:
    path = workdir / "vcuda.sock"
    server, held, thread = _silent_server(path)
    try:
        started = time.monotonic()
        with pytest.raises(VcudaClientError) as info:
            await register_vdevice(str(path), pod_uid=new_pod_uid(), container_id=new_container_id(), timeout=0.5)
        assert time.monotonic() - started < 3.0
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert held  # it did connect: the deadline, not a refused connect, ended it
    finally:
        server.close()
        for conn in held:
            conn.close()
        thread.join(5)


@pytest.mark.parametrize("command", ["gpu-client", "vcuda-client"])
def test_cli_gives_up_on_a_silent_server(workdir: Path, command: str) -> None:
    """As a real process, with gpu-manager's flags: non-zero exit, a clear message, bounded time."""
    path = workdir / "vcuda.sock"
    server, held, thread = _silent_server(path)
    try:
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "gpuledger", command, "--addr", str(path), "--bus-id", "",
             "--pod-uid", new_pod_uid(), "--cont-id", new_container_id(), "--timeout", "1"],
            capture_output=True, text=True, timeout=60,
        )
        assert proc.returncode == 1, proc.stderr
        assert "no answer from the vmanager" in proc.stderr
        assert time.monotonic() - started < 30  # interpreter start-up included, on a loaded machine
    finally:
        server.close()
        for conn in held:
            conn.close()
        thread.join(5)
