"""Record the node's GPUs in the log at start, when they differ from what the log last recorded."""

from __future__ import annotations

from libs.events.codec import StoredEvent
from libs.events.schema import InventoryRecorded
from libs.gpu import Inventory
from libs.ledger.state import LedgerState
from services.allocator.ledger import Ledger

__all__ = ["inventory_event", "record_inventory"]


async def record_inventory(ledger: Ledger, node: str, found: Inventory) -> list[StoredEvent]:
    """Record ``found`` through the ledger unless it is what the log last recorded; the stored event, if any."""

    def decide(state: LedgerState) -> list[InventoryRecorded]:
        changed = inventory_event(node, found, state)
        return [] if changed is None else [changed]

    return await ledger.record(decide)


def inventory_event(node: str, found: Inventory, state: LedgerState) -> InventoryRecorded | None:
    """The event to append, or None when the recorded inventory is the same."""
    event = InventoryRecorded(
        node=node, backend=found.backend, driver_version=found.driver_version, gpus=found.gpus, links=found.links
    )
    return None if state.inventory == event else event
