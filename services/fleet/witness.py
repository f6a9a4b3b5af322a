"""Where the fleet recorder acts as a witness of each node's log: the hook the witness plugs into.

A node publishes its signed checkpoint (a C2SP signed note) as a request on its own subject
``gpuledger.<node>.witness.checkpoint``; the central cluster's permissions let a node publish only its
own subjects, so the subject names the node that sent it. The recorder hands the note to the
``Witness`` given to it and answers with the cosignature, which it also publishes on
``gpuledger.<node>.witness.cosigned`` for anyone keeping the node's latest cosigned checkpoint. A
refusal (stale size, bad consistency proof, bad signature...) is answered with an error naming its
kind and counted in the recorder's witness-failure metric. Without a witness the request is refused
with 501, so a node learns that nobody cosigns.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import msgspec

from libs.bus import Bus
from libs.errors import ServiceError
from libs.events.subjects import Subjects
from libs.logger import get_logger

__all__ = [
    "CHECKPOINT_REQUESTS",
    "CheckpointDesk",
    "CheckpointRequest",
    "Cosigned",
    "Witness",
    "WitnessRefused",
    "checkpoint_subject",
    "cosigned_subject",
]

CHECKPOINT_REQUESTS = "gpuledger.*.witness.checkpoint"
_logger = get_logger("fleet-witness")


def checkpoint_subject(node: str) -> str:
    return f"{Subjects(node).prefix}.witness.checkpoint"


def cosigned_subject(node: str) -> str:
    return f"{Subjects(node).prefix}.witness.cosigned"


class CheckpointRequest(msgspec.Struct, kw_only=True):
    node: str
    note: str                   # the signed checkpoint, as a C2SP signed note
    proof: list[str] = []       # consistency proof from the last cosigned size (base64 hashes)
    old_size: int = 0           # the size the node believes the witness cosigned last


class Cosigned(msgspec.Struct, kw_only=True):
    node: str
    note: str                   # the checkpoint with the witness's cosignature line(s) appended
    size: int


class WitnessRefused(Exception):
    """``kind``: a short stable name (``stale-size``, ``bad-proof``, ``bad-signature``, ...)."""

    def __init__(self, kind: str, message: str, *, code: int = 409) -> None:
        super().__init__(message)
        self.kind, self.code = kind, code


class Witness(Protocol):
    async def cosign(self, node: str, request: CheckpointRequest) -> Cosigned:
        """Check the checkpoint against the last one cosigned for ``node`` (consistency proof), persist
        the new size atomically, and return the cosigned note; raise ``WitnessRefused`` otherwise."""
        ...


class CheckpointDesk:
    """Serves the checkpoint requests of every node and hands them to the witness."""

    def __init__(self, bus: Bus, witness: Witness | None) -> None:
        self.bus = bus
        self.witness = witness
        self.failures: Counter[str] = Counter()  # refusal kind -> count (the metric)
        self.cosigned = 0

    async def start(self) -> None:
        await self.bus.serve(CHECKPOINT_REQUESTS, CheckpointRequest, self.handle, queue="fleet-witness")

    async def handle(self, req: CheckpointRequest) -> Cosigned:
        if self.witness is None:
            raise ServiceError(501, "this fleet recorder has no witness configured")
        try:
            done = await self.witness.cosign(req.node, req)
        except WitnessRefused as exc:
            self.failures[exc.kind] += 1
            _logger.warning("checkpoint refused", node=req.node, kind=exc.kind, error=str(exc))
            raise ServiceError(exc.code, f"{exc.kind}: {exc}") from exc
        self.cosigned += 1
        await self.bus.publish(cosigned_subject(req.node), done)
        return done
