"""gRPC unary calls served with ``h2`` on one connection the vmanager's gate has checked
(services/vmanager/peergate.py); what both sides of the wire share (status codes, message framing)
for grpcchannel.py, which makes calls.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import hpack

__all__ = ["IDLE_CLOSE_S", "READ_SIZE", "CallFailed", "PlainEncoder", "Status", "Unary", "framed", "message_of",
           "overflowing", "serve_unary"]

# A method: the request message's bytes and the caller's time left (None: no deadline) -> the reply's.
Unary = Callable[[bytes, "float | None"], Awaitable[bytes]]

IDLE_CLOSE_S = 300.0  # a connection with no call open for this long is closed (clients dial again)
READ_SIZE = 64 * 1024
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_TIMEOUT = re.compile(r"^([0-9]{1,8})([HMSmun])$")


class PlainEncoder(hpack.Encoder):
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
    """What a method raises to answer with a gRPC status other than OK (and what a call made with
    grpcchannel.py raises when answered with one)."""

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


def framed(message: bytes) -> bytes:
    """``message`` as gRPC puts it in DATA: not compressed, its length, itself."""
    return b"\0" + len(message).to_bytes(4, "big") + message


def overflowing(body: bytes | bytearray, limit: int) -> CallFailed | None:
    """The refusal of a message still arriving once ``body`` holds more than ``limit`` bytes of it."""
    if len(body) <= limit + 5:
        return None
    return CallFailed(Status.RESOURCE_EXHAUSTED, f"Received message larger than max ({len(body) - 5}+ vs. {limit})")


def message_of(body: bytes, limit: int) -> bytes:
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
        # What the caller sends is validated; what we send is headers we spell ourselves, whose checks
        # and normalisation cost a registration about 20 us (a sixth of its answer) for nothing.
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding="utf-8", validate_outbound_headers=False,
            normalize_outbound_headers=False))
        self.h2.encoder = PlainEncoder()
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
                    data = await asyncio.wait_for(self.reader.read(READ_SIZE), IDLE_CLOSE_S if idle else None)
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
                if refusal := overflowing(call.body, self.limit):
                    call.refused = True
                    self._fail(event.stream_id, refusal)
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
            request = message_of(call.body, self.limit)
            try:
                # In this task (wait_for would run the method in a task of its own): what the method
                # leaves for the loop's next turn (``call_soon``) comes after its reply is written.
                async with asyncio.timeout(time_left):
                    reply = await method(request, time_left)
            except TimeoutError:
                raise CallFailed(Status.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except CallFailed as exc:
            self._fail(stream_id, exc)
        else:
            self._send(stream_id, [(":status", "200"), ("content-type", "application/grpc")],
                       framed(reply), [("grpc-status", "0")])
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

