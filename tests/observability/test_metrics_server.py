"""The metrics server on its own: both paths, the exposition format, and a busy port that is not fatal."""

from __future__ import annotations

import asyncio
import socket

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from libs.config import Settings
from libs.metrics import MetricsServer, metrics_port
from tests.observability.helpers import free_port_base, http_get


def test_ports_per_service() -> None:
    s = Settings(metrics_port=9100)
    assert [metrics_port(s, n) for n in ("allocator", "registrar", "vmanager", "watchdog")] == [9100, 9101, 9102, 9103]
    assert metrics_port(Settings(), "allocator") == 0  # off unless asked for


async def test_serves_both_paths() -> None:
    registry = CollectorRegistry()
    Counter("demo_things", "things", registry=registry).inc(3)
    server = MetricsServer("test", registry, host="127.0.0.1", port=free_port_base(1))
    assert await server.start()
    try:
        for path in ("/metrics", "/metric"):
            ctype, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{server.port}{path}")
            assert ctype.startswith("text/plain; version=")
            (fam,) = [f for f in text_string_to_metric_families(text) if f.name == "demo_things"]
            assert fam.samples[0].value == 3
    finally:
        await server.stop()


async def test_busy_port_is_reported_not_fatal() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = MetricsServer("test", CollectorRegistry(), host="127.0.0.1", port=port)
        assert await server.start() is False
        await server.stop()  # nothing to stop: fine
