"""The floor for the pod start: what a GPU pod costs when its plugin and its vcuda.sock do nothing else.

One process, with none of gpuledger's work (no bus, no log, no pod lookup, no caller check):
- a bare device plugin for two resources registered with the (simulated) kubelet, as ours are:
  ``bench.gpuledger.io/floor-core`` (PreStartRequired, answered at once) and
  ``bench.gpuledger.io/floor-memory``. Its Allocate answers with the response given at start
  (bench/pod_start.py passes gpuledger's own answer to a warm-up pod, with that pod's vcuda
  directory replaced by this process's one): the same device nodes, mounts and envs as ours;
- a bare vcuda.sock in that directory, shared by every floor pod: RegisterVDevice makes
  ``<dir>/<container id>/`` and writes its 8240-byte vcuda.config (the request's pod UID, the
  share's limits), then answers. The in-container client (vcuda-register --self) then reads it
  exactly as it reads gpuledger's.

So a floor pod goes through the same kubelet admission (two Allocates, a PreStartContainer), the same
CreateContainer (devices, mounts), the same registration from inside; the GPU pod's start minus the
floor pod's is what gpuledger's own work costs.

With ``--bus URL`` it is the durable floor instead (resources ``bench.gpuledger.io/durable-core`` and
``-memory``): the core Allocate first makes one NATS request to bench/echo_ledger.py (one fsync'd
SQLite append, then the reply), as bench/echo_plugin.py's durable floor does for the Allocate
benchmark: the least that gpuledger's promise (a grant on disk before the kubelet has its answer)
adds to the floor.

    python -m bench.echo_gpu DEVICE_PLUGIN_DIR VCUDA_DIR RESPONSE_FILE [--bus URL]
    (prints "ready" once registered)

RESPONSE_FILE: a ContainerAllocateResponse in protobuf JSON (``MessageToJson``).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc
import nats
from google.protobuf import json_format

from bench.echo_plugin import EchoPlugin, serve_registered
from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from libs.vcuda import api_pb2 as vpb
from libs.vcuda import api_pb2_grpc as vpb_grpc
from libs.vcuda.config import VcudaConfig, encode

CORE = "bench.gpuledger.io/floor-core"
MEMORY = "bench.gpuledger.io/floor-memory"
DURABLE_CORE = "bench.gpuledger.io/durable-core"
DURABLE_MEMORY = "bench.gpuledger.io/durable-memory"


def resources(durable: bool) -> tuple[str, str]:
    """The (core, memory) resources of the floor, or of the durable floor."""
    return (DURABLE_CORE, DURABLE_MEMORY) if durable else (CORE, MEMORY)


def socket_name(resource: str) -> str:
    return "bench-" + resource.rpartition("/")[2] + ".sock"
# The share bench/pod_start.py asks for (10 cores, one 256 MiB block), written for every container.
_LIMITS = {"limit": 10, "gpu_memory": 256 << 20, "utilization": 10, "hard_limit": 1,
           "driver_major": 535, "driver_minor": 104, "enable": 1}


class BareVcuda(vpb_grpc.VCUDAServiceServicer):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    async def RegisterVDevice(self, request: vpb.VDeviceRequest, context: grpc.aio.ServicerContext
                              ) -> vpb.VDeviceResponse:
        cid = request.container_id
        if not cid or "/" in cid or cid.startswith("."):  # the one check: stay inside the directory
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a container id is required")
        container = self.directory / cid
        container.mkdir(exist_ok=True)
        (container / "vcuda.config").write_bytes(
            encode(VcudaConfig(pod_uid=request.pod_uid, container_name="c", **_LIMITS)))
        return vpb.VDeviceResponse()


async def main(plugin_dir: Path, vcuda_dir: Path, response_file: Path, bus_url: str | None = None) -> None:
    response = json_format.Parse(response_file.read_text(), pb.ContainerAllocateResponse())
    bus = await nats.connect(bus_url) if bus_url else None
    core, memory = resources(durable=bus is not None)
    vcuda_dir.mkdir(parents=True, exist_ok=True)
    servers = []
    vcuda = grpc.aio.server()
    vpb_grpc.add_VCUDAServiceServicer_to_server(BareVcuda(vcuda_dir), vcuda)
    socket = vcuda_dir / "vcuda.sock"
    socket.unlink(missing_ok=True)
    vcuda.add_insecure_port(f"unix://{socket}")
    await vcuda.start()
    socket.chmod(0o777)  # the container's user may be anyone, as with gpuledger's sockets
    servers.append(vcuda)
    for resource in (core, memory):  # the memory resource answers with nothing, as ours does
        plugin = EchoPlugin(bus if resource == core else None,
                            response=response if resource == core else pb.ContainerAllocateResponse(),
                            pre_start_required=resource == core, id_prefix="floor")
        servers.append(await serve_registered(plugin, plugin_dir, socket_name(resource), resource))
    print("ready", flush=True)
    await asyncio.gather(*(s.wait_for_termination() for s in servers))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("plugin_dir", type=Path)
    parser.add_argument("vcuda_dir", type=Path)
    parser.add_argument("response_file", type=Path)
    parser.add_argument("--bus", default=None, help="NATS URL: be the durable floor (see the module's text)")
    args = parser.parse_args()
    asyncio.run(main(args.plugin_dir, args.vcuda_dir, args.response_file, args.bus))
