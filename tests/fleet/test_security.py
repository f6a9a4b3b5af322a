"""Accounts and users in the central cluster: a node publishes only its own subjects and reads no other
node's events; the recorder refuses an event that speaks for another node."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import nats
import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import ServiceUnavailableError
from prometheus_client.parser import text_string_to_metric_families

from libs.bus import Bus
from libs.config import Settings
from libs.errors import BusError
from libs.events import InventoryRecorded, Subjects
from libs.events.codec import StoredEvent, to_record
from libs.fleet.naming import FLEET_STREAM, HUB_INBOX, node_domain, node_user
from libs.fleet.stream import ensure_fleet_stream
from libs.witness import AddCheckpoint, WitnessReply
from libs.witness.node import checkpoint_subject
from services.fleet.app import service
from tests.fleet.helpers import (
    HubCluster,
    LeafBroker,
    cosigned_now,
    free_ports,
    gpus_of,
    node_checkpointer,
    recorder_settings,
    start_fleet_node,
)
from tests.polling import eventually


async def _node_client(hub: HubCluster, node: str) -> Bus:
    login = hub.add_node(node)
    return await Bus.connect(hub.client_urls(node_user(node), login.password), name="intruder", node=node, wait=10)


async def test_a_node_may_not_publish_or_read_another_nodes_subjects(hub: HubCluster) -> None:
    recorder = await hub.recorder_bus()
    seen: list[str] = []

    async def on_any(msg: dict[str, str]) -> None:
        seen.append(msg["what"])

    alpha = await _node_client(hub, "alpha")
    try:
        await recorder.subscribe("gpuledger.>", dict, on_any)
        await recorder.subscribe("$JS.FC.>", dict, on_any)  # where a source consumer's flow control is answered
        await recorder.flush()
        async def own_arrives(what: str) -> bool:  # until the recorder's interest reached alpha's server
            await alpha.publish(Subjects("alpha").event("alloc.granted"), {"what": what})
            await asyncio.sleep(0.05)
            return what in seen

        await eventually(lambda: own_arrives("own"), timeout=10, interval=0.05, what="alpha's own publish")
        await alpha.publish(Subjects("beta").event("alloc.granted"), {"what": "forged"})  # refused by the server
        await alpha.publish("$JS.FC.FLEET.beta.1", {"what": "flow control"})  # only the hub answers there
        await alpha.publish(Subjects("alpha").event("alloc.granted"), {"what": "after"})
        await eventually(lambda: "after" in seen, timeout=10, interval=0.05, what="alpha's next publish")
        # one connection keeps its order: these would have come before "after"
        assert "forged" not in seen and "flow control" not in seen, seen
        # reading: another node's subjects, and the central JetStream API (the fleet stream), are refused
        leaked: list[str] = []

        async def on_leak(msg: dict[str, str]) -> None:
            leaked.append(msg["what"])

        await alpha.subscribe(Subjects("beta").event("alloc.granted"), dict, on_leak)
        await alpha.flush()
        await recorder.publish(Subjects("beta").event("alloc.granted"), {"what": "beta's"})
        await recorder.flush()
        await asyncio.sleep(0.5)
        assert leaked == []
        await ensure_fleet_stream(recorder.js, [], replicas=3)
        assert (await recorder.js.stream_info(FLEET_STREAM)).config.name == FLEET_STREAM  # the recorder reads it
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):  # no answer for a node
            await asyncio.wait_for(alpha.js.stream_info(FLEET_STREAM), 8)
    finally:
        await alpha.close()
        await recorder.close()


async def test_the_recorder_refuses_an_event_for_another_node(hub: HubCluster, short_dir: Path) -> None:
    """A node that controls its own broker can put anything in its own stream: a record on another
    node's subject, or an inventory naming another node. The recorder refuses both (and stores nothing
    for the other node) because the fleet stream says which node's stream each event came from."""
    mallory = await start_fleet_node(hub, short_dir / "m", "mallory")
    honest = await start_fleet_node(hub, short_dir / "h", "honest")
    (short_dir / "rec").mkdir()
    base = free_ports(1)[0] - 4
    settings = Settings(node_name="rec", state_dir=str(short_dir / "rec"), nats_url=hub.client_urls(),
                        fleet_db=f"sqlite:///{short_dir / 'rec' / 'fleet.sqlite'}", metrics_port=base,
                        metrics_host="127.0.0.1")
    recorder = await hub.recorder_bus()
    async with AsyncExitStack() as stack:
        stack.push_async_callback(recorder.close)
        for n in (mallory, honest):
            stack.push_async_callback(n.stop)
        await ensure_fleet_stream(recorder.js, [mallory.name, honest.name])
        svc = await stack.enter_async_context(service(settings, source_interval=0.5))
        await mallory.ledger.grant()
        # Mallory widens her own stream to capture honest's subjects and publishes in honest's name.
        local = mallory.ledger.bus
        assert local is not None
        await mallory.ledger.relay.wait_published(2, timeout=10)  # type: ignore[union-attr]
        info = await local.js.stream_info(Subjects("mallory").stream)
        config = info.config
        config.subjects = [*(config.subjects or []), f"{Subjects('honest').prefix}.>"]
        await local.js.update_stream(config)
        forged = StoredEvent(seq=2, recorded_at=1, stream_id="inventory", version=2, event_id="f" * 32,
                             event=InventoryRecorded(node="honest", backend="fake", gpus=gpus_of("honest")))
        await local.js.publish(Subjects("honest").event("inventory.recorded"), msgspec.json.encode(to_record(forged)),
                               stream=Subjects("mallory").stream)
        # ...and an inventory naming honest on her own subject
        await local.js.publish(Subjects("mallory").event("inventory.recorded"),
                               msgspec.json.encode(to_record(msgspec.structs.replace(forged, seq=4))),
                               stream=Subjects("mallory").stream)
        await honest.ledger.grant()
        await eventually(lambda: svc.ingest.rejected >= 2 and svc.projection.last_seqs().get("honest") == 2,
                         timeout=30, interval=0.2, what="two forged events refused, honest's own recorded")
        assert svc.projection.folds["honest"].events == 2  # only its own inventory and grant
        assert svc.projection.folds["mallory"].last_seq == 2
        # the recorder's metrics say so too: ingested, refused, per-node lag and last seq
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{base + 4}/metrics", timeout=5).read().decode())
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert samples[("gpuledger_fleet_events_rejected_total", ())] == 2
        assert samples[("gpuledger_fleet_events_ingested_total", ())] == 4
        assert samples[("gpuledger_fleet_node_last_seq", (("node", "honest"),))] == 2
        assert ("gpuledger_fleet_node_lag_events", (("node", "honest"),)) in samples
        assert samples[("gpuledger_fleet_silent_nodes", ())] == 0


async def test_a_node_asks_the_witness_over_its_leaf_and_reads_no_other_nodes_events_there(
        hub: HubCluster, short_dir: Path) -> None:
    """The node's user may publish its checkpoint request and receive the reply over the leaf link (the
    recorder's wildcard queue subscription reaches the leaf), while a subscriber on the node's own broker
    to every gpuledger subject gets no other node's events from the central cluster."""
    alpha = await start_fleet_node(hub, short_dir / "a", "alpha")
    async with AsyncExitStack() as stack:
        stack.push_async_callback(alpha.broker.stop)
        stack.push_async_callback(alpha.ledger.stop)
        svc = await stack.enter_async_context(service(recorder_settings(hub, short_dir / "rec")))
        bus = alpha.ledger.bus
        assert bus is not None

        async def asked() -> WitnessReply | None:
            try:
                return await bus.request(checkpoint_subject(bus), AddCheckpoint("not a request"), WitnessReply,
                                         timeout=2)
            except BusError:
                return None

        reply = await eventually(asked, timeout=20, interval=0.2, what="the witness answering over the leaf link")
        assert reply.status == 400 and svc.desk.failures["malformed"] >= 1

        # the node's own broker subscribes to every gpuledger subject: another node's events, published in
        # the central cluster, never come over the leaf link
        local = await Bus.connect(alpha.broker.url, name="listener", node="alpha", wait=10)
        stack.push_async_callback(local.close)
        seen: list[str] = []

        async def on_any(msg: dict[str, str]) -> None:
            seen.append(msg["what"])

        await local.subscribe("gpuledger.>", dict, on_any)
        await local.flush()
        await eventually(asked, timeout=20, interval=0.2, what="the leaf link carrying requests again")
        recorder = await hub.recorder_bus()
        stack.push_async_callback(recorder.close)
        for _ in range(10):
            await recorder.publish(Subjects("beta").event("alloc.granted"), {"what": "beta's"})
            await asyncio.sleep(0.1)
        await recorder.flush()
        await asyncio.sleep(0.5)
        assert seen == []


async def test_a_nodes_broker_receives_no_other_nodes_sourced_events_or_replies(
        hub: HubCluster, short_dir: Path) -> None:
    """Another node's sourced events never reach a node's broker: the deliveries (``$JS.S.>``) and
    consumer-create replies (``$JSC.R.>``) a node's user publishes for its own sourcing are not in its
    subscribe permissions, so a listener on the node's own broker to every subject sees none of them."""
    alpha = await start_fleet_node(hub, short_dir / "a", "alpha")
    beta = await start_fleet_node(hub, short_dir / "b", "beta")
    async with AsyncExitStack() as stack:
        for n in (alpha, beta):
            stack.push_async_callback(n.stop)
        local = await Bus.connect(alpha.broker.url, name="listener", node="alpha", wait=10)
        stack.push_async_callback(local.close)
        seen: list[str] = []

        def listener(subject: str) -> Callable[[object], Awaitable[None]]:
            async def on_any(msg: object) -> None:
                seen.append(f"{subject}: {msgspec.json.encode(msg).decode()}")
            return on_any

        for subject in ("$JS.S.>", "_INBOX.>", "$JSC.R.>", "$JS.FC.>", "$JS.ACK.>", "$JS.node-beta.API.>", ">"):
            await local.subscribe(subject, object, listener(subject))
        await local.flush()
        recorder = await hub.recorder_bus()
        stack.push_async_callback(recorder.close)
        await ensure_fleet_stream(recorder.js, ["alpha", "beta"])
        for _ in range(10):
            await beta.ledger.grant()
        want = beta.ledger.event_log.last_seq + alpha.ledger.event_log.last_seq  # type: ignore[union-attr]

        async def all_in() -> bool:
            return (await recorder.js.stream_info(FLEET_STREAM)).state.messages >= want

        await eventually(all_in, timeout=30, interval=0.2, what="both nodes' events in the fleet stream")
        await asyncio.sleep(0.5)
        # (no reply meant for beta or the hub reaches it either: the next test)
        assert not [m for m in seen if "GPU-beta" in m], [m[:200] for m in seen if "GPU-beta" in m][:3]


async def test_a_nodes_broker_receives_no_reply_meant_for_another_node_or_the_hub(
        hub: HubCluster, short_dir: Path) -> None:
    """Replies cross the leaf link only to the node that asked: a listener on alpha's broker to every
    inbox (``_INBOX.>``) and to beta's own (``_INBOX.beta.>``) receives none of beta's cosignatures,
    none of the recorder's JetStream traffic (API replies, the fleet stream's events it fetches), while
    beta's checkpoints are cosigned and the recorder reads beta's stream over beta's leaf link."""
    alpha = LeafBroker("alpha", short_dir / "a", hub)  # a broker only: nothing of alpha's own asks anything
    await alpha.start()
    beta = await start_fleet_node(hub, short_dir / "b", "beta")
    async with AsyncExitStack() as stack:
        stack.push_async_callback(alpha.stop)
        stack.push_async_callback(beta.broker.stop)
        stack.push_async_callback(beta.ledger.stop)
        # a plain client, as an intruder on alpha's broker would use: every message counts, empty ones too
        local = await nats.connect(alpha.url, name="listener")
        stack.push_async_callback(local.close)
        seen: list[str] = []

        async def on_any(msg: Msg) -> None:
            seen.append(f"{msg.subject}: {msg.data[:200]!r}")

        for subject in ("_INBOX.>", f"{Subjects('beta').inbox}.>", f"{HUB_INBOX}.>"):
            await local.subscribe(subject, cb=on_any)
        await local.flush()
        recorder = await hub.recorder_bus()
        stack.push_async_callback(recorder.close)
        await ensure_fleet_stream(recorder.js, ["beta"])
        svc = await stack.enter_async_context(service(recorder_settings(hub, short_dir / "rec")))
        cp = await node_checkpointer(beta.ledger)
        for size in (2, 3, 4):
            await beta.ledger.grant()
            await cosigned_now(cp, size)  # beta's request crossed its leaf link and the reply came back
        assert svc.desk.cosigned >= 3
        # the recorder reaches beta's own JetStream over the leaf link (its probe of an unserved source).
        # The hub's servers learn of beta's domain as the link's interest crosses their routes, so a
        # first probe can find no responder yet (as the recorder's own probe can: it asks again later).
        async def beta_stream() -> api.StreamInfo | None:
            try:
                return await recorder.js_domain(node_domain("beta"), timeout=5).stream_info(Subjects("beta").stream)
            except ServiceUnavailableError:  # no responder for beta's domain on this server yet
                return None

        info = await eventually(beta_stream, timeout=15, interval=0.2, what="beta's stream info over its leaf link")
        assert info.state.messages == 4
        await eventually(lambda: svc.projection.last_seqs().get("beta") == 4,
                         timeout=30, interval=0.2, what="beta's events fetched by the recorder")
        await local.flush()
        await asyncio.sleep(0.5)
        assert seen == [], seen[:5]


async def test_a_nodes_backlog_beyond_the_flow_control_window_reaches_the_fleet_stream(
        hub: HubCluster, short_dir: Path) -> None:
    """Sourcing pushes a node's events in flow-control windows (about 2 MB here): the node's consumer
    sends the next window only once the fleet stream's flow-control reply (``$JS.FC.>``) came back over
    the leaf link. A node user without that subject in its subscribe allow list gets its first window
    into the fleet stream and no more: NATS then reports the source "stalled on flow control"."""
    bulk = await start_fleet_node(hub, short_dir / "n", "bulk")
    async with AsyncExitStack() as stack:
        stack.push_async_callback(bulk.broker.stop)
        stack.push_async_callback(bulk.ledger.stop)
        ledger = bulk.ledger
        assert ledger.event_log is not None and ledger.relay is not None and ledger.bus is not None
        await ledger.grant_many(5000)
        await ledger.relay.wait_published(ledger.event_log.last_seq, timeout=60)
        node_stream = await ledger.bus.js.stream_info(Subjects("bulk").stream)
        assert node_stream.state.bytes > 4 << 20  # at least two windows
        recorder = await hub.recorder_bus()
        stack.push_async_callback(recorder.close)
        await ensure_fleet_stream(recorder.js, ["bulk"])
        want = ledger.event_log.last_seq

        async def all_in() -> bool:
            return (await recorder.js.stream_info(FLEET_STREAM)).state.messages >= want

        await eventually(all_in, timeout=60, interval=0.5, what=f"all {want} of the node's events in the fleet stream")
        info = await recorder.js.stream_info(FLEET_STREAM)
        assert info.state.messages == want
        assert [s.error for s in info.sources or []] == [None]
