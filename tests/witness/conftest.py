"""Fixtures of the witness tests: a witness answering on a real nats-server, and a node's log and checkpointer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.witness import AddCheckpoint, FileWitnessStore, Signer, Witness
from libs.witness.node import WITNESS_SUBJECT
from libs.witness.note import ALG_COSIGNATURE_V1


@pytest.fixture
async def witness_bus(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[tuple[Witness, Bus]]:
    """A witness that enrols nodes on first use, serving gpuledger.*.checkpoint (what the fleet recorder does)."""
    bus = await Bus.connect(nats_server.url, name="witness", node="witness", wait=5)
    witness = Witness(Signer.generate("witness.gpuledger/test", ALG_COSIGNATURE_V1),
                      FileWitnessStore(tmp_path / "witness"), enroll=True)
    await bus.serve(WITNESS_SUBJECT, AddCheckpoint, witness.handle, queue="witness")
    await bus.flush()
    yield witness, bus
    await bus.close()
