"""The bus's typed subscriptions, on a real nats-server: each payload is decoded once into its type, a
payload that does not decode is logged and skipped, and the next good one still arrives."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

import msgspec
import nats
import pytest
import structlog
from nats.aio.msg import Msg

from libs.bus import Bus, NatsServer
from libs.bus.client import after_reply
from libs.commands import PodChanged, PodsReply, PodsRequest
from libs.errors import RemoteError, ServiceError
from libs.events.codec import StoredEvent, to_record
from libs.events.schema import AllocationReleased, GpuHealthChanged
from libs.kube.pods import Pod


def _pod_changed(name: str) -> PodChanged:
    pod = msgspec.convert({"metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"}}, Pod)
    return PodChanged(kind="ADDED", pod=pod)


def _stored(seq: int, event: AllocationReleased | GpuHealthChanged) -> StoredEvent:
    return StoredEvent(seq=seq, recorded_at=1_700_000_000_000_000_000 + seq, stream_id="s", version=seq,
                       event_id=f"{seq:032x}", command_id=f"cmd-{seq}", event=event)


async def _collect(received: list, count: int) -> None:
    """Wait (5 s at most) for ``count`` deliveries; the caller's assertion then says what is missing."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5):
            while len(received) < count:  # noqa: ASYNC110 (filled by the subscription's callback)
                await asyncio.sleep(0.01)


async def test_subscribe_decodes_into_the_type_and_skips_what_does_not_decode(nats_server: NatsServer) -> None:
    bus = await Bus.connect(nats_server.url, name="t", node="n1")
    publisher = await nats.connect(nats_server.url, name="publisher")  # a plain client: any bytes at all
    received: list[PodChanged] = []

    async def on_change(change: PodChanged) -> None:
        received.append(change)

    try:
        subject = bus.subjects.pod_fact("*")
        await bus.subscribe(subject, PodChanged, on_change)
        await bus.flush()  # the broker has the subscriptions before the publisher sends
        with structlog.testing.capture_logs() as logs:
            await publisher.publish(bus.subjects.pod_fact("added"), b"{not json")
            await publisher.publish(bus.subjects.pod_fact("added"), b'{"kind": "ADDED"}')  # no pod
            await publisher.publish(bus.subjects.pod_fact("added"), msgspec.json.encode(_pod_changed("good")))
            await publisher.flush()
            await _collect(received, 1)
    finally:
        await publisher.close()
        await bus.close()
    assert received == [_pod_changed("good")], f"logged meanwhile: {logs}"
    skipped = [e for e in logs if e["event"] == "unreadable message"]
    assert [(e["subject"], e["type"], e["log_level"]) for e in skipped] == [
        (bus.subjects.pod_fact("added"), "PodChanged", "warning")] * 2


async def test_subscribe_events_hands_over_stored_events(nats_server: NatsServer) -> None:
    bus = await Bus.connect(nats_server.url, name="t", node="node.a")
    publisher = await nats.connect(nats_server.url, name="publisher")
    received: list[StoredEvent] = []

    async def on_event(stored: StoredEvent) -> None:
        received.append(stored)

    released = _stored(7, AllocationReleased(alloc_id="a1", pod_uid="p1", container="c", reason="deleted"))
    health = _stored(8, GpuHealthChanged(index=0, uuid="GPU-0", healthy=False, reason="xid", xid=79))
    unknown = {**msgspec.to_builtins(to_record(released)), "seq": 9, "type": "alloc.teleported"}
    try:
        for subject in bus.subjects.event_subjects():
            await bus.subscribe_events(subject, on_event)
        await bus.flush()  # the broker has the subscriptions before the publisher sends
        with structlog.testing.capture_logs() as logs:
            # as the outbox relay publishes them: the JSON record on the event's own subject
            await publisher.publish(bus.subjects.event(released.type), msgspec.json.encode(to_record(released)))
            await publisher.publish(bus.subjects.event("alloc.released"), b"[]")  # not a record
            await publisher.publish(bus.subjects.event("alloc.released"), msgspec.json.encode(unknown))
            await publisher.publish(bus.subjects.event(health.type), msgspec.json.encode(to_record(health)))
            await publisher.flush()
            await _collect(received, 2)
            delivered = bus._nc.stats["in_msgs"]  # what reached this client, decodable or not
    finally:
        await publisher.close()
        await bus.close()
    # The message says whether an event never reached the client or reached it and was dropped here.
    assert received == [released, health], f"{delivered} of 4 messages delivered; logged meanwhile: {logs}"
    skipped = [e for e in logs if e["event"] == "unreadable event"]
    assert [e["subject"] for e in skipped] == [bus.subjects.event("alloc.released")] * 2
    assert "alloc.teleported" in skipped[1]["error"]


async def test_the_bus_reports_its_connection(nats_server: NatsServer) -> None:
    bus = await Bus.connect(nats_server.url, name="t", node="n1")
    assert not bus.is_closed and bus.reconnects == 0
    await bus.close()
    assert bus.is_closed
    await bus.close()  # a second close is harmless


async def test_replies_come_under_the_nodes_own_inbox_prefix(nats_server: NatsServer) -> None:
    """A request's reply subject is under ``_INBOX.<node token>`` (what a fleet node's user may receive
    over its leaf link), or under the prefix the caller names (the central cluster's clients)."""
    responder = await nats.connect(nats_server.url, name="responder")  # a plain client: says where it replies

    async def echo_reply_subject(msg: Msg) -> None:
        await msg.respond(msgspec.json.encode({"reply": msg.reply}))

    await responder.subscribe("who", cb=echo_reply_subject)
    await responder.flush()
    node_bus = await Bus.connect(nats_server.url, name="t", node="node.a")
    hub_bus = await Bus.connect(nats_server.url, name="t", node="node.a", inbox_prefix="_INBOX.FLEET")
    try:
        assert node_bus.subjects.inbox == "_INBOX.node_2Ea"
        mine = await node_bus.request("who", {}, dict, timeout=5)
        theirs = await hub_bus.request("who", {}, dict, timeout=5)
    finally:
        await node_bus.close()
        await hub_bus.close()
        await responder.close()
    assert mine["reply"].startswith("_INBOX.node_2Ea.") and len(mine["reply"].split(".")) == 4, mine
    assert theirs["reply"].startswith("_INBOX.FLEET."), theirs


async def test_closing_with_a_stuck_handler_is_bounded_and_leaves_no_unretrieved_error(
        nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler that never finishes, with messages queued behind it: close() gives the drain its
    time, then closes anyway, and asyncio has no "exception was never retrieved" to report (a drain
    cancelled from outside left one, printed at the end of bench.fleet)."""
    monkeypatch.setattr("libs.bus.client.DRAIN_TIMEOUT_S", 0.5)
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(str(context.get("message"))))
    try:
        bus = await Bus.connect(nats_server.url, name="stuck", node="n1")
        stuck = asyncio.Event()

        async def never_done(_change: PodChanged) -> None:
            stuck.set()
            await asyncio.Event().wait()

        await bus.subscribe(bus.subjects.pod_fact("added"), PodChanged, never_done)
        await bus.flush()
        for i in range(5):
            await bus.publish(bus.subjects.pod_fact("added"), _pod_changed(f"p{i}"))
        await bus.flush()
        await asyncio.wait_for(stuck.wait(), 5)
        started = loop.time()
        await bus.close()
        assert loop.time() - started < 3
        for _ in range(3):  # the unretrieved error is reported when its future is collected
            gc.collect()
            await asyncio.sleep(0.05)
        assert not [r for r in reported if "never retrieved" in r], reported
    finally:
        loop.set_exception_handler(previous)


async def test_a_flushed_subscription_answers_another_connection_at_once(nats_server: NatsServer) -> None:
    """After ``serve`` and ``flush``, a request from another connection finds its responder, every
    time: the flush's PING no longer overtakes the subscription (the broker answered 503, no
    responders, in one CI run of the pod cache's race test)."""
    responder = await Bus.connect(nats_server.url, name="responder", node="n1")
    asker = await Bus.connect(nats_server.url, name="asker", node="n1")

    async def answer(req: PodsRequest) -> PodsReply:
        return PodsReply(pods=[])

    try:
        for i in range(300):
            subject = f"{responder.subjects.prefix}.flushed.{i}"
            await responder.serve(subject, PodsRequest, answer)
            await responder.flush()
            reply = await asker.request(subject, PodsRequest(), PodsReply, timeout=5)
            assert reply.pods == [], i
    finally:
        await asker.close()
        await responder.close()


async def test_work_left_after_a_reply_does_not_hold_the_reply_back(nats_server: NatsServer) -> None:
    """What a handler leaves for after its reply (``after_reply``, as the allocator leaves a grant's
    bookkeeping) runs after the connection has written the reply. Here that work blocks the serving loop
    for a second: an asker on a loop of its own, in another thread, has its reply long before the work
    ends. Run before the write, the work would hold the reply for it."""
    responder = await Bus.connect(nats_server.url, name="responder", node="n1")
    subject = f"{responder.subjects.prefix}.after-reply"
    finished: list[float] = []

    def block(replied: float | None) -> None:
        time.sleep(1.0)  # the serving loop is stuck meanwhile (the GIL is free for the asker)
        finished.append(time.monotonic())

    async def answer(req: PodsRequest) -> PodsReply:
        after_reply(block)
        return PodsReply(pods=[])

    def ask() -> float:
        async def asking() -> float:
            asker = await nats.connect(nats_server.url, name="asker")
            try:
                await asker.request(subject, msgspec.json.encode(PodsRequest()), timeout=5)
                return time.monotonic()
            finally:
                await asker.close()

        return asyncio.run(asking())

    try:
        await responder.serve(subject, PodsRequest, answer)
        await responder.flush()
        answered = await asyncio.to_thread(ask)
        assert finished, "the work left for after the reply never ran"
        assert answered < finished[0] - 0.5, f"the reply came {answered - finished[0]:+.3f} s after the work ended"
    finally:
        await responder.close()


async def test_work_left_after_a_reply_runs_when_the_handler_fails(nats_server: NatsServer) -> None:
    """A handler that failed after leaving work for after its reply (the allocator: a grant recorded,
    then an error) still has that work done, told that no reply was handed over."""
    responder = await Bus.connect(nats_server.url, name="responder", node="n1")
    asker = await Bus.connect(nats_server.url, name="asker", node="n1")
    subject = f"{responder.subjects.prefix}.after-failure"
    done: list[float | None] = []

    async def answer(req: PodsRequest) -> PodsReply:
        after_reply(done.append)
        raise ServiceError(409, "refused after recording")

    try:
        await responder.serve(subject, PodsRequest, answer)
        await responder.flush()
        with pytest.raises(RemoteError, match="refused after recording"):
            await asker.request(subject, PodsRequest(), PodsReply, timeout=5)
        async with asyncio.timeout(5):
            while not done:  # noqa: ASYNC110 (filled on the responder's next loop turn)
                await asyncio.sleep(0.01)
        assert done == [None]
    finally:
        await asker.close()
        await responder.close()
