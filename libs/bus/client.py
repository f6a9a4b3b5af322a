"""The NATS connection every service uses: reconnects, typed request/reply with deadlines, errors.

The connection itself stays inside ``Bus``: services request, serve, publish and subscribe through
its typed methods, so payload decoding, error replies and subscription clean-up live in one place.
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
import contextlib
import contextvars
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

from libs.errors import BusError, BusTimeout, CorruptLog, RemoteError, ServiceError
from libs.events.codec import StoredEvent, decode_record
from libs.events.subjects import Subjects
from libs.logger import bound, correlation, get_logger

__all__ = ["ERROR_CODE_HEADER", "ERROR_HEADER", "REQUEST_ID_HEADER", "Bus", "after_reply"]

ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
REQUEST_ID_HEADER = "Gpuledger-Request-Id"

Req = TypeVar("Req")
Rep = TypeVar("Rep")
Msg_T = TypeVar("Msg_T")

_logger = get_logger("bus")

# What the handler of the request being served left for after its reply (``after_reply``); None outside
# a handler. The handler runs in the subscription's task, which sets and resets this around it.
_AFTER_REPLY: contextvars.ContextVar[list[Callable[[float | None], None]] | None] = contextvars.ContextVar(
    "after_reply", default=None)


def after_reply(work: Callable[[float | None], None]) -> None:
    """Have ``work`` run once the reply to the request being served is out, so that it does not delay it.

    nats-py writes a reply when the serving task next yields: ``work`` runs on the loop turn after the
    reply was handed to the connection, which writes it first. It gets the ``time.perf_counter()`` of
    the hand-over, or None when there was none (the handler failed: an error was answered instead).
    Call it from the handler's own task; outside a handler, ``work(None)`` runs on the next turn."""
    pending = _AFTER_REPLY.get()
    if pending is None:
        asyncio.get_running_loop().call_soon(work, None)
    else:
        pending.append(work)


def _run_after_reply(pending: list[Callable[[float | None], None]], replied: float | None) -> None:
    for work in pending:
        work(replied)

RECONNECT_WAIT_S = 0.5
FIRST_CONNECT_MAX_WAIT_S = 2.0  # the first connect's backoff doubles up to this
# After a disconnect: a restarted local broker is back within a second or two, so try every
# RECONNECT_FAST_S for RECONNECT_FAST_FOR_S, then back off (doubling) up to RECONNECT_MAX_WAIT_S.
RECONNECT_FAST_S = 0.05
RECONNECT_FAST_FOR_S = 2.0
RECONNECT_MAX_WAIT_S = 2.0
RECONNECT_LOG_EVERY_S = 5.0  # during an outage, one "still cannot reach" line at most this often
# close() lets the subscriptions' queued messages be handled for this long (nats-py's own drain
# timeout: cancelling its drain from outside leaves a gather whose error asyncio reports as never
# retrieved), and gives up for good a few seconds later still.
DRAIN_TIMEOUT_S = 4.0
CLOSE_MARGIN_S = 3.0


class Bus:
    def __init__(self, nc: NatsClient, subjects: Subjects) -> None:
        self._nc = nc
        self.subjects = subjects
        self._subs: list[Subscription] = []
        # Called (plain functions, no awaiting) each time the connection is re-established, e.g. by
        # the watchdog to reconcile at once what it missed while the broker was away.
        self.on_reconnect: list[Callable[[], None]] = []
        self._js: JetStreamContext | None = None

    @classmethod
    async def connect(cls, url: str, *, name: str, node: str, wait: float | None = None,
                      inbox_prefix: str | None = None) -> Bus:
        """Connect, retrying while the server is not up; reconnect forever after.

        ``wait`` bounds the first connect (a CLI command fails with BusError after it); ``None`` (a
        service) keeps trying, logging each failed attempt, so the service starts when NATS comes up:
        its caller cancels the wait on a stop signal, and the half-open client is closed then too.

        Replies to this connection's requests (and its JetStream API calls) come on subjects under
        ``inbox_prefix``, by default the node's own (``_INBOX.<node token>``): in a fleet, a node's
        user may receive only its own node's replies over the leaf link.
        """
        subjects = Subjects(node)
        errors: list[str] = []

        nc = NatsClient()
        first_connect = True
        reconnect_hooks: list[Callable[[], None]] = []
        outage = _Outage()

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc) or type(exc).__name__)
            quiet = wait is not None  # a service logs; a command (bounded wait) says the last in its BusError
            if first_connect or outage.since is None:
                if first_connect:  # back off between its attempts (nats-py reads this option per attempt)
                    nc.options["reconnect_time_wait"] = min(nc.options["reconnect_time_wait"] * 2,
                                                            FIRST_CONNECT_MAX_WAIT_S)
                if not quiet:
                    _logger.warning("nats error", url=url, error=errors[-1])
            else:  # a failed reconnect attempt: one line per RECONNECT_LOG_EVERY_S
                nc.options["reconnect_time_wait"] = outage.next_wait()
                if outage.should_log() and not quiet:
                    _logger.warning("cannot reach nats; retrying", url=url, error=errors[-1],
                                    attempts=outage.attempts, away_s=round(outage.away(), 1))

        async def on_disconnect() -> None:
            if not (nc.is_closed or nc.is_draining):
                _logger.warning("nats disconnected", url=url)
                outage.begin()
                nc.options["reconnect_time_wait"] = RECONNECT_FAST_S

        async def on_reconnect() -> None:
            _logger.info("nats reconnected", url=url, away_s=round(outage.away(), 2), attempts=outage.attempts)
            outage.end()
            for hook in reconnect_hooks:
                hook()

        # nats-py retries the first connect itself (max_reconnect_attempts=-1), every reconnect_time_wait.
        connecting = nc.connect(
            [u.strip() for u in url.split(",")] if "," in url else url,  # a cluster: several URLs
            name=name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=RECONNECT_WAIT_S,
            connect_timeout=2,
            drain_timeout=DRAIN_TIMEOUT_S,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            inbox_prefix=inbox_prefix or subjects.inbox,
        )
        try:
            await (connecting if wait is None else asyncio.wait_for(connecting, wait))
        except BaseException as exc:
            # Cancelled (a stop signal), timed out or failed: nothing of the attempt may stay behind.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(nc.close()), 2)
            if isinstance(exc, TimeoutError) and wait is not None:
                last = errors[-1] if errors else "no answer"
                raise BusError(f"cannot reach NATS at {url} within {wait:g}s: {last}") from exc
            if isinstance(exc, (OSError, nats.errors.Error)):
                raise BusError(f"cannot reach NATS at {url}: {exc}") from exc
            raise
        first_connect = False
        nc.options["reconnect_time_wait"] = RECONNECT_WAIT_S  # reset to RECONNECT_FAST_S at a disconnect
        bus = cls(nc, subjects)
        bus.on_reconnect = reconnect_hooks
        return bus

    def for_node(self, node: str) -> Bus:
        """This connection, addressing ``node``'s subjects (a CLI may learn the node from the server).
        Closing either bus closes the connection."""
        return Bus(self._nc, Subjects(node))

    @property
    def js(self) -> JetStreamContext:
        """The connection's JetStream context, made once (the relay publishes each event through it)."""
        if self._js is None:
            self._js = self._nc.jetstream()
        return self._js

    def js_domain(self, domain: str, *, timeout: float) -> JetStreamContext:
        """JetStream of another domain through this connection (a fleet node's, over its leaf link)."""
        return self._nc.jetstream(domain=domain, timeout=timeout)

    @property
    def reconnects(self) -> int:
        """How many times the connection was re-established (a follower resubscribes after one)."""
        return int(self._nc.stats["reconnects"])

    @property
    def is_closed(self) -> bool:
        return bool(self._nc.is_closed)

    async def request(self, subject: str, msg: Any, reply_type: type[Rep], *, timeout: float) -> Rep:
        # The caller's request id travels as a header, unless the request carries it itself: the server
        # takes a request's own id then (``correlation``), and a message without headers is cheaper for
        # both clients and the broker (an Allocate's every hop).
        own = getattr(msg, "request_id", "")
        request_id = structlog.contextvars.get_contextvars().get("request_id") or own
        headers = {REQUEST_ID_HEADER: str(request_id)} if request_id and request_id != own else None
        try:
            resp = await self._nc.request(subject, msgspec.json.encode(msg), timeout=timeout, headers=headers)
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
        on_replied: Callable[[Req], None] | None = None,
    ) -> Subscription:
        """Answer requests on ``subject``; requests on one subscription are handled one at a time.

        ``on_replied(req)`` runs once a successful reply has been handed to the connection (a caller
        timing its own reply step: encoding and publishing included). Work a handler leaves for after
        its reply: ``after_reply``."""
        return await self._serve(subject, req_type, lambda _subject, req: handler(req), queue=queue,
                                 on_replied=on_replied)

    async def serve_subjects(
        self,
        subject: str,
        req_type: type[Req],
        handler: Callable[[str, Req], Awaitable[Any]],
        *,
        queue: str | None = None,
    ) -> Subscription:
        """``serve`` for a wildcard subject whose tokens say who asks: ``handler(subject, req)`` gets the
        subject each request came on (the server's permissions let a node publish only its own)."""
        return await self._serve(subject, req_type, handler, queue=queue)

    async def _serve(
        self,
        subject: str,
        req_type: type[Req],
        handler: Callable[[str, Req], Awaitable[Any]],
        *,
        queue: str | None,
        on_replied: Callable[[Req], None] | None = None,
    ) -> Subscription:
        async def on_msg(msg: Msg) -> None:
            try:
                req = msgspec.json.decode(msg.data, type=req_type)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                await self._reply_error(msg, 400, f"malformed request: {exc}")
                return
            # The caller's request id (else the request's own), and the pod or allocation it names. The
            # callbacks of one subscription share a task: unbind when done.
            fields = correlation(req, request_id=(msg.headers or {}).get(REQUEST_ID_HEADER))
            with bound(**fields):
                await handle(msg, req)

        async def handle(msg: Msg, req: Any) -> None:
            pending: list[Callable[[float | None], None]] = []
            token = _AFTER_REPLY.set(pending)
            replied = None
            try:
                try:
                    rep = await handler(msg.subject, req)
                except ServiceError as exc:
                    await self._reply_error(msg, exc.code, exc.message)
                    return
                except Exception as exc:
                    _logger.error("handler failed", subject=subject, error=str(exc), exc_info=exc)
                    await self._reply_error(msg, 500, f"internal error: {exc}")
                    return
                if msg.reply:  # not msg.respond(): that would echo the request's headers
                    await self._nc.publish(msg.reply, msgspec.json.encode(rep))
                replied = time.perf_counter()
                if on_replied is not None:
                    on_replied(req)
            finally:
                _AFTER_REPLY.reset(token)
                if pending:  # scheduled after the connection's flusher, which the publish woke
                    asyncio.get_running_loop().call_soon(_run_after_reply, pending, replied)

        sub = await self._nc.subscribe(subject, queue=queue or "", cb=on_msg)
        self._subs.append(sub)
        return sub

    async def _reply_error(self, msg: Msg, code: int, text: str) -> None:
        if msg.reply:
            # Header values must be one line; other spacing is kept (error texts are matched exactly).
            headers = {ERROR_HEADER: " ".join(text.strip().splitlines()), ERROR_CODE_HEADER: str(code)}
            await self._nc.publish(msg.reply, b"", headers=headers)

    async def publish(self, subject: str, msg: Any) -> None:
        await self._nc.publish(subject, msgspec.json.encode(msg))

    async def subscribe(
        self, subject: str, msg_type: type[Msg_T], handler: Callable[[Msg_T], Awaitable[None]]
    ) -> Subscription:
        """Hand every message on ``subject`` (wildcards allowed) to ``handler``, decoded as ``msg_type``.

        Core NATS: what is published while the connection is down is not delivered. A payload that
        does not decode is logged and skipped; the subscription goes on.
        """

        async def on_msg(msg: Msg) -> None:
            try:
                decoded = msgspec.json.decode(msg.data, type=msg_type)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                _logger.warning("unreadable message", subject=msg.subject, type=msg_type.__name__, error=str(exc))
                return
            await handler(decoded)

        return await self._subscribe(subject, on_msg)

    async def subscribe_events(self, subject: str, handler: Callable[[StoredEvent], Awaitable[None]]) -> Subscription:
        """Hand every committed event published on ``subject`` to ``handler`` as a ``StoredEvent``.

        The record is decoded once here (upcast to today's schema, as on every read of the log). A core
        subscription: it sees events as they are published, and nothing missed while disconnected; a
        reader that must see every event follows the stream (``libs.bus.follow``) instead. A record
        that does not decode is logged and skipped.
        """

        async def on_msg(msg: Msg) -> None:
            try:
                stored = decode_record(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError, CorruptLog) as exc:
                _logger.warning("unreadable event", subject=msg.subject, error=str(exc))
                return
            await handler(stored)

        return await self._subscribe(subject, on_msg)

    async def _subscribe(self, subject: str, cb: Callable[[Msg], Awaitable[None]]) -> Subscription:
        sub = await self._nc.subscribe(subject, cb=cb)
        self._subs.append(sub)
        return sub

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait until the server has processed everything sent so far (subscriptions included).

        nats-py writes its flush's PING straight to the socket, while what was sent just before (a
        subscription) may still wait in its buffer for the task that writes it a loop turn later: the
        PONG could then come before the server had the subscription, and another connection's request
        sent right after found no responder (a CI failure of tests/integration/test_pod_cache_race.py).
        So the buffer goes out first."""
        async with asyncio.timeout(timeout):
            turns = 0
            while self._nc.pending_data_size and self._nc.is_connected and not self._nc.is_connecting:
                await asyncio.sleep(0 if turns < 10 else 0.001)  # the writer task runs on the next turn
                turns += 1
            await self._nc.flush(timeout=timeout)

    async def close(self) -> None:
        """Drain the connection: every subscription made through this bus ends, pending messages first."""
        if self._nc.is_closed:
            return
        try:
            await asyncio.wait_for(self._nc.drain(), timeout=self._nc.options["drain_timeout"] + CLOSE_MARGIN_S)
        except (TimeoutError, nats.errors.Error):
            with contextlib.suppress(OSError):  # the server is gone: the socket may already be reset
                await self._nc.close()


class _Outage:
    """One loss of the broker connection: how long, how many attempts, how often it is logged."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.attempts = 0
        self.wait = RECONNECT_FAST_S
        self._logged = 0.0

    def begin(self) -> None:
        self.since = time.monotonic()
        self.attempts = 0
        self.wait = RECONNECT_FAST_S
        self._logged = self.since  # the disconnect itself was just logged

    def end(self) -> None:
        self.since = None

    def away(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since

    def next_wait(self) -> float:
        """The pause before the next attempt: short at first, then doubling."""
        self.attempts += 1
        if self.away() >= RECONNECT_FAST_FOR_S:
            self.wait = min(self.wait * 2, RECONNECT_MAX_WAIT_S)
        return self.wait

    def should_log(self) -> bool:
        now = time.monotonic()
        if now - self._logged < RECONNECT_LOG_EVERY_S:
            return False
        self._logged = now
        return True
