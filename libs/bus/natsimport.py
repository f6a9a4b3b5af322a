"""nats-py imported without aiohttp, the library it needs only for its websocket transport.

nats-py tries ``import aiohttp`` when it is first imported and, where that fails, keeps its TCP
transport and refuses only ``ws://`` URLs (with an ImportError that says so). gpuledger always speaks
plain NATS over TCP, and aiohttp with its dependencies is about 12 MB of resident memory, paid by every
service process. So the first import of nats hides aiohttp for the duration of that import; a process
that imports aiohttp for itself later (the simulator, a test) still gets it. Where aiohttp or nats is
already loaded there is nothing to save, and nats is imported as it is.

Importing this module does it: ``libs.bus`` imports it before any module of the package imports nats,
and a service that imports nats itself does so after ``libs.bus`` (tests/unit/test_service_footprint.py
checks every service).
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["import_nats_without_websockets"]


def import_nats_without_websockets() -> None:
    if "nats" in sys.modules or "aiohttp" in sys.modules:
        return
    sys.modules["aiohttp"] = None  # type: ignore[assignment]  # None in sys.modules: `import aiohttp` fails
    try:
        importlib.import_module("nats")
    finally:
        del sys.modules["aiohttp"]


import_nats_without_websockets()
