"""nats-server configuration files for the fleet: the central cluster's servers and a node's leaf broker.

The files are rendered as JSON, which nats-server's configuration parser reads as it is, so every
value is quoted correctly whatever it holds (passwords, paths). The central servers carry the users:
the recorder reads everything in the fleet account; each node's user may only publish its own
subjects and answer the central cluster's requests to its own JetStream domain (what stream sourcing
sends it), and may not subscribe to any other node's subjects or to the central JetStream API.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from libs.events.subjects import Subjects
from libs.fleet.naming import FLEET_ACCOUNT, FLEET_DOMAIN, HUB_INBOX, RECORDER_USER, node_domain, node_user

__all__ = ["HubServer", "NodeLogin", "hub_config", "leaf_config", "node_permissions"]


@dataclass(frozen=True)
class NodeLogin:
    """One node's user in the central cluster."""

    node: str
    password: str


@dataclass(frozen=True)
class HubServer:
    """One server of the central cluster: its name, store and three listening addresses."""

    name: str
    store_dir: Path
    client_port: int
    cluster_port: int
    leaf_port: int
    host: str = "127.0.0.1"
    monitor_port: int = 0  # 0: no HTTP monitoring endpoint
    extra: dict[str, object] = field(default_factory=dict)


def node_permissions(node: str) -> dict[str, object]:
    """What a node's leaf connection may do in the central cluster.

    Stream sourcing is the central cluster asking the node's JetStream (``$JS.<domain>.API``) to create
    a consumer that pushes the node's events to a delivery subject in the central cluster: the node
    must receive those API requests and publish its events, the consumer's flow-control replies and
    heartbeats back. It may not receive another node's API requests or events, nor use the central
    JetStream API (which would let it read the fleet stream).

    Replies cross the leaf link only to whom they are meant for. The node's clients take their reply
    subjects under the node's own prefix (``_INBOX.<node token>``, applied by ``Bus.connect``), and the
    node's user may subscribe only to that prefix: with ``_INBOX.>``, a client on the node's own broker
    received the central cluster's API replies, the messages the recorder fetches from the fleet stream
    and other nodes' replies (publish acks, cosignatures). The node answers requests from the central
    cluster's own clients, whose inboxes are ``HUB_INBOX`` (the recorder probing the node's stream), so
    it may publish there and to no other node's inbox.

    The node also asks the recorder, the witness, to cosign its checkpoints: it publishes its own
    ``gpuledger.<node>.checkpoint`` and receives the reply on its own inbox. For the recorder's queue
    subscription ``gpuledger.*.checkpoint`` to reach a leaf link at all, the node must be allowed to
    subscribe to its own checkpoint subject (NATS checks a wildcard interest sent over a leaf link
    against the allow list in reverse) and no deny may cover it, so the deny list does not name
    ``gpuledger.*.>``: a client of the node's user may still subscribe to no ``gpuledger`` subject but its
    own checkpoint subject (the allow list), and a subscription to every ``gpuledger`` subject made on the
    node's own broker brings no other node's events over the leaf link (``tests/fleet/test_security.py``
    shows both)."""
    subjects = Subjects(node)
    token = subjects.token
    domain = node_domain(node)
    return {
        "publish": {
            # No $JS.FC.>: the hub answers flow control towards the node (subscribe); a node that
            # could publish there could answer for another node's source consumer.
            "allow": [f"gpuledger.{token}.>", "$JS.S.>", "$JSC.R.>", f"{HUB_INBOX}.>", f"$JS.{domain}.>"],
        },
        "subscribe": {
            "allow": [f"$JS.{domain}.API.>", "$JS.FC.>", f"{subjects.inbox}.>", "$JS.ACK.>",
                      f"gpuledger.{token}.checkpoint"],
            "deny": ["$JS.API.>", f"$JS.{FLEET_DOMAIN}.API.>"],
        },
    }


def _accounts(recorder_password: str, nodes: Sequence[NodeLogin], system_password: str) -> dict[str, object]:
    users: list[dict[str, object]] = [{"user": RECORDER_USER, "password": recorder_password}]
    users += [{"user": node_user(n.node), "password": n.password, "permissions": node_permissions(n.node)}
              for n in nodes]
    return {
        FLEET_ACCOUNT: {"jetstream": "enabled", "users": users},
        "SYS": {"users": [{"user": "system", "password": system_password}]},
    }


def hub_config(
    server: HubServer,
    peers: Sequence[HubServer],
    *,
    recorder_password: str,
    nodes: Sequence[NodeLogin] = (),
    system_password: str,
    cluster_name: str = "gpuledger-fleet",
) -> str:
    """A central server: routes to its peers, JetStream (file store, fsync on every write), a leafnode
    listener for the nodes, and the accounts."""
    conf: dict[str, object] = {
        "server_name": server.name,
        "listen": f"{server.host}:{server.client_port}",
        "jetstream": {
            "store_dir": str(server.store_dir),
            "domain": FLEET_DOMAIN,
            # The default fsyncs every 2 minutes but acknowledges at once: a power loss of the
            # cluster loses acknowledged writes (Jepsen, NATS 2.12.1). Every write is fsynced here.
            "sync_interval": "always",
        },
        "cluster": {
            "name": cluster_name,
            "listen": f"{server.host}:{server.cluster_port}",
            "routes": [f"nats://{p.host}:{p.cluster_port}" for p in peers if p.name != server.name],
            "no_advertise": True,
        },
        "leafnodes": {"listen": f"{server.host}:{server.leaf_port}", "no_advertise": True},
        "accounts": _accounts(recorder_password, nodes, system_password),
        "system_account": "SYS",
        **server.extra,
    }
    if server.monitor_port:
        conf["http"] = f"{server.host}:{server.monitor_port}"
    return json.dumps(conf, indent=2)


def leaf_config(
    node: str,
    store_dir: Path,
    *,
    remote_urls: Sequence[str],
    user: str,
    password: str,
    host: str = "127.0.0.1",
    port: int = -1,
) -> str:
    """A node's own broker: JetStream in the node's own domain, joined to the central cluster as a
    leaf node. Local clients use it as before; only the central cluster's sourcing reads from it."""
    from urllib.parse import quote, urlsplit

    urls = []
    for url in remote_urls:
        parts = urlsplit(url)
        if parts.scheme not in ("nats", "tls", "nats-leaf") or not parts.hostname:
            raise ValueError(f"fleet URL {url!r} is not nats://HOST:PORT (the central cluster's leafnode port)")
        netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}:{parts.port or 7422}"
        urls.append(f"{parts.scheme}://{netloc}")
    conf = {
        "server_name": f"gpuledger-{Subjects(node).token}",
        "host": host,
        "port": port,  # -1: any free port (the server logs which)
        "jetstream": {"store_dir": str(store_dir), "domain": node_domain(node)},
        "leafnodes": {"reconnect": "1s", "remotes": [{"urls": urls}]},
    }
    return json.dumps(conf, indent=2)
