"""A small HTTP/1.1 server for a service's GET endpoints: ``/metrics`` and the allocator's JSON routes.

What a Prometheus scraper, ``gpuledger status --url`` and curl need, over asyncio streams: GET and HEAD
of fixed paths (a query string is ignored), keep-alive, a bounded wait for each request's head and a
bounded head size. It is not aiohttp's server on purpose: every service serves ``/metrics``, and aiohttp
with its dependencies is about 14 MB of resident memory in each service process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from libs.logger import get_logger

__all__ = ["Handler", "HttpServer", "Reply", "json_reply"]

HEAD_LIMIT = 16 * 1024  # bytes of request line and headers
HEAD_S = 30.0           # a connection waits this long for a request's whole head (the next one, kept alive)

_logger = get_logger("http")


@dataclass(frozen=True)
class Reply:
    body: bytes
    content_type: str
    status: int = 200


def json_reply(value: Any) -> Reply:
    return Reply(json.dumps(value).encode(), "application/json; charset=utf-8")


Handler = Callable[[], Awaitable[Reply]]


class HttpServer:
    def __init__(self, routes: dict[str, Handler], *, host: str, port: int) -> None:
        self.routes = routes
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        """Listen (raises OSError when the port cannot be bound); port 0 picks a free one."""
        self._server = await asyncio.start_server(self._connection, self.host, self.port, limit=HEAD_LIMIT)
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            keep_alive = True
            while keep_alive:
                try:
                    async with asyncio.timeout(HEAD_S):
                        head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.LimitOverrunError:
                    await _write(writer, Reply(b"request head too large\n", "text/plain", 431), keep_alive=False)
                    return
                except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    return
                keep_alive = await self._answer(head, writer)
        except ConnectionError:
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()

    async def _answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; whether the connection stays open for the next."""
        lines = head.decode("latin-1").split("\r\n")
        words = lines[0].split(" ")
        if len(words) != 3 or not words[2].startswith("HTTP/1."):
            await _write(writer, Reply(b"bad request\n", "text/plain", 400), keep_alive=False)
            return False
        method, target, version = words
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        connection = headers.get("connection", "")
        keep_alive = connection == "keep-alive" if version == "HTTP/1.0" else connection != "close"
        if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
            keep_alive = False  # a body is never read: the connection cannot be reused after it
        handler = self.routes.get(target.split("?", 1)[0])
        if method not in ("GET", "HEAD"):
            reply = Reply(b"method not allowed\n", "text/plain", 405)
        elif handler is None:
            reply = Reply(b"not found\n", "text/plain", 404)
        else:
            try:
                reply = await handler()
            except Exception as exc:
                _logger.error("an HTTP route failed", path=target, error=repr(exc))
                reply = Reply(b"internal error\n", "text/plain", 500)
        await _write(writer, reply, keep_alive=keep_alive, body=method != "HEAD")
        return keep_alive


async def _write(writer: asyncio.StreamWriter, reply: Reply, *, keep_alive: bool, body: bool = True) -> None:
    status = HTTPStatus(reply.status)
    head = [f"HTTP/1.1 {status.value} {status.phrase}", f"Content-Type: {reply.content_type}",
            f"Content-Length: {len(reply.body)}"]
    if reply.status == 405:
        head.append("Allow: GET, HEAD")
    if not keep_alive:
        head.append("Connection: close")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (reply.body if body else b""))
    await writer.drain()
