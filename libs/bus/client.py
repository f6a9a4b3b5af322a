"""The NATS connection every service uses: reconnects, typed request/reply with deadlines, errors.

Payloads are msgspec JSON (readable with ``nats sub``). A request carries the caller's request id in
the ``Gpuledger-Request-Id`` header (the one bound in the structlog context, else the message's own
``request_id``), and the handler runs with it bound, so one request can be followed through the
log lines of every service it touches. A handler that refuses a request raises
``ServiceError``; the reply then carries the ``Nats-Service-Error`` and ``Nats-Service-Error-Code``
headers (the names nats micro-services use) and the caller gets a ``RemoteError``. A request that
nobody answers in time raises ``BusTimeout``: no wait in gpuledger is unbounded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from libs.errors import BusError, BusTimeout, RemoteError, ServiceError
from libs.events.subjects import Subjects
from libs.log import correlation, get_logger

__all__ = ["ERROR_CODE_HEADER", "ERROR_HEADER", "REQUEST_ID_HEADER", "Bus"]

ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
REQUEST_ID_HEADER = "Gpuledger-Request-Id"

Req = TypeVar("Req")
Rep = TypeVar("Rep")

_log = get_logger("bus")


class Bus:
    def __init__(self, nc: NatsClient, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self._subs: list[Subscription] = []

    @classmethod
    async def connect(cls, url: str, *, name: str, node: str, wait: float = 30.0) -> Bus:
        """Connect, retrying for up to ``wait`` seconds while the server starts; reconnect forever after."""

        async def on_error(exc: Exception) -> None:
            _log.warning("nats error", error=str(exc) or type(exc).__name__)

        holder: list[NatsClient] = []

        async def on_disconnect() -> None:
            if holder and not (holder[0].is_closed or holder[0].is_draining):
                _log.warning("nats disconnected", url=url)

        async def on_reconnect() -> None:
            _log.info("nats reconnected", url=url)

        deadline = time.monotonic() + wait
        delay = 0.1
        while True:
            try:
                nc = await nats.connect(
                    url,
                    name=name,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    connect_timeout=2,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                )
                holder.append(nc)
                return cls(nc, Subjects(node))
            except (OSError, nats.errors.NoServersError, nats.errors.TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    raise BusError(f"cannot reach NATS at {url} within {wait:g}s: {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()

    async def request(self, subject: str, msg: Any, reply_type: type[Rep], *, timeout: float) -> Rep:
        request_id = structlog.contextvars.get_contextvars().get("request_id") or getattr(msg, "request_id", "")
        headers = {REQUEST_ID_HEADER: str(request_id)} if request_id else None
        try:
            resp = await self.nc.request(subject, msgspec.json.encode(msg), timeout=timeout, headers=headers)
        except nats.errors.TimeoutError as exc:
            raise BusTimeout(subject, timeout) from exc
        except nats.errors.NoRespondersError as exc:
            raise RemoteError(subject, 503, f"no service answers {subject}; is it running?") from exc
        headers = resp.headers or {}
        if ERROR_CODE_HEADER in headers:
            raise RemoteError(subject, int(headers[ERROR_CODE_HEADER]), headers.get(ERROR_HEADER, ""))
        try:
            return msgspec.json.decode(resp.data, type=reply_type)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BusError(f"malformed reply on {subject}: {exc}") from exc

    async def serve(
        self,
        subject: str,
        req_type: type[Req],
        handler: Callable[[Req], Awaitable[Any]],
        *,
        queue: str | None = None,
    ) -> Subscription:
        """Answer requests on ``subject``; requests on one subscription are handled one at a time."""

        async def on_msg(msg: Msg) -> None:
            try:
                req = msgspec.json.decode(msg.data, type=req_type)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                await self._reply_error(msg, 400, f"malformed request: {exc}")
                return
            # The caller's request id (else the request's own), and the pod or allocation it names. The
            # callbacks of one subscription share a task: unbind when done.
            bound = correlation(req, request_id=(msg.headers or {}).get(REQUEST_ID_HEADER))
            with structlog.contextvars.bound_contextvars(**bound):
                await handle(msg, req)

        async def handle(msg: Msg, req: Any) -> None:
            _log.debug("request", subject=subject)
            try:
                rep = await handler(req)
            except ServiceError as exc:
                await self._reply_error(msg, exc.code, exc.message)
                return
            except Exception as exc:
                _log.error("handler failed", subject=subject, error=str(exc), exc_info=exc)
                await self._reply_error(msg, 500, f"internal error: {exc}")
                return
            if msg.reply:  # not msg.respond(): that would echo the request's headers
                await self.nc.publish(msg.reply, msgspec.json.encode(rep))

        sub = await self.nc.subscribe(subject, queue=queue or "", cb=on_msg)
        self._subs.append(sub)
        return sub

    async def _reply_error(self, msg: Msg, code: int, text: str) -> None:
        if msg.reply:
            # Header values must be one line; other spacing is kept (error texts are matched exactly).
            headers = {ERROR_HEADER: " ".join(text.strip().splitlines()), ERROR_CODE_HEADER: str(code)}
            await self.nc.publish(msg.reply, b"", headers=headers)

    async def publish(self, subject: str, msg: Any) -> None:
        await self.nc.publish(subject, msgspec.json.encode(msg))

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=5)
        except (TimeoutError, nats.errors.Error):
            await self.nc.close()
