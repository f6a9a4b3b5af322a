"""The fleet: nodes' brokers as leaf nodes of a central NATS cluster, one fleet stream, the recorder's tables."""

from libs.fleet.credentials import Credentials, load_credentials, with_credentials
from libs.fleet.naming import FLEET_DOMAIN, FLEET_STREAM, node_domain, node_user
from libs.fleet.natsconf import HubServer, NodeLogin, hub_config, leaf_config, node_permissions
from libs.fleet.stream import add_nodes, ensure_fleet_stream, fleet_stream_config, remove_nodes

__all__ = [
    "FLEET_DOMAIN", "FLEET_STREAM", "Credentials", "HubServer", "NodeLogin", "add_nodes", "ensure_fleet_stream",
    "fleet_stream_config", "hub_config", "leaf_config", "load_credentials", "node_domain", "node_permissions",
    "node_user", "remove_nodes", "with_credentials",
]
