"""NATS subject names: ``gpuledger.<node>.<domain>.<verb>``.

Facts (committed log events) use the event's own type as ``<domain>.<verb>`` (``alloc.granted``) and
are captured by the node's JetStream stream. Commands (request/reply) use the addressed service as the
domain (``allocator.allocate``), so a subscriber to ``gpuledger.<node>.alloc.>`` sees only facts.

Node names may hold dots (``ip-10-0-0-1.ec2.internal``), which separate subject tokens, so the node
token is escaped: every byte outside ``[a-z0-9-]`` becomes ``_XX`` (hex). The escape is reversible.
"""

from __future__ import annotations

import re

from libs.events.schema import EVENT_TYPES

__all__ = ["Subjects", "escape_token", "unescape_token"]

_SAFE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
_ESCAPED = re.compile(r"_([0-9A-F]{2})")


def escape_token(value: str) -> str:
    if not value:
        raise ValueError("a subject token cannot be empty")
    out = []
    for ch in value:
        if ch in _SAFE:
            out.append(ch)
        else:
            out.extend(f"_{byte:02X}" for byte in ch.encode())
    return "".join(out)


def unescape_token(token: str) -> str:
    raw = bytearray()
    i = 0
    while i < len(token):
        m = _ESCAPED.match(token, i)
        if m:
            raw.append(int(m.group(1), 16))
            i = m.end()
        else:
            raw.extend(token[i].encode())
            i += 1
    return raw.decode()


class Subjects:
    """All subjects of one node."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.token = escape_token(node)
        self.prefix = f"gpuledger.{self.token}"
        # JetStream stream names may not hold '.', '*', '>' or path separators: the token has none.
        self.stream = f"GPULEDGER_{self.token}"
        # The node's clients take their reply subjects under this prefix: in a fleet, the node's user
        # may receive only these replies over its leaf link (never another node's or the hub's).
        self.inbox = f"_INBOX.{self.token}"

    def _cmd(self, service: str, verb: str) -> str:
        return f"{self.prefix}.{service}.{verb}"

    # --- commands (request/reply) ---
    @property
    def allocate(self) -> str:
        return self._cmd("allocator", "allocate")

    @property
    def prestart(self) -> str:
        return self._cmd("allocator", "prestart")

    @property
    def release(self) -> str:
        return self._cmd("allocator", "release")

    @property
    def inventory(self) -> str:
        return self._cmd("allocator", "inventory")

    @property
    def state(self) -> str:
        return self._cmd("allocator", "state")

    @property
    def archive(self) -> str:
        return self._cmd("allocator", "archive")

    @property
    def claim_prepare(self) -> str:
        """DRA NodePrepareResources, one claim: registrar -> allocator."""
        return self._cmd("allocator", "claim-prepare")

    @property
    def claim_unprepare(self) -> str:
        """DRA NodeUnprepareResources (or the watchdog's claim reconciliation): -> allocator."""
        return self._cmd("allocator", "claim-unprepare")

    @property
    def gpu_mode(self) -> str:
        """Move idle GPUs between the device plugin and the DRA driver: -> allocator."""
        return self._cmd("allocator", "gpu-mode")

    @property
    def kubelet_list(self) -> str:
        """The kubelet's List the registrar asked as an Allocate came in, sent on when answered
        (KubeletListing, core NATS): -> allocator."""
        return self._cmd("allocator", "kubelet-list")

    @property
    def pods(self) -> str:
        return self._cmd("watchdog", "pods")

    @property
    def prepare(self) -> str:
        return self._cmd("vmanager", "prepare")

    # --- facts ---
    def event(self, type_name: str) -> str:
        return f"{self.prefix}.{type_name}"

    def event_subjects(self) -> list[str]:
        """What the node's stream captures: one wildcard per event domain."""
        domains = sorted({t.split(".", 1)[0] for t in EVENT_TYPES})
        return [f"{self.prefix}.{d}.*" for d in domains]

    @property
    def watchdog_ready(self) -> str:
        """The watchdog answers ``watchdog.pods`` again (started, or reconnected): copies of its pod view
        resync now, since the notifications sent meanwhile were lost (core NATS only)."""
        return f"{self.prefix}.watchdog.ready"

    def pod_fact(self, verb: str) -> str:
        """Pod lifecycle notifications from the watchdog (core NATS only, not in the log)."""
        return f"{self.prefix}.pod.{verb}"
