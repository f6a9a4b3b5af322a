"""The allocator's pod-resources client against the simulated kubelet's real gRPC server.

A List beyond the kubelet's rate limit (RESOURCE_EXHAUSTED) is reported as unavailable for that call
and keeps the connection: the next List within the limit answers on the same one. A kubelet that
restarts is dialled afresh. A List is on its way after one loop turn, so a caller that then blocks
its loop (an inline append) still gets it answered meanwhile.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from services.allocator.podresources import KubeletPodResources, PodResourcesUnavailable
from simulator import NodeSimulator, SimConfig


async def test_a_rate_limited_list_is_unavailable_and_keeps_the_channel(short_dir: Path) -> None:
    cfg = SimConfig(device_plugin_dir=short_dir / "dp", pod_resources_socket=short_dir / "pr" / "kubelet.sock",
                    pod_resources_qps=5.0, pod_resources_burst=1)
    async with NodeSimulator(cfg):
        client = KubeletPodResources(str(cfg.pod_resources_socket), timeout=2.0)
        try:
            assert (await client.list("test")).holders == {}
            connection = client._channel._conn
            with pytest.raises(PodResourcesUnavailable, match="RESOURCE_EXHAUSTED"):
                await client.list("test")  # the one token was spent
            assert client._channel._conn is connection and connection is not None and connection.open
            await asyncio.sleep(0.25)  # a token back (5 a second)
            assert (await client.list("test")).containers == {}
            assert client._channel._conn is connection  # not a reason to dial afresh
        finally:
            await client.close()


_SERVER = """
import asyncio, sys, time
import grpc.aio
from libs.kubelet.podresources.v1 import api_pb2 as pr, api_pb2_grpc as pr_grpc

class Lister(pr_grpc.PodResourcesListerServicer):
    async def List(self, request, context):
        print(time.monotonic(), flush=True)  # when the request arrived (one clock for every process)
        return pr.ListPodResourcesResponse()

async def main():
    server = grpc.aio.server()
    pr_grpc.add_PodResourcesListerServicer_to_server(Lister(), server)
    server.add_insecure_port("unix://" + sys.argv[1])
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


async def _serve(socket: Path) -> asyncio.subprocess.Process:
    server = await asyncio.create_subprocess_exec(sys.executable, "-c", _SERVER, str(socket),
                                                  stdout=asyncio.subprocess.PIPE)
    assert server.stdout is not None
    assert await asyncio.wait_for(server.stdout.readline(), 30) == b"ready\n"
    return server


async def test_a_list_leaves_after_one_loop_turn_even_if_the_loop_then_blocks(short_dir: Path) -> None:
    """What the Allocate path relies on: started, one loop turn, then the inline append blocks the loop;
    the kubelet (another process) has the request before the loop is free again."""
    socket = short_dir / "pr.sock"
    server = await _serve(socket)
    assert server.stdout is not None
    client = KubeletPodResources(str(socket), timeout=5.0)
    try:
        await client.list("test")  # connected
        await server.stdout.readline()
        listing = client.begin_list("test")
        await asyncio.sleep(0)
        time.sleep(0.1)  # noqa: ASYNC251 - the loop blocked on purpose, as by an inline fsync
        unblocked = time.monotonic()
        arrived = float(await asyncio.wait_for(server.stdout.readline(), 5))
        assert arrived < unblocked  # sent before the block, not after it
        await asyncio.wait_for(listing, 5)
    finally:
        await client.close()
        server.kill()
        await server.wait()


async def test_a_kubelet_that_restarts_is_dialled_afresh(short_dir: Path) -> None:
    socket = short_dir / "pr.sock"
    client = KubeletPodResources(str(socket), timeout=5.0)
    server = await _serve(socket)
    try:
        await client.list("test")
        server.kill()
        await server.wait()
        assert socket.exists()  # left behind by the killed server: the connection is refused
        with pytest.raises(PodResourcesUnavailable, match="UNAVAILABLE"):
            await client.list("test")  # the kubelet is away: refused, not hung
        server = await _serve(socket)  # back, on a new socket at the same path
        assert (await client.list("test")).holders == {}
    finally:
        await client.close()
        server.kill()
        await server.wait()
