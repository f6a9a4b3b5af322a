"""Allocation state folded from the event log."""

from libs.ledger.state import Allocation, GpuUsage, LedgerSnapshot, LedgerState

__all__ = ["Allocation", "GpuUsage", "LedgerSnapshot", "LedgerState"]
