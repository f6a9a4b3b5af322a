"""Each service process imports only what it uses: heavy libraries stay out of the services that do not
need them (every service is its own interpreter, so each needless import is paid once per service)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# No service loads aiohttp: nats-py is imported without it (libs/bus/natsimport.py: we never use its
# websocket transport) and /metrics is served by the standard library's WSGI server (libs/http_endpoint.py).
# Nor cryptography (the checkpointer loads it with the node's key, libs/witness/note.py) or pyelftools (read
# only where a driver library is).
EVERY_SERVICE = ("sqlalchemy", "simulator", "aiohttp", "cryptography", "elftools")

GPU_BACKENDS = ("libs.gpu.backends", "libs.gpu.nvml", "libs.gpu.fake", "pynvml")

# module -> top-level packages that importing it must not load
RULES = {
    # nor the GPU backends (NVML, the fake profiles' PyYAML) where no GPU is read: the settings' validation
    # does not import them (libs/config.py), a --config file is read only when given (gpuledger/options.py),
    # and placement's topology tokens do not load the backends (libs/gpu/__init__.py loads names on use)
    "services.registrar.app": (*EVERY_SERVICE, "lightkube", *GPU_BACKENDS, "yaml"),
    # nor grpcio: vcuda.sock is answered and the container runtime asked with h2 (grpcwire.py)
    "services.vmanager.app": (*EVERY_SERVICE, "lightkube", *GPU_BACKENDS, "yaml", "grpc"),
    "services.watchdog.app": EVERY_SERVICE,
    # nor grpcio: the kubelet's pod-resources List is asked with h2 (libs/grpcchannel.py)
    "services.allocator.app": (*EVERY_SERVICE, "grpc"),
    # `gpuledger run` starts a service without the rest of the CLI
    "gpuledger.run_cmd": ("gpuledger.cli", "simulator", "sqlalchemy", "lightkube", "elftools", "aiohttp", "yaml"),
}


@pytest.mark.parametrize("module", sorted(RULES))
def test_a_service_does_not_import_what_it_does_not_use(module: str) -> None:
    code = (f"import sys, {module}\n"
            "from libs.config import Settings\n"
            "Settings()\n"  # every service validates its settings at start
            f"print(' '.join(m for m in {RULES[module]!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == [], f"{module} imports {out.stdout.strip()}"


def test_a_vmanager_that_asks_the_container_runtime_loads_no_grpcio() -> None:
    # deploy/ gives the vmanager containerd's socket: its runtime client is made at start
    code = ("import sys, services.vmanager.app\n"
            "from services.vmanager.runtimenames import RuntimeNames\n"
            "RuntimeNames('/run/containerd/containerd.sock', timeout=1.0)\n"
            "print('grpc' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False"]


def test_creating_a_log_loads_no_sqlalchemy(tmp_path: Path) -> None:
    # The start that creates a node's log is the allocator's first: the log's schema is plain SQL
    # (libs/store/schema.py), so that start idles as small as every later one.
    code = ("import asyncio, sys\n"
            "from libs.store import EventLog\n"
            "async def main():\n"
            f"    log = await EventLog.open({str(tmp_path / 'events.db')!r})\n"
            "    await log.close()\n"
            "asyncio.run(main())\n"
            "print('sqlalchemy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False"]
    assert (tmp_path / "events.db").stat().st_size > 0


def test_nats_is_imported_without_aiohttp_yet_aiohttp_stays_importable() -> None:
    code = ("import sys, libs.bus, nats.aio.transport as t\n"
            "print('aiohttp' in sys.modules, t.aiohttp is None)\n"
            "import aiohttp\n"  # a process that wants it (the simulator, a test) still gets it
            "print(aiohttp.ClientSession is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "True", "True"]
