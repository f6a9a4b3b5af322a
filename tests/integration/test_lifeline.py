"""Children that die with their parent (libs/lifeline.py), started safely beside busy gRPC threads.

Real processes: a gRPC server and client in this process keep gRPC's threads busy while children
start; a parent killed with SIGKILL takes its child with it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from libs.lifeline import process_alive, start_in_own_session

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the parent-death signal is Linux's prctl")


async def test_children_started_while_grpc_is_busy_all_reach_their_command(tmp_path: Path) -> None:
    # With the signal armed in a preexec_fn instead, Python forks, gRPC's fork handlers run in the
    # child, and 17 of 60 children died of SIGABRT or SIGSEGV before their exec (measured here).
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler("t.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{tmp_path / 'echo.sock'}")
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{tmp_path / 'echo.sock'}")
    call = channel.unary_unary("/t.Echo/Echo")
    stopping = asyncio.Event()

    async def busy() -> int:
        calls = 0
        while not stopping.is_set():
            assert await call(b"x" * 64, timeout=10) == b"x" * 64
            calls += 1
        return calls

    callers = [asyncio.create_task(busy()) for _ in range(4)]
    try:
        await asyncio.sleep(0.1)
        codes = []
        for _ in range(40):
            child = await start_in_own_session(  # as the launcher starts its services
                ["/bin/sh", "-c", "exit 7"], stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            codes.append(await asyncio.wait_for(child.wait(), 30))
    finally:
        stopping.set()
        calls = await asyncio.gather(*callers)
        await channel.close()
        await server.stop(None)
    assert sum(calls) > 40, "gRPC was not busy while the children started"
    assert codes == [7] * 40, f"children that did not reach their command: { {c: codes.count(c) for c in set(codes)} }"


def test_a_child_runs_its_own_command_line_and_dies_with_its_parent(tmp_path: Path) -> None:
    # The parent: a process that starts `sleep` through the lifeline, says its pid, and waits.
    pid_file = tmp_path / "child.pid"
    parent_code = (
        "import subprocess, sys; from libs.lifeline import with_lifeline\n"
        "child = subprocess.Popen(with_lifeline(['sleep', '60']), start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "child.wait()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None, "the parent exited before starting its child"
            assert time.monotonic() < deadline, "the parent did not start its child within 30 s"
            time.sleep(0.02)
        child = int(pid_file.read_text())
        cmdline = b""
        while time.monotonic() < deadline:  # the lifeline execs: the same pid, then sleep's own argv
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if cmdline.startswith(b"sleep\0"):
                break
            time.sleep(0.01)
        assert cmdline == b"sleep\x0060\x00"
        # Its own session: a group kill of the parent would not reach it; the kernel's signal does.
        assert os.getsid(child) != os.getsid(parent.pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        while process_alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not process_alive(child), "the child outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if pid_file.exists() and pid_file.read_text():
            child = int(pid_file.read_text())
            if process_alive(child):
                os.kill(child, signal.SIGKILL)
