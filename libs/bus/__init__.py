"""NATS: the connection, the embedded server, the outbox relay and the log follower."""

import libs.bus.natsimport  # noqa: F401  (first: nats without aiohttp, before any module below imports nats)
from libs.bus.client import Bus
from libs.bus.follow import LogFollower
from libs.bus.outbox import Relay, ensure_stream
from libs.bus.server import NatsServer, find_nats_server

__all__ = ["Bus", "LogFollower", "NatsServer", "Relay", "ensure_stream", "find_nats_server"]
