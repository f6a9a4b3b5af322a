"""The allocator's ledger: the event log, the state folded from it, and the one lock that orders both.

`Ledger.record` is the only code that appends to the allocation log (the Allocate handlers, the
health watcher and the inventory step all go through it, each with its own decision). Every change
follows the same order: decide under the lock, append the event (durable when append returns), fold
it into the in-memory state, then answer. A reply therefore never promises anything the log does not
hold, and replaying the log rebuilds exactly the state the replies described.

The lock never leaves this class: a decision that must see the state no other writer changes
meanwhile (is this container still free? does this GPU still fit?) is the ``decide`` callable,
called with the lock held. Readers (metrics, snapshots, annotations, matching) read ``state``
without the lock: the event loop runs one thing at a time, and the state only changes in ``record``.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence

from libs.events.codec import StoredEvent
from libs.events.schema import Event
from libs.ledger.state import LedgerState
from libs.store.log import EventLog
from services.allocator.observer import AllocatorObserver

__all__ = ["Decide", "Ledger"]

# The caller's decision against the current state: the events to record (none is fine), or raise.
Decide = Callable[[LedgerState], Sequence[Event] | Awaitable[Sequence[Event]]]


class Ledger:
    def __init__(self, event_log: EventLog, state: LedgerState, *, observer: AllocatorObserver | None = None) -> None:
        self._log = event_log
        self._state = state
        self._lock = asyncio.Lock()
        self._observer = observer or AllocatorObserver()

    @property
    def state(self) -> LedgerState:
        """The folded state, to read; it changes only in `record`."""
        return self._state

    async def record(self, decide: Decide, *, command_id: str | None = None) -> list[StoredEvent]:
        """Under the lock: ``decide(state)``, append what it returns (durable on return), fold each
        stored event into the state. The stored events, in seq order; [] when it decided nothing.
        What ``decide`` raises goes to the caller, and nothing is recorded."""
        async with self._lock:
            decided = decide(self._state)
            events = await decided if inspect.isawaitable(decided) else decided
            if not events:
                return []
            started = time.perf_counter()
            try:
                stored = await self._log.append(events, command_id=command_id)
            finally:
                self._observer.append_done(time.perf_counter() - started)
            for ev in stored:
                self._state.apply(ev)
            return stored

    async def record_events(self, events: Sequence[Event], *, command_id: str | None = None) -> list[StoredEvent]:
        """`record` of events decided beforehand: for a change that holds whatever the state is."""
        return await self.record(lambda _state: events, command_id=command_id)
