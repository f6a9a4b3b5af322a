"""A service's HTTP endpoint (libs.http_endpoint) over real sockets: routing, what runs on the event loop,
a busy loop answered with 503, malformed requests, and a stop that leaves no thread or socket behind."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from libs.http_endpoint import HttpEndpoint, Reply, json_reply


def _raw(port: int, data: bytes, host: str = "127.0.0.1") -> bytes:
    """Send ``data``, read until the server closes the connection."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _get(port: int, path: str, *headers: str) -> tuple[str, dict[str, str], bytes]:
    """Status line, headers (lower-case names) and body of one GET."""
    head = "".join(f"{h}\r\n" for h in headers)
    answer = _raw(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
    top, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = top.decode("latin-1").split("\r\n")
    return status, {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}, body


class _ThreadRecorder:
    """A collector that notes the thread it is collected in."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.threads.append(threading.get_ident())
        fam = GaugeMetricFamily("demo_collections", "collections so far")
        fam.add_metric([], len(self.threads))
        yield fam


async def test_routes_run_on_the_loop_and_unknown_paths_or_methods_are_refused() -> None:
    threads = []

    async def version() -> Reply:
        threads.append(threading.get_ident())
        return json_reply({"version": "1.0", "n": len(threads)})

    endpoint = HttpEndpoint(CollectorRegistry(), {"/version": version}, host="127.0.0.1", port=0)
    await endpoint.start()
    try:
        for n in (1, 2):
            status, headers, body = await asyncio.to_thread(_get, endpoint.port, "/version?x=1")
            assert status.endswith(" 200 OK")
            assert headers["content-type"] == "application/json; charset=utf-8"
            assert json.loads(body) == {"version": "1.0", "n": n}
        assert threads == [threading.get_ident()] * 2  # the loop's thread, not the server's
        status, _, _ = await asyncio.to_thread(_get, endpoint.port, "/nothing")
        assert status.endswith(" 404 Not Found")
        posted = await asyncio.to_thread(_raw, endpoint.port, b"POST /version HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        assert posted.startswith(b"HTTP/1.0 405 ") and b"\r\nAllow: GET\r\n" in posted
        posted = await asyncio.to_thread(_raw, endpoint.port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        assert posted.startswith(b"HTTP/1.0 405 ")  # prometheus_client's own answer
    finally:
        await endpoint.stop()
    assert len(threads) == 2


async def test_metrics_are_collected_on_the_loop_in_the_format_and_encoding_asked_for() -> None:
    registry = CollectorRegistry()
    recorder = _ThreadRecorder()
    registry.register(recorder)
    Counter("demo_things", "things", registry=registry).inc(3)
    endpoint = HttpEndpoint(registry, {}, host="127.0.0.1", port=0)
    await endpoint.start()
    try:
        for path in ("/metrics", "/metric"):
            status, headers, body = await asyncio.to_thread(_get, endpoint.port, path)
            assert status.endswith(" 200 OK")
            assert headers["content-type"].startswith("text/plain; version=")
            assert b"\ndemo_things_total 3.0\n" in body
        _, headers, body = await asyncio.to_thread(_get, endpoint.port, "/metrics", "Accept-Encoding: gzip")
        assert headers["content-encoding"] == "gzip"
        assert b"demo_collections 3.0" in gzip.decompress(body)
        _, headers, body = await asyncio.to_thread(
            _get, endpoint.port, "/metrics", "Accept: application/openmetrics-text; version=1.0.0")
        assert headers["content-type"].startswith("application/openmetrics-text")
        assert body.endswith(b"# EOF\n")
    finally:
        await endpoint.stop()
    assert recorder.threads == [threading.get_ident()] * 4


async def test_a_busy_loop_gets_503_and_the_waiting_route_is_cancelled() -> None:
    never = asyncio.Event()
    cancelled = asyncio.Event()

    async def stuck() -> Reply:
        try:
            await never.wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return json_reply({})

    endpoint = HttpEndpoint(CollectorRegistry(), {"/graph": stuck}, host="127.0.0.1", port=0, loop_wait=0.2)
    await endpoint.start()
    try:
        status, _, body = await asyncio.to_thread(_get, endpoint.port, "/graph")
        assert status.endswith(" 503 Service Unavailable") and b"busy" in body
        await asyncio.wait_for(cancelled.wait(), 10)
        # a loop that is blocked outright: a scrape answers 503 rather than waiting for it
        scrape = asyncio.get_running_loop().run_in_executor(None, _get, endpoint.port, "/metrics")
        time.sleep(1.0)  # noqa: ASYNC251  (on purpose: holds the loop, as a long synchronous step would)
        status, _, _ = await asyncio.wait_for(scrape, 10)
        assert status.endswith(" 503 Service Unavailable")
    finally:
        await endpoint.stop()


async def test_malformed_requests_get_the_standard_library_s_answers() -> None:
    async def failing() -> Reply:
        raise RuntimeError("boom")

    endpoint = HttpEndpoint(CollectorRegistry(), {"/fail": failing}, host="127.0.0.1", port=0)
    await endpoint.start()
    try:
        def ask(data: bytes) -> bytes:
            return _raw(endpoint.port, data)

        # no valid request line: an HTTP/0.9-style answer, the error page without a status line
        assert b"Error code: 400" in await asyncio.to_thread(ask, b"nonsense\r\n\r\n")
        assert (await asyncio.to_thread(ask, b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n")).startswith(
            b"HTTP/1.0 414 ")
        long_header = b"GET /fail HTTP/1.1\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n"
        assert (await asyncio.to_thread(ask, long_header)).startswith(b"HTTP/1.0 431 ")
        assert (await asyncio.to_thread(ask, b"GET /fail HTTP/9.9\r\n\r\n")).count(b"Error code: 505") == 1
        assert (await asyncio.to_thread(ask, b"GET /fail HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.0 500 ")
    finally:
        await endpoint.stop()


async def test_stop_ends_open_connections_and_leaves_no_thread_or_socket() -> None:
    async def ok() -> Reply:
        return Reply(b"ok", "text/plain")

    before = set(threading.enumerate())
    endpoint = HttpEndpoint(CollectorRegistry(), {"/": ok}, host="127.0.0.1", port=0)
    await endpoint.start()
    port = endpoint.port
    assert (await asyncio.to_thread(_raw, port, b"GET / HTTP/1.1\r\n\r\n")).endswith(b"\r\n\r\nok")
    # a client that sends half a request and waits: its connection's thread waits for the rest
    silent = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        silent.sendall(b"GET / HTTP/1.1\r\n")
        await asyncio.sleep(0.2)
        await asyncio.wait_for(endpoint.stop(), 10)  # that connection does not hold the stop up
        assert await asyncio.to_thread(silent.recv, 1024) == b""  # ended by the server
    finally:
        silent.close()
    left = [t for t in set(threading.enumerate()) - before if not t.name.startswith("asyncio_")]
    assert left == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10).close()


async def test_serves_an_ipv6_address() -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")

    async def ok() -> Reply:
        return Reply(b"ok", "text/plain")

    endpoint = HttpEndpoint(CollectorRegistry(), {"/": ok}, host="::1", port=0)
    await endpoint.start()
    try:
        assert (await asyncio.to_thread(_raw, endpoint.port, b"GET / HTTP/1.1\r\n\r\n", "::1")).endswith(b"ok")
    finally:
        await endpoint.stop()
