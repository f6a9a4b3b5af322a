"""gRPC unary calls with ``h2``: served on one connection the gate has checked (peergate.py), and
made to the container runtime (runtimenames.py).

grpcio's Python server cannot say which process connected to a unix socket (no SO_PEERCRED), so the
gate used to copy each checked connection to a private grpcio server. On a node starting containers
that relay, and grpcio's hand-off of each call from its poller thread to the event loop, made up
most of a registration's wait (docs/benchmarks.md, twelfth round). Here the gate's own task parses
the call with the ``h2`` library (HTTP/2 framing, HPACK, flow control, pings) and answers it.

gRPC over HTTP/2, unary only (what vcuda.sock serves): a request is HEADERS (``:method POST``,
``:path /<service>/<method>``, ``content-type application/grpc``, optional ``grpc-timeout``), DATA
holding one length-prefixed message, END_STREAM; the answer is HEADERS (``:status 200``), DATA, and
trailers with ``grpc-status`` and ``grpc-message``, or trailers alone for a failure. Each stream is
answered in a task of its own; a connection with no call open is closed after ``IDLE_CLOSE_S``.

``UnaryChannel`` is the same exchange from the other side, on one connection kept open (the vmanager
asks the container runtime about each container). With it the vmanager needs no grpcio at all:
grpcio's library and a channel's threads cost a deployed vmanager 11 MB of its RSS
(docs/benchmarks.md, fifteenth round).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import hpack

__all__ = ["IDLE_CLOSE_S", "CallFailed", "Status", "Unary", "UnaryChannel", "serve_unary"]

# A method: the request message's bytes and the caller's time left (None: no deadline) -> the reply's.
Unary = Callable[[bytes, "float | None"], Awaitable[bytes]]

IDLE_CLOSE_S = 300.0  # a connection with no call open for this long is closed (clients dial again)
_READ = 64 * 1024
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_TIMEOUT = re.compile(r"^([0-9]{1,8})([HMSmun])$")


class _PlainEncoder(hpack.Encoder):
    """HPACK without Huffman coding (as grpcio's server sends its trailers): a refusal's status and
    message stay readable on the wire, for a client that prints raw frames (the in-container
    client of the tests does), and a few short headers are not worth the coding."""

    def encode(self, headers, huffman=True):  # type: ignore[no-untyped-def]
        return super().encode(headers, huffman=False)


class Status(enum.IntEnum):
    """gRPC's status codes, as numbered on the wire (``grpc-status``)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class CallFailed(Exception):
    """What a method raises to answer with a gRPC status other than OK (and what ``UnaryChannel`` raises
    when answered with one)."""

    def __init__(self, code: Status, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class _Call:
    headers: dict[str, str]
    body: bytearray = field(default_factory=bytearray)
    refused: bool = False  # answered already (too large): the rest of its DATA is dropped


def _percent_encoded(text: str) -> str:
    """grpc-message as the gRPC spec wants it: printable ASCII but '%' as is, every other byte %XX."""
    return "".join(chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}" for b in text.encode())


def _deadline(value: str | None) -> float | None:
    if value is None:
        return None
    match = _TIMEOUT.match(value)
    if match is None:
        raise CallFailed(Status.INVALID_ARGUMENT, f"malformed grpc-timeout {value[:32]!r}")
    return int(match.group(1)) * _TIMEOUT_UNITS[match.group(2)]


def _message(body: bytes, limit: int) -> bytes:
    """The one length-prefixed message of a unary request (or reply)."""
    if len(body) < 5:
        raise CallFailed(Status.INTERNAL, "no length-prefixed message in the call")
    if body[0] != 0:
        raise CallFailed(Status.UNIMPLEMENTED, "compressed messages are not accepted here")
    length = int.from_bytes(body[1:5], "big")
    if length > limit:
        raise CallFailed(Status.RESOURCE_EXHAUSTED,
                         f"Received message larger than max ({length} vs. {limit})")
    if len(body) != 5 + length:
        raise CallFailed(Status.INTERNAL,
                         f"the message is {len(body) - 5} bytes, its prefix says {length}")
    return bytes(body[5:])


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, methods: dict[str, Unary],
                 limit: int) -> None:
        self.reader = reader
        self.writer = writer
        self.methods = methods
        self.limit = limit
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        self.h2.encoder = _PlainEncoder()
        self.calls: dict[int, _Call] = {}
        self.answering: dict[int, asyncio.Task[None]] = {}

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.writer.write(data)

    async def run(self) -> None:
        self.h2.initiate_connection()
        self.flush()
        try:
            while True:
                idle = not self.calls and not self.answering
                try:
                    data = await asyncio.wait_for(self.reader.read(_READ), IDLE_CLOSE_S if idle else None)
                except TimeoutError:
                    self.h2.close_connection()
                    self.flush()
                    return
                if not data:
                    return
                try:
                    events = self.h2.receive_data(data)
                except h2.exceptions.ProtocolError:
                    self.flush()  # h2 queued the GOAWAY that says why
                    return
                for event in events:
                    if not self._handle(event):
                        self.flush()
                        return
                self.flush()
        finally:
            for task in self.answering.values():
                task.cancel()
            if self.answering:
                await asyncio.gather(*self.answering.values(), return_exceptions=True)

    def _handle(self, event: h2.events.Event) -> bool:
        """False when the connection is over."""
        if isinstance(event, h2.events.RequestReceived):
            self.calls[event.stream_id] = _Call(headers=dict(event.headers))  # type: ignore[arg-type]
        elif isinstance(event, h2.events.DataReceived):
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            call = self.calls.get(event.stream_id)
            if call is not None and not call.refused:
                call.body += event.data
                if len(call.body) > self.limit + 5:
                    call.refused = True
                    self._fail(event.stream_id, CallFailed(
                        Status.RESOURCE_EXHAUSTED,
                        f"Received message larger than max ({len(call.body) - 5}+ vs. {self.limit})"))
                    with contextlib.suppress(h2.exceptions.ProtocolError):
                        self.h2.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)
        elif isinstance(event, h2.events.StreamEnded):
            call = self.calls.pop(event.stream_id, None)
            if call is not None and not call.refused:
                task = asyncio.ensure_future(self._answer(event.stream_id, call))
                self.answering[event.stream_id] = task
                task.add_done_callback(lambda _t, sid=event.stream_id: self.answering.pop(sid, None))
        elif isinstance(event, h2.events.StreamReset):
            self.calls.pop(event.stream_id, None)
            task = self.answering.pop(event.stream_id, None)
            if task is not None:
                task.cancel()
        elif isinstance(event, h2.events.ConnectionTerminated):
            return False
        return True

    async def _answer(self, stream_id: int, call: _Call) -> None:
        try:
            method = self.methods.get(call.headers.get(":path", ""))
            if call.headers.get(":method") != "POST" or method is None:
                raise CallFailed(Status.UNIMPLEMENTED,
                                 f"no method {call.headers.get(':path', '')[:200]!r} here")
            if not call.headers.get("content-type", "").startswith("application/grpc"):
                raise CallFailed(Status.INVALID_ARGUMENT, "content-type is not application/grpc")
            time_left = _deadline(call.headers.get("grpc-timeout"))
            request = _message(call.body, self.limit)
            try:
                reply = await asyncio.wait_for(method(request, time_left), time_left)
            except TimeoutError:
                raise CallFailed(Status.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except CallFailed as exc:
            self._fail(stream_id, exc)
        else:
            self._send(stream_id, [(":status", "200"), ("content-type", "application/grpc")],
                       b"\0" + len(reply).to_bytes(4, "big") + reply, [("grpc-status", "0")])
        self.flush()

    def _fail(self, stream_id: int, exc: CallFailed) -> None:
        self._send(stream_id, [(":status", "200"), ("content-type", "application/grpc"),
                               ("grpc-status", str(int(exc.code))),
                               ("grpc-message", _percent_encoded(exc.message))])

    def _send(self, stream_id: int, headers: list[tuple[str, str]], data: bytes | None = None,
              trailers: list[tuple[str, str]] | None = None) -> None:
        """Headers, then the message and trailers if given; a stream the client reset is skipped."""
        try:
            self.h2.send_headers(stream_id, headers, end_stream=data is None)
            if data is not None:
                self.h2.send_data(stream_id, data)
                self.h2.send_headers(stream_id, trailers or [], end_stream=True)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass


async def serve_unary(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, methods: dict[str, Unary], *,
                      limit: int) -> None:
    """Answer the connection's calls until the client closes it (or it idles); ``methods`` by path
    (``/pkg.Service/Method``); a request message over ``limit`` bytes is refused."""
    await _Connection(reader, writer, methods, limit).run()



class UnaryChannel:
    """Unary calls to the gRPC server on a unix ``socket``, on one HTTP/2 connection: dialled at the
    first call, kept, and dialled again after it is lost (a restarted server, a GOAWAY). A call's
    failure is CallFailed with the status a gRPC client gives: the server's own, UNAVAILABLE when it
    cannot be reached or the connection ends under the call, DEADLINE_EXCEEDED after ``timeout``."""

    def __init__(self, socket: Path | str, *, limit: int = 4 * 1024 * 1024) -> None:
        self.socket = socket
        self.limit = limit
        self._conn: _ClientConnection | None = None
        self._dialling = asyncio.Lock()

    async def call(self, path: str, message: bytes, *, timeout: float) -> bytes:
        try:
            async with asyncio.timeout(timeout):
                conn = await self._connection()
                return await conn.call(path, message, timeout, self.limit)
        except TimeoutError:
            raise CallFailed(Status.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except (OSError, h2.exceptions.H2Error) as exc:  # ConnectionError is an OSError
            raise CallFailed(Status.UNAVAILABLE, f"{self.socket}: {exc or type(exc).__name__}") from exc

    async def _connection(self) -> _ClientConnection:
        async with self._dialling:
            if self._conn is None or not self._conn.open:
                if self._conn is not None:
                    self._conn.close()
                reader, writer = await asyncio.open_unix_connection(str(self.socket))
                self._conn = _ClientConnection(reader, writer)
            return self._conn

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()
            await conn.closed()


class _ClientConnection:
    """One HTTP/2 connection: a task reads the server's frames and hands each stream its answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.encoder = _PlainEncoder()  # a few short headers: Huffman coding them costs more than it saves
        self.h2.initiate_connection()
        self.open = True
        self._answers: dict[int, _Answer] = {}
        self._reading = asyncio.ensure_future(self._read(reader))

    async def call(self, path: str, message: bytes, timeout: float, limit: int) -> bytes:
        answer = _Answer(asyncio.get_running_loop().create_future(), limit)
        try:
            stream = self.h2.get_next_available_stream_id()
            self.h2.send_headers(stream, [
                (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"),
                ("content-type", "application/grpc"), ("te", "trailers"),
                ("grpc-timeout", f"{max(1, int(timeout * 1000))}m")])
            self.h2.send_data(stream, b"\0" + len(message).to_bytes(4, "big") + message, end_stream=True)
        except h2.exceptions.H2Error:
            self.open = False  # no more calls on this connection (stream ids spent, say): the next dials again
            raise
        self._answers[stream] = answer
        try:
            self._flush()  # on a new connection, the preface and SETTINGS go in the same write
            return await answer.future
        except asyncio.CancelledError:  # timed out: the server may stop working on it
            if self.open and stream in self._answers:
                with contextlib.suppress(h2.exceptions.H2Error):
                    self.h2.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
                    self._flush()
            raise
        finally:
            self._answers.pop(stream, None)

    def _flush(self) -> None:
        if data := self.h2.data_to_send():
            self.writer.write(data)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        lost: BaseException = ConnectionError("the server closed the connection")
        try:
            while data := await reader.read(_READ):  # after a GOAWAY too: calls under way may still end
                for event in self.h2.receive_data(data):
                    self._handle(event)
                self._flush()
        except Exception as exc:  # whatever ends the connection ends its calls as UNAVAILABLE
            lost = ConnectionError(f"the connection failed: {exc or type(exc).__name__}")
        finally:
            self.open = False
            for answer in self._answers.values():
                if not answer.future.done():
                    answer.future.set_exception(lost)
            self.writer.close()

    def _handle(self, event: h2.events.Event) -> None:
        answer = self._answers.get(getattr(event, "stream_id", 0) or 0)
        if isinstance(event, h2.events.ConnectionTerminated):
            self.open = False  # a GOAWAY: no new calls here (the next dials again)
        elif answer is None or answer.future.done():
            if isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            answer.headers.update(event.headers)  # type: ignore[arg-type]
        elif isinstance(event, h2.events.DataReceived):
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            answer.body += event.data
            if len(answer.body) > answer.limit + 5:
                answer.future.set_exception(CallFailed(
                    Status.RESOURCE_EXHAUSTED, f"Received message larger than max ({len(answer.body) - 5}+ vs. "
                                               f"{answer.limit})"))
                with contextlib.suppress(h2.exceptions.H2Error):
                    self.h2.reset_stream(event.stream_id, h2.errors.ErrorCodes.CANCEL)
        elif isinstance(event, h2.events.StreamReset):
            answer.future.set_exception(CallFailed(Status.UNAVAILABLE,
                                                   f"the server reset the call (error {event.error_code})"))
        elif isinstance(event, h2.events.StreamEnded):
            answer.settle()

    def close(self) -> None:
        self.open = False
        self._reading.cancel()

    async def closed(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self._reading


@dataclass
class _Answer:
    future: asyncio.Future[bytes]
    limit: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)

    def settle(self) -> None:
        """The stream has ended: its message, or its status as CallFailed."""
        status = self.headers.get("grpc-status")
        if status != "0":
            code = int(status) if status is not None and status.isdigit() else Status.UNKNOWN
            known = Status(code) if code in Status._value2member_map_ else Status.UNKNOWN
            message = urllib.parse.unquote(self.headers.get("grpc-message", ""))
            self.future.set_exception(CallFailed(
                known, message or f"no grpc-status in the answer (HTTP {self.headers.get(':status', '?')})"))
            return
        try:
            self.future.set_result(_message(self.body, self.limit))
        except CallFailed as exc:
            self.future.set_exception(exc)
