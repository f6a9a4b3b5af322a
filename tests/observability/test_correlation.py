"""The correlation fields bound for a request or an event, and the request id carried across NATS."""

from __future__ import annotations

import nats
import structlog

from libs.bus.client import REQUEST_ID_HEADER, Bus
from libs.bus.server import NatsServer
from libs.commands import PrepareReply, PrepareRequest, ReleaseReply, ReleaseRequest
from libs.logger import correlation


def test_correlation_fields() -> None:
    req = ReleaseRequest(pod_uid="p1", reason="deleted", request_id="")
    assert correlation(req) == {"pod_uid": "p1"}
    assert correlation(req, request_id="r9") == {"pod_uid": "p1", "request_id": "r9"}
    assert correlation(ReleaseRequest(pod_uid="p1", reason="x", request_id="own"), request_id=None) == {
        "pod_uid": "p1", "request_id": "own"}
    assert correlation(object()) == {}


async def test_request_id_travels_in_a_header_unless_the_request_carries_it_and_is_bound_in_the_handler(
    nats_server: NatsServer,
) -> None:
    server = await Bus.connect(nats_server.url, name="server", node="n")
    client = await Bus.connect(nats_server.url, name="client", node="n")
    wire = await nats.connect(nats_server.url, name="spy")  # sees the requests as they travel, headers and all
    seen: list[dict[str, object]] = []
    headers: list[object] = []

    async def prepare(req: PrepareRequest) -> PrepareReply:
        seen.append(structlog.contextvars.get_contextvars())
        return PrepareReply(directory="d", socket="s")

    async def release(req: ReleaseRequest) -> ReleaseReply:
        seen.append(structlog.contextvars.get_contextvars())
        return ReleaseReply(released=[])

    async def spy(msg) -> None:  # type: ignore[no-untyped-def]
        headers.append((msg.headers or {}).get(REQUEST_ID_HEADER))

    try:
        await server.serve("t.prepare", PrepareRequest, prepare)
        await server.serve("t.release", ReleaseRequest, release)
        await wire.subscribe("t.*", cb=spy)
        await wire.flush()
        await server.flush()
        with structlog.contextvars.bound_contextvars(request_id="abc"):
            await client.request("t.prepare", PrepareRequest(pod_uid="p1"), PrepareReply, timeout=5)
        await client.request("t.release", ReleaseRequest(pod_uid="p2", reason="x", request_id="own"), ReleaseReply,
                             timeout=5)
        with structlog.contextvars.bound_contextvars(request_id="caller"):  # the caller's id wins over the request's
            await client.request("t.release", ReleaseRequest(pod_uid="p4", reason="x", request_id="own"),
                                 ReleaseReply, timeout=5)
        await client.request("t.prepare", PrepareRequest(pod_uid="p3"), PrepareReply, timeout=5)
        await wire.flush()  # every request the spy saw has arrived; draining hands each to the callback
    finally:
        await wire.drain()
        await client.close()
        await server.close()
    assert headers == ["abc", None, "caller", None]  # a request that carries its own id needs no header
    assert [{k: v for k, v in ctx.items() if k != "service"} for ctx in seen] == [
        {"request_id": "abc", "pod_uid": "p1"},
        {"request_id": "own", "pod_uid": "p2"},
        {"request_id": "caller", "pod_uid": "p4"},
        {"pod_uid": "p3"},  # nothing left over from the earlier requests
    ]
