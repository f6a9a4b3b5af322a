"""The allocator runs the checkpointer: its log is cosigned by a witness on the same NATS, and the state dir
then passes `audit verify --witness`."""

from __future__ import annotations

from pathlib import Path

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.witness import Checkpoint, Witness
from libs.witness.audit import verify_against_witness
from libs.witness.files import NodeFiles
from services.allocator import app as allocator_app
from tests.builders import settings_for
from tests.polling import eventually


async def test_the_allocators_log_is_cosigned(nats_server: NatsServer, witness_bus: tuple[Witness, Bus],
                                              short_dir: Path) -> None:
    witness, _ = witness_bus
    settings = settings_for(short_dir, nats_server.url, cluster_name="test", checkpoint_interval=0.2,
                            metrics_port=0)
    async with allocator_app.service(settings) as service:
        cp = service.checkpointer
        assert cp is not None and cp.origin == f"gpuledger/test/{settings.node_name}"
        await eventually(lambda: cp.cosigned is not None, timeout=15, interval=0.05, what="a cosigned checkpoint")
        size = Checkpoint.parse(cp.cosigned.text).size  # type: ignore[union-attr]
        assert size >= 1  # the inventory the allocator recorded at start, at least
    report = verify_against_witness(settings.log_path, NodeFiles(settings.state_dir), witness_key=witness.verifier)
    assert report.ok and report.checkpoint_size == size, report
