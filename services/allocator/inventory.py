"""Record the node's GPUs in the log at start, when they differ from what the log last recorded."""

from __future__ import annotations

from libs.events.schema import InventoryRecorded
from libs.gpu import Inventory
from libs.ledger.state import LedgerState

__all__ = ["inventory_event"]


def inventory_event(node: str, found: Inventory, state: LedgerState) -> InventoryRecorded | None:
    """The event to append, or None when the recorded inventory is the same."""
    event = InventoryRecorded(
        node=node, backend=found.backend, driver_version=found.driver_version, gpus=found.gpus, links=found.links
    )
    return None if state.inventory == event else event
