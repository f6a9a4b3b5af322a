"""The services' HTTP server (libs.httpserve) over a real socket: routes, keep-alive, HEAD, bad requests."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from libs.httpserve import HttpServer, Reply, json_reply


async def _serving(routes: dict) -> HttpServer:  # type: ignore[type-arg]
    server = HttpServer(routes, host="127.0.0.1", port=0)
    await server.start()
    return server


async def _raw(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read()  # until the server closes
    finally:
        writer.close()


async def test_routes_keep_alive_and_query_strings() -> None:
    calls = []

    async def version() -> Reply:
        calls.append(1)
        return json_reply({"version": "1.0", "n": len(calls)})

    server = await _serving({"/version": version})
    try:
        async with aiohttp.ClientSession() as session:
            for n in (1, 2, 3):
                async with session.get(f"http://127.0.0.1:{server.port}/version?x=1") as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"] == "application/json; charset=utf-8"
                    assert json.loads(await resp.read()) == {"version": "1.0", "n": n}
            async with session.get(f"http://127.0.0.1:{server.port}/nothing") as resp:
                assert resp.status == 404
            async with session.post(f"http://127.0.0.1:{server.port}/version") as resp:
                assert resp.status == 405
                assert resp.headers["Allow"] == "GET, HEAD"
        # two requests on one connection: the first keeps it open, the second closes it
        both = await _raw(server.port, b"GET /version HTTP/1.1\r\n\r\n"
                                       b"GET /version HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert both.count(b"HTTP/1.1 200 OK\r\n") == 2
        assert both.endswith(b'"n": 5}')
    finally:
        await server.stop()
    assert len(calls) == 5


async def test_head_has_no_body_and_http10_closes() -> None:
    async def metrics() -> Reply:
        return Reply(b"a 1\n", "text/plain")

    server = await _serving({"/metrics": metrics})
    try:
        head = await _raw(server.port, b"HEAD /metrics HTTP/1.0\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"Content-Length: 4\r\n" in head
        assert head.endswith(b"\r\n\r\n")  # no body, and the connection closed after it
        got = await _raw(server.port, b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert got.endswith(b"\r\n\r\na 1\n")
    finally:
        await server.stop()


async def test_bad_requests_get_a_clear_status() -> None:
    async def failing() -> Reply:
        raise RuntimeError("boom")

    server = await _serving({"/fail": failing})
    try:
        assert (await _raw(server.port, b"nonsense\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
        too_big = b"GET / HTTP/1.1\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n"
        assert (await _raw(server.port, too_big)).startswith(b"HTTP/1.1 431 ")
        failed = await _raw(server.port, b"GET /fail HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert failed.startswith(b"HTTP/1.1 500 ")
    finally:
        await server.stop()


async def test_stop_closes_kept_alive_connections() -> None:
    async def ok() -> Reply:
        return Reply(b"ok", "text/plain")

    server = await _serving({"/": ok})
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET / HTTP/1.1\r\n\r\n")
    await writer.drain()
    async with asyncio.timeout(10):
        await reader.readuntil(b"ok")
    await asyncio.wait_for(server.stop(), 10)  # the idle connection does not hold the stop
    async with asyncio.timeout(10):
        assert await reader.read() == b""
    writer.close()
