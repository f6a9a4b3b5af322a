"""The fleet recorder is the witness of every node's log, on a real 3-server central cluster with the node's
broker as a leaf node: checkpoints cosigned over the leaf link, refusals counted by kind, a log rewritten
forward caught by `audit verify --witness`, and `fleet restore --node` that the node's allocator goes on from."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from pathlib import Path

from click.testing import CliRunner

from gpuledger.cli import main
from libs.fleet.stream import ensure_fleet_stream
from libs.store.verify import verify_log
from libs.witness import AddCheckpoint, Checkpoint, WitnessReply
from libs.witness.files import NodeFiles
from libs.witness.node import checkpoint_subject, origin_of
from libs.witness.note import Signer, Verifier, sign_note, verify_cosignature
from libs.witness.witness import add_checkpoint_body
from services.allocator import app as allocator_app
from services.fleet.app import service
from tests.builders import NODE, settings_for
from tests.fleet.helpers import (
    HubCluster,
    LedgerNode,
    cosigned_now,
    free_ports,
    metric_samples,
    node_checkpointer,
    recorder_settings,
    start_fleet_node,
)
from tests.polling import eventually
from tests.witness.helpers import rewrite_forward


async def cli(*args: str) -> tuple[int, str]:
    """The gpuledger CLI in a thread (commands that run their own event loop)."""
    result = await asyncio.to_thread(CliRunner().invoke, main, list(args))
    crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
    return result.exit_code, result.output + (repr(result.exception) if crashed else "")


async def test_the_recorder_cosigns_checkpoints_counts_refusals_and_a_rewritten_log_fails(
        hub: HubCluster, short_dir: Path) -> None:
    node = await start_fleet_node(hub, short_dir / "a", "alpha")
    base = free_ports(1)[0] - 4
    settings = recorder_settings(hub, short_dir / "rec", metrics_port=base)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(node.broker.stop)
        stack.push_async_callback(node.ledger.stop)
        svc = await stack.enter_async_context(service(settings, source_interval=0.5))
        witness_key = Verifier.parse((short_dir / "rec" / "witness.pub").read_text())
        assert witness_key == svc.desk.witness.verifier
        for _ in range(5):
            await node.ledger.grant()
        cp = await node_checkpointer(node.ledger)
        note = await cosigned_now(cp, 6)  # the inventory and 5 grants, cosigned over the leaf link
        assert verify_cosignature(note, witness_key) > 0
        assert NodeFiles(node.ledger.root).witness_verifier() == witness_key  # the node pinned it
        held = svc.desk.witness.store.get(origin_of("test", "alpha"))  # in the recorder's SQL database
        assert held is not None and held.size == 6 and held.note == note.encode()
        ok, out = await cli("audit", "verify", "--witness", "--state-dir", str(node.ledger.root),
                      "--witness-key", f"@{short_dir / 'rec' / 'witness.pub'}")
        assert ok == 0, out

        # refusals, each counted by kind: a stale size (the node thinks the witness holds 0)...
        bus = node.ledger.bus
        assert bus is not None
        stale = add_checkpoint_body(0, [], note.encode())
        reply = await bus.request(checkpoint_subject(bus), AddCheckpoint(stale), WitnessReply, timeout=5)
        assert (reply.status, reply.body) == (409, "6")
        # ...and a checkpoint of another node sent on alpha's own subject (a node speaks only for itself)
        beta = Signer.generate(origin_of("test", "beta"))
        other = sign_note(Checkpoint(origin_of("test", "beta"), 1, b"\0" * 32).text(), beta)
        reply = await bus.request(checkpoint_subject(bus), AddCheckpoint(add_checkpoint_body(0, [], other.encode()),
                                                                         beta.verifier.encode()),
                                  WitnessReply, timeout=5)
        assert reply.status == 403, reply
        assert svc.desk.witness.store.get(origin_of("test", "beta")) is None

        # the node's log rewritten forward (seq 3 edited, every later hash recomputed): the chain passes,
        # the witness check names seq 3, and the node's next checkpoint is refused as a bad proof
        await node.ledger.stop()
        rewrite_forward(node.ledger.log_path, 3)
        ok, out = await cli("audit", "verify", "--state-dir", str(node.ledger.root))
        assert ok == 0, out
        ok, out = await cli("audit", "verify", "--witness", "--json", "--state-dir", str(node.ledger.root),
                      "--witness-key", f"@{short_dir / 'rec' / 'witness.pub'}")
        assert ok == 1, out
        report = json.loads(out)["witness"]
        assert (report["ok"], report["first_bad_seq"]) == (False, 3), report
        again = await LedgerNode("alpha", node.ledger.root, node.broker.url).start()
        stack.push_async_callback(again.stop)
        await again.grant()
        cp = await node_checkpointer(again)
        assert await cp.checkpoint() is None
        assert cp.refusals == 1 and cp.last_refusal.startswith("422"), cp.last_refusal
        assert svc.desk.witness.store.get(origin_of("test", "alpha")).size == 6  # type: ignore[union-attr]

        samples = await asyncio.to_thread(metric_samples, base + 4)
        failures = {labels[0][1]: value for (name, labels), value in samples.items()
                    if name == "gpuledger_fleet_witness_failures_total"}
        assert failures == {"stale-size": 1, "forbidden": 1, "bad-proof": 1}
        assert samples[("gpuledger_fleet_witness_cosigned_total", ())] == 1


async def test_fleet_restore_rebuilds_a_node_whose_allocator_goes_on(hub: HubCluster, short_dir: Path) -> None:
    node = await start_fleet_node(hub, short_dir / "n", NODE)
    settings = recorder_settings(hub, short_dir / "rec")
    restored = short_dir / "alloc" / "state"
    async with AsyncExitStack() as stack:
        stack.push_async_callback(node.broker.stop)
        stack.push_async_callback(node.ledger.stop)
        recorder = await hub.recorder_bus()
        stack.push_async_callback(recorder.close)
        await ensure_fleet_stream(recorder.js, [NODE])
        svc = await stack.enter_async_context(service(settings, source_interval=0.5))
        grants = [await node.ledger.grant() for _ in range(4)]
        await node.ledger.release(grants[1])
        cp = await node_checkpointer(node.ledger)
        await cosigned_now(cp, 6)
        for _ in range(2):  # two events after the checkpoint: in the copy, not yet witnessed
            await node.ledger.grant()
        await eventually(lambda: svc.projection.last_seqs().get(NODE) == 8,
                         timeout=30, interval=0.2, what="the node's 8 events recorded from the fleet stream")
        await node.ledger.stop()  # the node's disk dies (its broker, and the node's stream, stay)

        ok, out = await cli("fleet", "restore", "--node", NODE, "--state-dir", str(restored), "--nats-url",
                      hub.client_urls(), "--recorder-dir", str(short_dir / "rec"), "--cluster-name", "test", "--json")
        assert ok == 0, out
        report = json.loads(out)
        assert (report["events"], report["witnessed_size"], report["skipped"]) == (8, 6, 0), report
        assert verify_log(restored / "ledger.sqlite").head_hash == verify_log(node.ledger.log_path).head_hash
        ok, out = await cli("audit", "verify", "--witness", "--state-dir", str(restored))
        assert ok == 0, out
        ok, out = await cli("fleet", "restore", "--node", NODE, "--state-dir", str(restored), "--nats-url",
                      hub.client_urls(), "--recorder-dir", str(short_dir / "rec"), "--cluster-name", "test")
        assert ok == 1 and "exists" in out, out  # never over a ledger

        # the node's allocator on the restored ledger: replays it, appends seq 9, which reaches the fleet
        alloc = settings_for(short_dir / "alloc", node.broker.url, cluster_name="test", checkpoint_every=0,
                             metrics_port=0)
        async with allocator_app.service(alloc) as allocator:
            assert allocator.ledger.state.seq == 9  # its own inventory (fake GPUs), after the 8 restored
            await eventually(lambda: svc.projection.last_seqs().get(NODE) == 9, timeout=30, interval=0.2,
                             what="seq 9 from the restored node recorded, no gap")
        assert svc.ingest.gaps == 0 and svc.ingest.rejected == 0
        assert verify_log(restored / "ledger.sqlite").ok
