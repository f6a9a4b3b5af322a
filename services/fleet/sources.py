"""The recorder's watch over the fleet stream's sources: their state for the metrics, and a restart of
any source that NATS left without a consumer.

Every ``interval`` the recorder reads the fleet stream's per-source state (how far behind each node
the stream is, when the source last heard from it). A source with no consumer (NATS reports its
``active`` as -1) for ``UNSERVED_GRACE_S`` whose node answers through its own JetStream domain (its
leaf link is up) is restarted with ``libs.fleet.stream.restart_sources``. NATS itself would retry it
only after a back-off of tens of seconds: when the central server carrying a node's leaf link is
SIGKILLed while the source's consumer is being created, the fleet stream otherwise misses that node
for about 40 s, although the leaf is back on another server within a second. A node that does not
answer is left alone (its link is down: there is nothing to create the consumer on), and a source
is restarted again only after a back-off (``RETRY_FIRST_S`` doubling up to ``RETRY_MAX_S``).

A restart is two stream updates (without the sources, then with them): the nodes are written to
``<state dir>/fleet-sources-restarting.json`` before the first, and removed after the second, so a
recorder that died between the two puts those sources back when it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors

from libs.bus import Bus
from libs.events.subjects import Subjects, unescape_token
from libs.fleet.naming import FLEET_STREAM, node_domain
from libs.fleet.stream import add_nodes, restart_sources, unserved_sources
from libs.logger import get_logger

__all__ = ["RESTARTING_FILE", "SourceState", "SourceWatch"]

_logger = get_logger("fleet-sources")

RESTARTING_FILE = "fleet-sources-restarting.json"
UNSERVED_GRACE_S = 1.0   # a new leader or a fresh source takes a moment to create its consumer
INFO_TIMEOUT_S = 2.0     # no answer while the stream's leader is being elected: ask again next sweep
PROBE_TIMEOUT_S = 1.0    # the node's own JetStream, over its leaf link
RETRY_FIRST_S = 5.0
RETRY_MAX_S = 60.0
_NATS_ERRORS = (TimeoutError, nats.errors.Error, OSError)


@dataclass
class SourceState:
    lag: int = 0           # events the node's stream holds that the fleet stream does not yet
    active_s: float = 0.0  # seconds since the source last heard from the node (-1: no consumer)
    error: str = ""


def _node_of(stream: str) -> str:
    return unescape_token(stream.removeprefix("GPULEDGER_"))


@dataclass
class SourceWatch:
    bus: Bus
    state_dir: Path | None = None
    interval: float = 1.0
    sources: dict[str, SourceState] = field(default_factory=dict)  # by node
    restarts: int = 0  # sources restarted
    _unserved_since: dict[str, float] = field(default_factory=dict)  # by stream name
    _next_try: dict[str, float] = field(default_factory=dict)
    _backoff: dict[str, float] = field(default_factory=dict)

    @property
    def _intent(self) -> Path | None:
        return Path(self.state_dir) / RESTARTING_FILE if self.state_dir else None

    async def run(self) -> None:
        await self._finish_interrupted()
        while True:
            await self.sweep()
            await asyncio.sleep(self.interval)

    async def sweep(self) -> None:
        try:
            info = await asyncio.wait_for(self.bus.js.stream_info(FLEET_STREAM), INFO_TIMEOUT_S)
        except _NATS_ERRORS as exc:  # no stream yet, or its leader is being elected
            _logger.warning("fleet stream info unavailable", error=str(exc) or type(exc).__name__)
            return
        self.sources = {_node_of(s.name): SourceState(lag=s.lag or 0, active_s=(s.active or 0) / 1e9,
                                                      error=str((s.error or {}).get("description", "")))
                        for s in info.sources or []}
        due = self._due(unserved_sources(info), time.monotonic())
        if not due:
            return
        answers = await asyncio.gather(*(self._reachable(_node_of(name)) for name in due))
        ready = [name for name, ok in zip(due, answers, strict=True) if ok]
        if ready:
            await self._restart(ready)

    def _due(self, unserved: list[str], now: float) -> list[str]:
        for name in set(self._unserved_since) - set(unserved):  # served again
            for table in (self._unserved_since, self._next_try, self._backoff):
                table.pop(name, None)
        for name in unserved:
            self._unserved_since.setdefault(name, now)
        return [name for name in unserved
                if now - self._unserved_since[name] >= UNSERVED_GRACE_S and now >= self._next_try.get(name, 0.0)]

    async def _reachable(self, node: str) -> bool:
        try:
            await self.bus.js_domain(node_domain(node), timeout=PROBE_TIMEOUT_S).stream_info(Subjects(node).stream)
            return True
        except _NATS_ERRORS:
            return False

    async def _restart(self, names: list[str]) -> None:
        self._write_intent([_node_of(n) for n in names])
        try:
            await restart_sources(self.bus.js, set(names))
        except _NATS_ERRORS as exc:  # e.g. no JetStream meta leader (being elected): try again next sweep
            _logger.warning("fleet sources not restarted", sources=names, error=str(exc) or type(exc).__name__)
            await self._put_back([_node_of(n) for n in names])  # never leave them out of the stream
            return
        self._clear_intent()
        now = time.monotonic()
        for name in names:  # restarted, and still unserved later: NATS could not create the consumer either
            self._backoff[name] = min(self._backoff.get(name, RETRY_FIRST_S / 2) * 2, RETRY_MAX_S)
            self._next_try[name] = now + self._backoff[name]
        self.restarts += len(names)
        _logger.info("fleet sources restarted (NATS left them without a consumer)", sources=names)

    def _write_intent(self, nodes: list[str]) -> None:
        if self._intent is None:
            return
        self._intent.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._intent.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(nodes)))
        os.replace(tmp, self._intent)

    def _clear_intent(self) -> None:
        if self._intent is not None:
            with contextlib.suppress(FileNotFoundError):
                self._intent.unlink()

    async def _finish_interrupted(self) -> None:
        """Put back the sources of a restart that stopped between its two updates (retried until the
        stream takes them: until then their nodes are not sourced)."""
        if self._intent is not None and self._intent.exists():
            await self._put_back(json.loads(self._intent.read_text()))
            _logger.info("fleet sources put back after an interrupted restart")

    async def _put_back(self, nodes: list[str]) -> None:
        while True:
            try:
                await add_nodes(self.bus.js, nodes)
                break
            except _NATS_ERRORS as exc:
                _logger.warning("fleet sources not put back yet", nodes=nodes, error=str(exc) or type(exc).__name__)
                await asyncio.sleep(1.0)
        self._clear_intent()

