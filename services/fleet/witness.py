"""The fleet recorder is the witness of every node's log (c2sp.org/tlog-witness semantics, over NATS).

A node's checkpointer (``libs.witness.node``) sends tlog-witness's ``add-checkpoint`` body as an
``AddCheckpoint`` request on its own subject ``gpuledger.<node>.checkpoint``; the central cluster's
permissions let a node publish only its own subjects, so the subject names the node that sent it, and
the witness refuses (403) a checkpoint whose origin is not ``gpuledger/<cluster>/<that node>``. The
answer is the ``WitnessReply`` (the spec's status and body, the witness's verifier key); the node
appends the cosignature to its note, stores it in its state dir and publishes it.

The witness's state (per origin: last cosigned size and root, the origin's key, the cosigned note) is
a table of the recorder's SQL database (``SqlWitnessStore``: compare-and-set), its Ed25519 key is
``<state dir>/witness.key`` (0600, made on first start; ``witness.pub`` beside it is the key to hand
to auditors). Every refusal is counted by kind for ``gpuledger_fleet_witness_failures_total{kind}``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

from sqlalchemy import Engine

from libs.bus import Bus
from libs.config import Settings
from libs.events.subjects import unescape_token
from libs.fleet.witness_store import SqlWitnessStore
from libs.logger import get_logger
from libs.witness import AddCheckpoint, Witness, WitnessReply
from libs.witness.files import load_or_create_key
from libs.witness.node import WITNESS_SUBJECT, origin_of
from libs.witness.note import ALG_COSIGNATURE_V1

__all__ = ["REFUSALS", "WitnessDesk", "open_witness", "witness_key_path", "witness_name"]

_logger = get_logger("fleet-witness")

# tlog-witness status -> the failure kind the metric counts
REFUSALS = {
    400: "malformed",
    403: "forbidden",        # not signed by the origin's key, or sent on another node's subject
    404: "unknown-origin",
    409: "stale-size",       # routine: a node proving from an older size catches up at once
    422: "bad-proof",        # the alarm: the node's log is not an extension of what was cosigned
}


def witness_name(cluster: str) -> str:
    return f"witness.gpuledger/{cluster}"


def witness_key_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / "witness.key"


def open_witness(settings: Settings, engine: Engine) -> Witness:
    """The recorder's witness: its key from the state dir, its state in the recorder's database; it
    enrols a node on first use (the node's permissions bind the subject to the node)."""
    key_path = witness_key_path(settings.state_dir)
    signer = load_or_create_key(key_path, witness_name(settings.cluster_name), ALG_COSIGNATURE_V1)
    pub = key_path.with_suffix(".pub")
    if not pub.exists() or pub.read_text().strip() != signer.verifier.encode():
        pub.write_text(signer.verifier.encode() + "\n")
    prefix = f"gpuledger/{settings.cluster_name}/"
    return Witness(signer, SqlWitnessStore(engine), enroll=True, accept_origin=lambda o: o.startswith(prefix))


class WitnessDesk:
    """Serves every node's checkpoint requests (queue group ``witness``) and counts the refusals."""

    def __init__(self, bus: Bus, witness: Witness, cluster: str) -> None:
        self.bus = bus
        self.witness = witness
        self.cluster = cluster
        self.failures: Counter[str] = Counter()  # refusal kind -> count (the metric)
        self.cosigned = 0

    async def start(self) -> None:
        await self.bus.serve_subjects(WITNESS_SUBJECT, AddCheckpoint, self.handle, queue="witness")

    async def handle(self, subject: str, request: AddCheckpoint) -> WitnessReply:
        node = unescape_token(subject.split(".")[1])
        # the store's commit (fsync) runs off the event loop
        reply = await asyncio.to_thread(self.witness.add_checkpoint, request.body, key=request.key,
                                        origin=origin_of(self.cluster, node))
        if reply.status == 200:
            self.cosigned += 1
        else:
            kind = REFUSALS.get(reply.status, str(reply.status))
            self.failures[kind] += 1
            say = _logger.error if kind == "bad-proof" else _logger.warning
            say("checkpoint refused", node=node, kind=kind, status=reply.status, reason=reply.body)
        return reply
