"""gRPC unary calls on a checked connection (libs/grpcwire.py), served on a real unix
socket and called by grpcio's own client, as a CUDA library's gRPC client calls vcuda.sock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from hpack import Decoder

from libs import grpcwire
from libs.grpcchannel import UnaryChannel, _RequestEncoder
from libs.grpcwire import CallFailed, Status, serve_unary

ECHO = "/test.Echo/Say"
SLOW = "/test.Echo/Slow"
REFUSE = "/test.Echo/Refuse"


async def _say(message: bytes, time_left: float | None) -> bytes:
    return b"you said " + message


async def _slow(message: bytes, time_left: float | None) -> bytes:
    await asyncio.sleep(10)
    return b""


async def _refuse(message: bytes, time_left: float | None) -> bytes:
    raise CallFailed(Status.PERMISSION_DENIED, "not you: caf\u00e9 100% sure")


class _Served:
    """serve_unary on a unix socket with the test methods, started and stopped as often as asked;
    ``accepted`` counts the connections it took."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.accepted = 0
        self._connections: list[asyncio.Task[None]] = []
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._connections.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await serve_unary(reader, writer, {ECHO: _say, SLOW: _slow, REFUSE: _refuse}, limit=1024)
        except asyncio.CancelledError:
            pass  # stopped
        finally:
            writer.close()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._connections:
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Path]:
    server = _Served(tmp_path / "s.sock")
    await server.start()
    yield server.path
    await server.stop()


def call(channel: grpc.aio.Channel, path: str) -> grpc.aio.UnaryUnaryMultiCallable:
    return channel.unary_unary(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)


async def test_calls_on_one_channel_and_at_once_are_all_answered(served: Path) -> None:
    async with grpc.aio.insecure_channel(f"unix://{served}") as channel:
        assert await call(channel, ECHO)(b"hi", timeout=5) == b"you said hi"
        answers = await asyncio.gather(*(call(channel, ECHO)(str(i).encode(), timeout=5) for i in range(20)))
        assert answers == [f"you said {i}".encode() for i in range(20)]
        assert await call(channel, ECHO)(b"", timeout=5) == b"you said "  # an empty message


async def test_a_refusal_carries_its_code_and_message(served: Path) -> None:
    async with grpc.aio.insecure_channel(f"unix://{served}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(channel, REFUSE)(b"x", timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.value.details() == "not you: caf\u00e9 100% sure"  # percent-encoded on the wire, decoded back


async def test_an_unknown_method_is_unimplemented(served: Path) -> None:
    async with grpc.aio.insecure_channel(f"unix://{served}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(channel, "/test.Echo/Nope")(b"x", timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "/test.Echo/Nope" in (err.value.details() or "")


async def test_a_message_over_the_limit_is_refused_and_the_connection_lives_on(served: Path) -> None:
    async with grpc.aio.insecure_channel(f"unix://{served}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(channel, ECHO)(b"x" * (1 << 20), timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in (err.value.details() or "")
        assert await call(channel, ECHO)(b"ok", timeout=5) == b"you said ok"


async def test_the_callers_deadline_bounds_the_method(served: Path) -> None:
    async with grpc.aio.insecure_channel(f"unix://{served}") as channel:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(channel, SLOW)(b"", timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert loop.time() - began < 5
        assert await call(channel, ECHO)(b"still here", timeout=5) == b"you said still here"


async def test_bytes_that_are_not_http2_close_the_connection(served: Path) -> None:
    reader, writer = await asyncio.open_unix_connection(str(served))
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)  # up to EOF: the server closed it
    writer.close()
    assert data[3:4] == b"\x04"  # its own SETTINGS, sent first; then it hung up (EOF) on what came


async def test_a_silent_connection_is_closed_after_the_idle_bound(served: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    monkeypatch.setattr(grpcwire, "IDLE_CLOSE_S", 0.2)
    reader, writer = await asyncio.open_unix_connection(str(served))
    received = await asyncio.wait_for(reader.read(), 5)  # up to EOF: the server's SETTINGS, a GOAWAY
    writer.close()
    assert received[3:4] == b"\x04"  # it spoke HTTP/2 first (SETTINGS), then hung up on a silent caller
    assert b"\x07" in received  # GOAWAY


def test_grpc_timeout_values() -> None:
    assert grpcwire._deadline(None) is None
    assert grpcwire._deadline("10S") == 10.0
    assert grpcwire._deadline("250m") == 0.25
    assert grpcwire._deadline("2M") == 120.0
    with pytest.raises(CallFailed) as err:
        grpcwire._deadline("10 seconds")
    assert err.value.code == Status.INVALID_ARGUMENT


def test_framed_messages() -> None:
    assert grpcwire.message_of(b"\0\0\0\0\3abc", 10) == b"abc"
    for body, code in ((b"\0\0", Status.INTERNAL),
                       (b"\1\0\0\0\1a", Status.UNIMPLEMENTED),
                       (b"\0\0\0\0\5abc", Status.INTERNAL),
                       (b"\0\0\1\0\0", Status.RESOURCE_EXHAUSTED)):
        with pytest.raises(CallFailed) as err:
            grpcwire.message_of(body, 10)
        assert err.value.code == code, body


def test_percent_encoded_messages() -> None:
    assert grpcwire._percent_encoded("plain text") == "plain text"
    assert grpcwire._percent_encoded("100%\n\u00e9") == "100%25%0A%C3%A9"


def test_our_status_codes_are_grpcs() -> None:
    assert {c.name: int(c) for c in Status} == {c.name: c.value[0] for c in grpc.StatusCode}


# --- UnaryChannel: the same exchange from the client's side (the vmanager asking the container runtime) ---

@pytest.fixture
async def grpcio_server(tmp_path: Path) -> AsyncIterator[Path]:
    """A grpcio server (as containerd's is a real gRPC server): echo, refuse, slow, a large answer."""
    path = tmp_path / "g.sock"

    async def say(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"you said " + request

    async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, "no container caf\u00e9 100%")
        raise AssertionError

    async def slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(10)
        return b""

    async def large(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"x" * 5000

    methods = {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in
               (("Say", say), ("Refuse", refuse), ("Slow", slow), ("Large", large))}
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", methods),))
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    yield path
    await server.stop(0)


@pytest.fixture
async def channel(grpcio_server: Path) -> AsyncIterator[UnaryChannel]:
    ch = UnaryChannel(grpcio_server)
    yield ch
    await ch.close()


async def test_a_channel_gets_a_grpcio_servers_answers_on_one_connection(channel: UnaryChannel) -> None:
    assert await channel.call(ECHO, b"hi", timeout=5) == b"you said hi"
    first = channel._conn
    assert await channel.call(ECHO, b"", timeout=5) == b"you said "
    answers = await asyncio.gather(*(channel.call(ECHO, str(i).encode(), timeout=5) for i in range(10)))
    assert answers == [f"you said {i}".encode() for i in range(10)]
    assert channel._conn is first and first is not None and first.open  # kept, and the calls shared it


async def test_a_channel_raises_the_servers_status_and_message(channel: UnaryChannel) -> None:
    with pytest.raises(CallFailed) as err:
        await channel.call(REFUSE, b"x", timeout=5)
    assert (err.value.code, err.value.message) == (Status.NOT_FOUND, "no container caf\u00e9 100%")
    with pytest.raises(CallFailed) as err:
        await channel.call("/test.Echo/Nope", b"x", timeout=5)
    assert err.value.code == Status.UNIMPLEMENTED
    assert await channel.call(ECHO, b"after", timeout=5) == b"you said after"


async def test_a_channel_call_is_bounded_by_its_timeout_and_its_limit(grpcio_server: Path) -> None:
    channel = UnaryChannel(grpcio_server, limit=1000)
    try:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(CallFailed) as err:
            await channel.call(SLOW, b"", timeout=0.3)
        assert err.value.code == Status.DEADLINE_EXCEEDED
        assert loop.time() - began < 2
        assert await channel.call(ECHO, b"still", timeout=5) == b"you said still"  # the connection lives on
        with pytest.raises(CallFailed) as err:
            await channel.call("/test.Echo/Large", b"", timeout=5)
        assert err.value.code == Status.RESOURCE_EXHAUSTED
        assert await channel.call(ECHO, b"again", timeout=5) == b"you said again"
    finally:
        await channel.close()
    big = UnaryChannel(grpcio_server)
    try:
        assert len(await big.call("/test.Echo/Large", b"", timeout=5)) == 5000
    finally:
        await big.close()


async def test_a_channel_to_no_server_is_unavailable(tmp_path: Path) -> None:
    channel = UnaryChannel(tmp_path / "none.sock")
    with pytest.raises(CallFailed) as err:
        await channel.call(ECHO, b"x", timeout=5)
    assert err.value.code == Status.UNAVAILABLE and "none.sock" in err.value.message
    stale = tmp_path / "stale.sock"
    import socket
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # a socket file nobody listens on
    with pytest.raises(CallFailed) as err:
        await UnaryChannel(stale).call(ECHO, b"x", timeout=5)
    assert err.value.code == Status.UNAVAILABLE
    await channel.close()


async def test_a_channel_dials_again_after_the_server_restarted(tmp_path: Path) -> None:
    server = _Served(tmp_path / "r.sock")
    channel = UnaryChannel(server.path)
    await server.start()
    try:
        assert await channel.call(ECHO, b"1", timeout=5) == b"you said 1"
        assert await channel.call(ECHO, b"2", timeout=5) == b"you said 2"
        assert server.accepted == 1
        # the server goes away with a call under way: that call fails, as a gRPC client's would
        pending = asyncio.ensure_future(channel.call(SLOW, b"", timeout=5))
        await asyncio.sleep(0.1)
        await server.stop()
        with pytest.raises(CallFailed) as err:
            await pending
        assert err.value.code == Status.UNAVAILABLE
        await server.start()
        assert await channel.call(ECHO, b"3", timeout=5) == b"you said 3"  # dialled afresh
        assert server.accepted == 2
    finally:
        await channel.close()
        await server.stop()


async def test_after_a_goaway_the_next_call_dials_afresh(tmp_path: Path) -> None:
    """After a GOAWAY the channel dials afresh for the next call. A call still under way on the old
    connection ends as UNAVAILABLE: h2 closes its side of a connection at a GOAWAY and takes no
    answer after it, even one the server still sends (the caller falls back, as for any failure)."""
    import h2.config
    import h2.connection
    import h2.events
    from hyperframe.frame import GoAwayFrame

    path = tmp_path / "goaway.sock"
    first_call = asyncio.Event()
    answer_it = asyncio.Event()
    served: list[asyncio.Task[None]] = []

    async def server_side(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(asyncio.current_task())  # type: ignore[arg-type]
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        first = len(served) == 1
        try:
            while data := await reader.read(65536):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.StreamEnded):
                        if first:  # hold the call, say GOAWAY, answer once told to
                            writer.write(conn.data_to_send())
                            # written as a frame: h2's own GOAWAY would end its side, and answer nothing more
                            writer.write(GoAwayFrame(0, last_stream_id=event.stream_id).serialize())
                            first_call.set()
                            await answer_it.wait()
                        conn.send_headers(event.stream_id, [(":status", "200"), ("content-type", "application/grpc")])
                        conn.send_data(event.stream_id, grpcwire.framed(b"old" if first else b"new"))
                        conn.send_headers(event.stream_id, [("grpc-status", "0")], end_stream=True)
                writer.write(conn.data_to_send())
        finally:
            writer.close()

    server = await asyncio.start_unix_server(server_side, path=str(path))
    channel = UnaryChannel(path)
    try:
        held = asyncio.ensure_future(channel.call(ECHO, b"", timeout=5))
        await asyncio.wait_for(first_call.wait(), 5)
        await asyncio.sleep(0.05)  # the GOAWAY reaches the channel
        assert await channel.call(ECHO, b"", timeout=5) == b"new"  # on a new connection
        answer_it.set()
        with pytest.raises(CallFailed) as err:
            await held
        assert err.value.code == Status.UNAVAILABLE
    finally:
        await channel.close()
        server.close()
        for task in served:
            task.cancel()
        await asyncio.gather(*served, return_exceptions=True)
        await server.wait_closed()


def test_request_headers_are_encoded_once_and_a_table_size_change_is_still_signalled() -> None:
    encoder, decoder = _RequestEncoder(), Decoder()
    headers = [(b":method", b"POST"), (b":path", b"/v1.PodResourcesLister/List"), (b"grpc-timeout", b"5000m")]
    first = encoder.encode(headers)
    assert encoder.encode(list(headers)) is first  # the same headers: the block kept
    assert not encoder.header_table.dynamic_entries  # nothing indexed: a kept block stays valid
    assert [(n.encode(), v.encode()) for n, v in decoder.decode(first)] == headers
    encoder.header_table_size = 0  # as a server's SETTINGS_HEADER_TABLE_SIZE makes h2 do
    resized = encoder.encode(headers)
    assert resized != first and resized[0] & 0xE0 == 0x20  # begins with a dynamic table size update
    assert [(n.encode(), v.encode()) for n, v in decoder.decode(resized)] == headers
    assert encoder.encode(headers) is first  # then the kept block again, which the decoder reads alike
    assert [(n.encode(), v.encode()) for n, v in decoder.decode(first)] == headers
    other = [(b":method", b"POST"), (b":path", b"/runtime.v1.RuntimeService/ContainerStatus"),
             (b"grpc-timeout", b"1000m")]
    assert [(n.encode(), v.encode()) for n, v in decoder.decode(encoder.encode(other))] == other
