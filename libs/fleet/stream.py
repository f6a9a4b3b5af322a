"""The fleet stream: one replicated stream in the central cluster that sources every node's stream.

Each source reads ``GPULEDGER_<node>`` through the node's JetStream domain (``$JS.<domain>.API``):
the central cluster creates a consumer on the node's broker over the leaf link, which delivers the
node's events in stream order (stream seq == log seq), resumes after the last one the fleet stream
holds when the link returns, and never delivers one twice. No gpuledger code is on that path: what
reaches the fleet stream is what the node's relay committed to its own stream, subject, headers
(event id, row hash) and all, plus NATS's ``Nats-Stream-Source`` header naming the origin.

Sources are added in bulk (one stream update for every node that joined since the last one): an
update costs time in proportion to the sources already configured, so adding them one by one would
make growing a fleet quadratic.

A source whose consumer could not be created (its create request went over a leaf link that died
with a central server, say) is retried by NATS only after a back-off of tens of seconds, and an
update that leaves the sources as they are changes nothing: ``restart_sources`` takes such sources
out and puts them back, which makes the stream's leader create their consumers at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Iterable

import nats.errors
from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, NotFoundError

from libs.events.subjects import Subjects
from libs.fleet.naming import FLEET_STREAM, node_domain
from libs.logger import get_logger

_logger = get_logger("fleet")

# A JetStream API request can go unanswered while the cluster elects a leader; every step of
# ensure_fleet_stream is idempotent (the same create, sources already there), so it is asked again.
_ENSURE_TRIES = 3
# "no suitable peers for placement" (JetStream's err_code 10005): a server that will hold a replica is
# not known to the cluster as online yet (it has just started, or is restarting). That passes by
# itself, so the create is asked again for up to PLACEMENT_WAIT_S before the error is the caller's.
NO_PEERS_FOR_PLACEMENT = 10005
PLACEMENT_WAIT_S = 10.0
_PLACEMENT_RETRY_S = (0.1, 1.0)  # the first wait, doubled up to the second

__all__ = ["add_nodes", "ensure_fleet_stream", "fleet_stream_config", "node_source", "remove_nodes",
           "restart_sources", "sourced_nodes", "unserved_sources"]


def node_source(node: str) -> api.StreamSource:
    return api.StreamSource(
        name=Subjects(node).stream,
        external=api.ExternalStream(api=f"$JS.{node_domain(node)}.API", deliver=""),
    )


def fleet_stream_config(nodes: Iterable[str], *, replicas: int = 3) -> api.StreamConfig:
    return api.StreamConfig(
        name=FLEET_STREAM,
        description="every committed event of every gpuledger node, sourced from each node's stream",
        storage=api.StorageType.FILE,
        retention=api.RetentionPolicy.LIMITS,
        num_replicas=replicas,
        deny_delete=True,
        deny_purge=True,
        allow_direct=True,
        sources=[node_source(n) for n in sorted(set(nodes))],
    )


async def ensure_fleet_stream(js: JetStreamContext, nodes: Iterable[str] = (), *, replicas: int = 3,
                              placement_wait: float = PLACEMENT_WAIT_S) -> api.StreamInfo:
    """Create the fleet stream with these nodes' sources (all in one create), or add the missing ones;
    a request left unanswered is asked again, ``_ENSURE_TRIES`` times in all, and one refused for want
    of online peers for the replicas, for up to ``placement_wait`` seconds."""
    nodes = list(nodes)
    unanswered = 0
    deadline = time.monotonic() + placement_wait
    wait, longest = _PLACEMENT_RETRY_S
    while True:
        try:
            return await _create_or_extend(js, nodes, replicas)
        except nats.errors.TimeoutError:
            unanswered += 1
            if unanswered >= _ENSURE_TRIES:
                raise
            _logger.warning("a JetStream request on the fleet stream went unanswered: asking again", attempt=unanswered)
        except BadRequestError as exc:
            if exc.err_code != NO_PEERS_FOR_PLACEMENT or time.monotonic() + wait > deadline:
                raise
            _logger.warning("no online peers for the fleet stream's replicas yet (a server starting?): asking again",
                            error=exc.description, retry_in_s=wait)
            await asyncio.sleep(wait)
            wait = min(longest, wait * 2)


async def _create_or_extend(js: JetStreamContext, nodes: list[str], replicas: int) -> api.StreamInfo:
    try:
        await js.stream_info(FLEET_STREAM)
    except NotFoundError:
        return await js.add_stream(fleet_stream_config(nodes, replicas=replicas))
    return await add_nodes(js, nodes)


def sourced_nodes(info: api.StreamInfo) -> set[str]:
    """The stream names the fleet stream sources (``GPULEDGER_<token>``)."""
    return {s.name for s in info.config.sources or []}


async def add_nodes(js: JetStreamContext, nodes: Iterable[str]) -> api.StreamInfo:
    """Source these nodes too: one stream update for all of them, none if they are all there."""
    info = await js.stream_info(FLEET_STREAM)
    have = sourced_nodes(info)
    fresh = [node_source(n) for n in sorted(set(nodes)) if Subjects(n).stream not in have]
    if not fresh:
        return info
    config = info.config
    config.sources = [*(config.sources or []), *fresh]
    return await js.update_stream(config)


async def remove_nodes(js: JetStreamContext, nodes: Iterable[str]) -> api.StreamInfo:
    """Stop sourcing these nodes (a node that left the fleet); what the stream holds of them stays."""
    info = await js.stream_info(FLEET_STREAM)
    gone = {Subjects(n).stream for n in nodes}
    config = info.config
    config.sources = [s for s in config.sources or [] if s.name not in gone]
    return await js.update_stream(config)


def unserved_sources(info: api.StreamInfo) -> list[str]:
    """The sources (stream names) for which the stream's leader holds no consumer: NATS reports their
    ``active`` as -1 (a served source's is the time since it last heard from the node, heartbeats
    included, about a second at most)."""
    return [s.name for s in info.sources or [] if s.active is not None and s.active < 0]


async def restart_sources(js: JetStreamContext, names: Collection[str]) -> api.StreamInfo:
    """Have the fleet stream's leader create these sources' consumers now: one update without them,
    one with them back in their places. On the second the leader finds, in the fleet stream itself,
    the last event it holds of each (its ``Nats-Stream-Source`` header) and resumes right after it,
    so nothing is sourced twice. Only for sources with no consumer (``unserved_sources``): none has
    an event on its way into the stream."""
    info = await js.stream_info(FLEET_STREAM)
    config = info.config
    sources = list(config.sources or [])
    config.sources = [s for s in sources if s.name not in names]
    if len(config.sources) == len(sources):
        return info
    await js.update_stream(config)
    config.sources = sources
    return await js.update_stream(config)
