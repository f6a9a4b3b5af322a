"""A service's HTTP endpoint: Prometheus ``/metrics`` and JSON routes, served by the standard library.

prometheus_client's WSGI app writes the exposition (the format the scraper asks for, gzip where it is
accepted); wsgiref's server runs it in a thread of the service, one thread per connection. Our part is
the routing and the start/stop. What reads a service's state runs on the service's event loop, never in
the server's threads: the registry's collection and the JSON routes' bodies are computed there, the
request's thread waits for them a bounded time (then answers 503). Not aiohttp on purpose: every service
serves ``/metrics``, and aiohttp with its dependencies is about 14 MB of resident memory in each process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from socketserver import ThreadingMixIn
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import make_wsgi_app

from libs.logger import get_logger

__all__ = ["HttpEndpoint", "Reply", "Route", "json_reply"]

LOOP_WAIT_S = 10.0     # a route's body or a collection waits this long for the event loop, then 503
REQUEST_WAIT_S = 30.0  # a connection's request must arrive within this (a silent client holds a thread)
METRICS_PATHS = ("/metrics", "/metric")  # /metric: gpu-manager's path, for existing scrape configs

_logger = get_logger("http")
T = TypeVar("T")


@dataclass(frozen=True)
class Reply:
    body: bytes
    content_type: str
    status: int = 200


def json_reply(value: Any) -> Reply:
    return Reply(json.dumps(value).encode(), "application/json; charset=utf-8")


Route = Callable[[], Awaitable[Reply]]  # a GET route's body, computed on the service's event loop
StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class HttpEndpoint:
    def __init__(self, registry: CollectorRegistry, routes: dict[str, Route], *, host: str, port: int,
                 loop_wait: float = LOOP_WAIT_S) -> None:
        self.registry = registry
        self.routes = routes
        self.host = host
        self.port = port
        self.loop_wait = loop_wait
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        # make_wsgi_app formats what this registry collects: the service's registry, collected on the loop
        on_loop = CollectorRegistry(auto_describe=False)
        on_loop.register(_CollectedOnLoop(self))
        self._metrics_app = make_wsgi_app(on_loop)

    async def start(self) -> None:
        """Listen and serve (raises OSError when the port cannot be bound); port 0 picks a free one."""
        self._loop = asyncio.get_running_loop()
        # in a thread: binding looks the host's name up (HTTPServer.server_bind), which may wait on DNS
        self._server = await asyncio.to_thread(_Server, self.host, self.port, self._app)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name=f"http-{self.port}", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop listening, end open connections and join every thread. In a thread itself: a request
        waiting for the loop gets its answer while the server stops."""
        if self._server is not None:
            await asyncio.to_thread(self._stop, self._server)
            self._server = None

    def _stop(self, server: _Server) -> None:
        server.shutdown()  # serve_forever returns: no new connections
        server.end_connections()
        server.server_close()  # closes the listening socket, joins the connections' threads
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def on_loop(self, route: Callable[[], Awaitable[T]]) -> T:
        """``route()`` run on the service's loop; TimeoutError when it is not done within ``loop_wait``."""
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(route(), self._loop)
        try:
            return future.result(timeout=self.loop_wait)
        except TimeoutError:
            future.cancel()
            raise

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path, method = environ["PATH_INFO"], environ["REQUEST_METHOD"]
        try:
            if path in METRICS_PATHS:
                return self._metrics_app(environ, start_response)  # type: ignore[no-any-return]
            route = self.routes.get(path)
            if route is None:
                reply = Reply(b"not found\n", "text/plain", 404)
            elif method != "GET":
                return _answer(start_response, Reply(b"method not allowed\n", "text/plain", 405), ("Allow", "GET"))
            else:
                reply = self.on_loop(route)
        except TimeoutError:
            _logger.warning("an HTTP request waited too long for the event loop", path=path, seconds=self.loop_wait)
            reply = Reply(b"the service is busy: try again\n", "text/plain", 503)
        except Exception as exc:
            _logger.error("an HTTP route failed", path=path, error=repr(exc))
            reply = Reply(b"internal error\n", "text/plain", 500)
        return _answer(start_response, reply)


def _answer(start_response: StartResponse, reply: Reply, *extra: tuple[str, str]) -> list[bytes]:
    status = HTTPStatus(reply.status)
    start_response(f"{status.value} {status.phrase}", [("Content-Type", reply.content_type),
                                                       ("Content-Length", str(len(reply.body))), *extra])
    return [reply.body]


class _CollectedOnLoop:
    """The endpoint's registry, collected on the service's loop (a consistent read of what the loop
    mutates); the exposition is formatted in the request's thread, off the loop."""

    def __init__(self, endpoint: HttpEndpoint) -> None:
        self.endpoint = endpoint

    def collect(self) -> list[Any]:
        async def collected() -> list[Any]:
            return list(self.endpoint.registry.collect())

        return self.endpoint.on_loop(collected)


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_WAIT_S

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged (a scrape every few seconds)."""


class _Server(ThreadingMixIn, WSGIServer):
    """wsgiref's server, a thread per connection, that can end its open connections when it stops."""

    daemon_threads = False  # server_close joins them

    def __init__(self, host: str, port: int, app: Callable[..., Iterable[bytes]]) -> None:
        # the address's own family: the pod address the DaemonSet sets may be IPv6
        self.address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                 flags=socket.AI_PASSIVE)[0][0]
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__((host, port), _Handler)
        self.set_app(app)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
            super().shutdown_request(request)

    def end_connections(self) -> None:
        """Wake every connection's thread (one waiting for a slow client's request included)."""
        with self._open_lock:
            for request in self._open:
                with contextlib.suppress(OSError):  # the client is gone already
                    request.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client gone or silent past REQUEST_WAIT_S is no error of ours; socketserver would print a traceback
        _logger.debug("an HTTP connection ended early", client=str(client_address), error=repr(sys.exc_info()[1]))
