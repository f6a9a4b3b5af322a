"""Names shared by the node, the central cluster and the recorder: domains, the fleet stream, users.

Every node's broker is a leaf node of the central cluster with a JetStream domain of its own, so that
its stream and every Allocate stay on the node. The central cluster reaches a node's stream through
that domain's API prefix (``$JS.<domain>.API``), which is how the fleet stream sources it.
"""

from __future__ import annotations

from libs.events.subjects import Subjects

__all__ = ["FLEET_ACCOUNT", "FLEET_DOMAIN", "FLEET_STREAM", "HUB_INBOX", "RECORDER_USER", "SOURCE_HEADER",
           "node_domain", "node_user", "source_stream"]

FLEET_DOMAIN = "fleet"          # the central cluster's JetStream domain
FLEET_STREAM = "FLEET"          # the one stream holding every node's committed events
FLEET_ACCOUNT = "FLEET"         # the account the nodes and the recorder share in the central cluster
RECORDER_USER = "recorder"
SOURCE_HEADER = "Nats-Stream-Source"  # NATS's header on a sourced message: "<stream>[:<hash>] <seq> ..."
# The inbox prefix of the central cluster's own clients (the recorder, `gpuledger fleet` commands). A
# node's clients use ``_INBOX.<node token>`` (``Subjects.inbox``); a token is lower case and ``_XX``
# escapes, so no node's prefix is this one and no node's user may receive the hub's replies.
HUB_INBOX = "_INBOX.FLEET"


def source_stream(header: str) -> str:
    """The stream a sourced message came from, by its ``Nats-Stream-Source`` header ("" without one)."""
    return header.split(" ", 1)[0].split(":", 1)[0]


def node_domain(node: str) -> str:
    """The JetStream domain of a node's own broker (distinct per node: domains differ across leaf links)."""
    return f"node-{Subjects(node).token}"


def node_user(node: str) -> str:
    """The central cluster's user a node's leaf connection logs in as."""
    return f"node-{Subjects(node).token}"
