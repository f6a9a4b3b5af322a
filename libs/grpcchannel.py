"""gRPC unary calls made with ``h2`` (the other side of grpcwire.py), on one connection kept open: the
vmanager asks the container runtime's ``ContainerStatus`` with it, the allocator the kubelet's
pod-resources ``List``. So neither loads grpcio: grpcio's library and a channel's threads cost a
deployed service about 11 MB of its RSS (docs/benchmarks.md, fifteenth and seventeenth rounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
from hpack import NeverIndexedHeaderTuple

from libs.grpcwire import READ_SIZE, CallFailed, PlainEncoder, Status, framed, message_of, overflowing

__all__ = ["UnaryChannel"]


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
        # What the server sends is validated; the headers we send, spelled here, are not (as grpcwire.py's)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding="utf-8", validate_outbound_headers=False,
            normalize_outbound_headers=False, validate_inbound_headers=False))
        self.h2.encoder = _RequestEncoder()
        self.h2.initiate_connection()
        self.open = True
        self._answers: dict[int, _Answer] = {}
        self._reading = asyncio.ensure_future(self._read(reader))

    async def call(self, path: str, message: bytes, timeout: float, limit: int) -> bytes:
        answer = _Answer(asyncio.get_running_loop().create_future(), limit)
        try:
            stream = self.h2.get_next_available_stream_id()
            self.h2.send_headers(stream, [
                (b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()), (b":authority", b"localhost"),
                (b"content-type", b"application/grpc"), (b"te", b"trailers"),
                (b"grpc-timeout", b"%dm" % max(1, int(timeout * 1000)))])
            self.h2.send_data(stream, framed(message), end_stream=True)
        except h2.exceptions.H2Error:
            self.open = False  # no more calls on this connection (stream ids spent, say): the next dials again
            raise
        self._answers[stream] = answer
        try:
            self._flush()  # on a new connection, the preface and SETTINGS go in the same write
            return await answer.future
        except asyncio.CancelledError:  # timed out: the server may stop working on it
            if self.open:
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
            while data := await reader.read(READ_SIZE):
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
            # A GOAWAY: the next call dials again. h2 has closed its side: a frame that still comes
            # for a call under way ends the connection, and that call, as UNAVAILABLE.
            self.open = False
        elif answer is None or answer.future.done():
            if isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            answer.headers.update(event.headers)  # type: ignore[arg-type]
        elif isinstance(event, h2.events.DataReceived):
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            answer.body += event.data
            if refusal := overflowing(answer.body, answer.limit):
                answer.future.set_exception(refusal)
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


class _RequestEncoder(PlainEncoder):
    """Each distinct set of request headers encoded once (HPACK encoding was the largest part of a
    request's cost in a profile). Sent as literals that are never indexed (or static-table
    references), a block does not depend on the dynamic table, so the same headers are the same bytes
    on every call. A table size change the server asks for is still signalled, in a block encoded
    afresh."""

    KEEP = 32  # distinct blocks kept (a path and a deadline each)

    def __init__(self) -> None:
        super().__init__()
        self._blocks: dict[tuple[object, ...], bytes] = {}

    def encode(self, headers, huffman=True):  # type: ignore[no-untyped-def]
        key = tuple(headers)
        if self.header_table.resized:  # this block begins with the size update: made afresh, not kept
            return self._literal(key)
        block = self._blocks.get(key)
        if block is None:
            if len(self._blocks) >= self.KEEP:
                self._blocks.clear()
            block = self._blocks[key] = self._literal(key)
        return block

    def _literal(self, headers: tuple[object, ...]) -> bytes:
        return super().encode([NeverIndexedHeaderTuple(name, value) for name, value in headers])


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
            message = urllib.parse.unquote(self.headers.get("grpc-message", ""))
            self.future.set_exception(CallFailed(
                _status(status), message or f"no grpc-status in the answer (HTTP {self.headers.get(':status', '?')})"))
            return
        try:
            self.future.set_result(message_of(self.body, self.limit))
        except CallFailed as exc:
            self.future.set_exception(exc)


def _status(value: str | None) -> Status:
    """A ``grpc-status`` header's code; UNKNOWN when it is missing or no code gRPC has."""
    try:
        return Status(int(value or ""))
    except ValueError:
        return Status.UNKNOWN
